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
  created, as Keras' JAX backend does (``JaxVariable._initialize_layout``);
- ``keras.Model``'s `MODEL_CALLS`, from the first distribution set on (outside tfdist's
  Keras hand-off, `tfdist._hooks.keras`): each runs under the strategy its model was
  built under (Keras' private ``_distribute_strategy``; None: none), as on JAX.

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
# keras.Model methods that run under the strategy the model was built under.
MODEL_CALLS = ("compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
               "predict_on_batch", "get_weights", "set_weights", "save", "save_weights",
               "load_weights", "export")
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
        if value is not None:  # its strategy has installed tfdist's Keras hooks
            _patch_model_calls(api, set_keras=original)

    set_distribution.__doc__ = original.__doc__
    set_distribution.__wrapped__ = original
    distribution_lib.set_distribution = set_distribution
    for name in PUBLIC_MODULES:  # already imported (Keras loaded before tfdist)
        module = sys.modules.get(name)
        if module is not None and getattr(module, "set_distribution", None) is original:
            module.set_distribution = set_distribution


def _patch_model_calls(api, set_keras) -> None:
    import keras

    if getattr(keras.Model, "_tfdist_model_calls", False):
        return
    from keras.src.trainers.trainer import Trainer

    for name in MODEL_CALLS:
        # Why: Trainer.compile_from_config (model loading) skips compiling a model whose
        # class's compile is not Trainer.compile ("compile() method is custom"), so the
        # Trainer methods are wrapped where Trainer defines them; the rest on Model alone
        # (not Layer's get_weights of every layer).
        owner = next(c for c in keras.Model.__mro__ if name in vars(c))
        owner = owner if issubclass(owner, Trainer) else keras.Model
        setattr(owner, name, _model_call(getattr(owner, name), api, set_keras))
    keras.Model._tfdist_model_calls = True


def _model_call(original, api, set_keras):
    import functools

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        # Why: Keras' TF trainer runs a model built under no strategy under TF's current
        # one (``distribute_strategy``), which fails on its plain variables; it keeps the
        # strategy it was built under only in the private ``_distribute_strategy``.
        with api.model_call_context(built_under(self), set_keras=set_keras) as moved:
            result = original(self, *args, **kwargs)
            if moved and original.__name__ == "compile":
                _check_optimizer(self)
        return result

    return method


def _check_optimizer(model) -> None:
    """Refuses an optimizer made under another strategy than its model's (one made
    after ``set_distribution`` for a model built before it).

    Why: Keras' TF optimizer keeps the strategy current when it was made in the private
    ``_distribution_strategy``, and made its ``iterations`` variable there.
    """
    import tensorflow as tf

    optimizer = model.optimizer
    made_under = getattr(optimizer, "_distribution_strategy", None)
    if made_under is not None and made_under is not tf.distribute.get_strategy():
        raise ValueError(
            "this model was built before keras.distribution.set_distribution and runs "
            "where it was built, but its optimizer was made after it: make the optimizer "
            "before set_distribution as well (or pass its name, e.g. optimizer='adam'), "
            f"or build the model after it. Received: optimizer={optimizer!r} made under "
            f"{type(made_under).__name__}")


def built_under(model):
    """The strategy ``model`` was built under (Keras' private ``_distribute_strategy``),
    or None: none."""
    return getattr(model, "_distribute_strategy", None)


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
