"""tfdist: distributed Keras 3 training on TensorFlow 2.21, in every mode.

``import tfdist`` does not import TensorFlow: the strategies load on first use, so the
launcher starts fast and `tfdist.devices.use_logical_cpus` can run before TF starts.
"""

__version__ = "0.1.0"

import importlib

from tfdist import devices
from tfdist.cluster import ClusterSpec, TaskSpec
from tfdist.comm.options import CommunicationOptions
from tfdist.launch import LaunchError, LaunchResult, launch
from tfdist._hooks.keras_distribution import install_when_imported as _install_keras_distribution
from tfdist.strategies import registry as _registry

# Public name -> module that defines it (the strategy registry); imported on first access.
_LAZY = _registry.public_names()

__all__ = sorted(["ClusterSpec", "CommunicationOptions", "LaunchError", "LaunchResult",
                  "TaskSpec", "devices", "launch", *_LAZY])


# keras.distribution on the TensorFlow backend runs through tfdist's strategies
# (docs/keras_distribution.md): patched when Keras loads it, or now if it has.
_install_keras_distribution(lambda: importlib.import_module("tfdist.keras.distribution"))

# Subpackages loaded on first attribute access: tfdist.keras imports Keras; ray and
# spark import their engines; tfdist.engines is the engine plug-in API.
_LAZY_MODULES = {"engines": "tfdist.engines", "keras": "tfdist.keras", "ray": "tfdist.ray",
                 "spark": "tfdist.spark"}


def __getattr__(name):
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
