"""Glue Keras needs for distributed training: chief-aware callbacks.

``tfdist.keras.callbacks`` holds `ModelCheckpoint`, `BackupAndRestore` and
`MetricsLogger`. Importing this package imports Keras (and TensorFlow); ``import
tfdist`` alone does not, and loads ``tfdist.keras`` on first attribute access.
"""

from tfdist.keras import callbacks

__all__ = ["callbacks"]
