"""Glue Keras needs for distributed training: chief-aware callbacks, side-car evaluation.

``tfdist.keras.callbacks`` holds `ModelCheckpoint`, `BackupAndRestore` and
`MetricsLogger`; ``tfdist.keras.guards`` holds `StopOnNaN`; `SidecarEvaluator` evaluates the chief's checkpoints in an evaluator
task; `ShardedOptimizer` shards an optimizer's state over the replicas; ``tfdist.keras.handoff`` is the contract between strategies and Keras
(`KerasHandoff`); ``tfdist.keras.distribution`` runs ``keras.distribution`` on TensorFlow
(installed by ``import tfdist``; docs/keras_distribution.md). Importing this package imports nothing: ``callbacks``, ``guards`` and
`SidecarEvaluator` (which import Keras and TensorFlow) load on first attribute access,
so strategies can import the hand-off without an import circle.
"""

import importlib

# Public name -> module that defines it (the module itself for a submodule's name).
_LAZY = {"callbacks": "tfdist.keras.callbacks", "guards": "tfdist.keras.guards",
         "SidecarEvaluator": "tfdist.keras.evaluator",
         "ShardedOptimizer": "tfdist.strategies.zero.optimizer"}

__all__ = ["ShardedOptimizer", "SidecarEvaluator", "callbacks", "guards"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'tfdist.keras' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if _LAZY[name].endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
