"""Keras' distribution API (``keras.distribution``) on the TensorFlow backend, through tfdist.

Why: Keras 3's TensorFlow backend ``distribution_lib`` is a prototype marked "!!!DO NOT
USE!!!": ``list_devices`` sees this process only, ``initialize``, ``num_processes``,
``process_id`` and ``distribute_tensor`` are missing, ``set_distribution`` changes nothing
TensorFlow sees (``fit`` trains on one device), and a TF variable never asks the
distribution for its layout. Keras has no public extension point for any of this, so
`install_when_imported` patches, once, when Keras loads its distribution module:

- the backend module's functions (``keras.src.backend.tensorflow.distribution_lib``),
  which Keras' public functions call at run time;
- ``keras.src.distribution.distribution_lib.set_distribution`` (also what
  ``Distribution.scope()`` calls) and its public re-exports;
- ``Distribution.distribute_dataset`` (Keras' data adapter calls it);
- the TF backend ``Variable._initialize``: the layout is resolved when a variable is
  created, as Keras' JAX backend does (``JaxVariable._initialize_layout``).

Each patch calls the tfdist function handed in (``tfdist.keras.distribution``, passed in
by ``tfdist/__init__.py``: hooks never import up). Under another Keras backend nothing is
patched. ``tests/test_hooks_keras_distribution.py`` fails loudly when a Keras upgrade
removes what they touch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

DISTRIBUTION_MODULE = "keras.src.distribution.distribution_lib"
BACKEND_MODULE = "keras.src.backend.tensorflow.distribution_lib"
# Modules that re-export Keras' public distribution functions (bound at their import).
PUBLIC_MODULES = ("keras.distribution", "keras._tf_keras.keras.distribution")
# The backend functions tfdist provides (Keras' public functions look them up by name).
BACKEND_FUNCTIONS = ("list_devices", "get_device_count", "initialize", "num_processes",
                     "process_id", "distribute_tensor", "distribute_value")


def install_when_imported(load_api) -> None:
    """Patches Keras' distribution API as soon as Keras loads it (now, if it has).

    Args:
        load_api: ``f()`` returning the module with tfdist's functions
            (`tfdist.keras.distribution`); called only once Keras is loading.
    """
    if DISTRIBUTION_MODULE in sys.modules:
        _install(sys.modules[DISTRIBUTION_MODULE], load_api)
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(DISTRIBUTION_MODULE, load_api))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the patch right after Keras executes its distribution module, before
    ``keras.distribution`` re-exports its functions. Python has no post-import hook: this
    finder wraps the real loader of that one module."""

    def __init__(self, name, load_api):
        self.name, self.load_api, self.busy = name, load_api, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.load_api)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, load_api):
        self.loader, self.load_api = loader, load_api

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _install(module, self.load_api)


def _install(distribution_lib, load_api) -> None:
    backend = sys.modules.get(BACKEND_MODULE)
    if backend is None or getattr(distribution_lib, "_tfdist_installed", False):
        return  # another Keras backend: Keras' own distribution API runs
    from keras.src.backend import backend as backend_name

    if backend_name() != "tensorflow":
        return
    api = load_api()
    for name in BACKEND_FUNCTIONS:
        setattr(backend, name, getattr(api, name))
    _patch_set_distribution(distribution_lib, api)
    _patch_distribute_dataset(distribution_lib.Distribution, api)
    _patch_variable_creation(api)
    distribution_lib._tfdist_installed = True


def _patch_set_distribution(distribution_lib, api) -> None:
    original = distribution_lib.set_distribution

    def set_distribution(value):
        # Why: the tfdist strategy must become TF's default (variables are created under
        # it) whenever Keras' distribution changes: set_distribution and scope().
        api.on_set_distribution(value, set_keras=original)

    set_distribution.__doc__ = original.__doc__
    set_distribution.__wrapped__ = original
    distribution_lib.set_distribution = set_distribution
    for name in PUBLIC_MODULES:  # already imported (Keras loaded before tfdist)
        module = sys.modules.get(name)
        if module is not None and getattr(module, "set_distribution", None) is original:
            module.set_distribution = set_distribution


def _patch_distribute_dataset(distribution_class, api) -> None:
    original = distribution_class.distribute_dataset

    def distribute_dataset(self, dataset):
        # Why: under a multi-worker tfdist strategy each worker's Keras shard must reach
        # its replicas as it is (TF would shard the dataset a second time).
        return api.distribute_dataset(self, dataset, keras_shard=lambda d: original(self, d))

    distribute_dataset.__doc__ = original.__doc__
    distribution_class.distribute_dataset = distribute_dataset


def _patch_variable_creation(api) -> None:
    from keras.src.backend.common import global_state
    from keras.src.backend.tensorflow.core import Variable

    original = Variable._initialize

    def _initialize(self, value):
        distribution = global_state.get_global_attribute("distribution")
        if distribution is not None:
            if self._shape is None and not callable(value):  # as JaxVariable._initialize
                self._shape = self._validate_shape(value.shape)
            api.check_variable_layout(distribution, self.path,
                                      distribution.get_variable_layout(self))
        return original(self, value)

    _initialize.__wrapped__ = original  # what it chains to
    Variable._initialize = _initialize


def layout_map_of(model_parallel):
    """The `keras.distribution.LayoutMap` of a ``ModelParallel`` (Keras keeps it private)."""
    return model_parallel._layout_map


def is_installed() -> bool:
    """Whether Keras' distribution module has been patched."""
    module = sys.modules.get(DISTRIBUTION_MODULE)
    return bool(module is not None and getattr(module, "_tfdist_installed", False))
