"""Glue Keras needs for distributed training: chief-aware callbacks, side-car evaluation.

``tfdist.keras.callbacks`` holds `ModelCheckpoint`, `BackupAndRestore` and
`MetricsLogger`; `SidecarEvaluator` evaluates the chief's checkpoints in an evaluator
task. Importing this package imports Keras (and TensorFlow); ``import tfdist`` alone
does not, and loads ``tfdist.keras`` on first attribute access.
"""

from tfdist.keras import callbacks
from tfdist.keras.evaluator import SidecarEvaluator

__all__ = ["SidecarEvaluator", "callbacks"]
