"""Hooks for fully sharded parameters (`tfdist.strategies.fsdp.shards`): where Keras makes,
reads, writes and saves a variable's TF value.

Why: Keras 3 keeps a variable's value in the private ``_value`` of
``keras.src.backend.tensorflow.core.Variable``, made by the private ``_initialize``
(called by ``_initialize_with_initializer``, which sees a constant initializer); layers
read it through ``__tf_tensor__``; ``numpy``/``__array__`` (saves,
``get_weights``) and ``_direct_assign`` (``assign``, loads) reach it directly. With
``shard_parameters=True`` a large variable's ``_value`` is a mirrored variable holding
each replica's *slice* (flat, padded), so these four places must make it, gather it
(in a replica function), or gather/scatter it whole (outside one). An optimizer's slot
made from a sharded reference (``TFOptimizer.add_variable_from_reference``) is sharded
the same way. Nothing changes for any other variable.

The strategy side is duck-typed: the running strategy's ``parameter_sharding``
attribute (`tfdist.strategies.fsdp.shards.ParameterSharding`) decides and creates; a sharded
TF variable carries ``_tfdist_shard`` (`tfdist.strategies.fsdp.shards.Shard`) with the gather
and scatter. ``tests/test_hooks_fsdp.py`` fails loudly when a Keras upgrade removes
what is patched here.
"""

from __future__ import annotations

import threading

from tfdist._hooks import tf as tf_hooks

_LIKE = threading.local()  # the sharded reference of the slot being made, if any
_FILL = threading.local()  # the constant initializer's value of the variable being made


def shard_of(variable):
    """The `Shard` of a Keras or TF variable stored sharded, else None."""
    value = getattr(variable, "_value", variable)
    try:
        return getattr(value, "_tfdist_shard", None)
    except (AttributeError, ValueError):
        return None


def tf_value(variable):
    """The TF variable holding a Keras variable's value (its slices when sharded)."""
    return variable._value


def _in_replica_function() -> bool:
    import tensorflow as tf

    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def regather_in_backward(model) -> int:
    """Marks each layer of ``model`` that owns a sharded variable for Keras'
    rematerialisation (its ``call`` under ``tf.recompute_grad``): the gathered values
    are not kept for the backward pass, the layer runs (and gathers) again there.
    Returns the number of layers marked.

    Why: Keras' public ``RematScope`` applies to layers made inside it, before tfdist
    knows which variables are sharded (decided as they are built); the per-layer
    switch is the private ``_remat_mode`` that ``Operation.__call__`` reads, set here
    to tfdist's own mode. Keras' TF ``remat`` passes the call's keyword arguments
    (``training``) to ``tf.custom_gradient``, which refuses them in a graph, so
    ``Layer.rematerialized_call`` is patched to bind them first (`_regathered_call`),
    and the private ``AutocastScope`` of mixed precision is entered again there.
    Each layer's own variables are the private ``_trainable_variables``
    (``trainable_weights`` adds its sublayers').
    """
    import keras
    from keras.src.backend.common.remat import RematMode

    layer_class = keras.layers.Layer
    if not getattr(layer_class, "_tfdist_regather", False):
        original = layer_class.rematerialized_call

        def rematerialized_call(self, layer_call, *args, **kwargs):
            if getattr(self._remat_mode, "mode", None) == _REGATHER:
                return _regathered_call(layer_call, args, kwargs)
            return original(self, layer_call, *args, **kwargs)

        layer_class.rematerialized_call = rematerialized_call
        layer_class._tfdist_regather = True
    marked = 0
    for layer in model._flatten_layers(include_self=True):
        own = getattr(layer, "_trainable_variables", [])
        if layer._remat_mode is None and any(shard_of(v) is not None for v in own):
            layer._remat_mode = RematMode(_REGATHER, None, [layer.name])
            marked += 1
    return marked


_REGATHER = "tfdist_regather_in_backward"
# The inputs of the layer running under `_regathered_call`: its gathers run after them
# (in the backward pass, after the incoming gradient), so that one layer's whole
# values are alive at a time, not every layer's at once.
_GATHER_AFTER = threading.local()


def _regathered_call(layer_call, args, kwargs):
    """``layer_call`` under ``tf.recompute_grad`` with its keyword arguments bound;
    called as Keras calls it. A call with an argument that is not a floating tensor
    (an embedding's ids) runs as it is: a lookup's gradient does not read the table
    (nothing gathered is kept), and ``tf.recompute_grad`` would make its sparse
    gradient dense (Keras' optimizers treat the two differently)."""
    import tensorflow as tf

    import contextlib

    from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

    if not all(tf.is_tensor(a) and a.dtype.is_floating for a in args):
        return layer_call
    # The mixed-precision cast of variable reads, entered around the call by Keras, is
    # gone when the backward pass runs the layer again: kept here.
    autocast = get_autocast_scope()
    dtype = None if autocast is None else autocast.dtype

    def call(*tensors):
        outer = getattr(_GATHER_AFTER, "tensors", None)
        _GATHER_AFTER.tensors = tensors  # this layer's gathers wait for its inputs
        try:
            with AutocastScope(dtype) if dtype is not None else contextlib.nullcontext():
                return layer_call(*tensors, **kwargs)
        finally:
            _GATHER_AFTER.tensors = outer

    recomputed = tf.recompute_grad(call)
    return lambda *a, **k: recomputed(*a)


def _constant_of(initializer):
    """The value of a Keras ``Zeros``/``Ones``/scalar ``Constant`` initializer, else
    None (a sharded variable of a constant is made slice by slice, never whole)."""
    import keras

    if isinstance(initializer, keras.initializers.Zeros):
        return 0.0
    if isinstance(initializer, keras.initializers.Ones):
        return 1.0
    if isinstance(initializer, keras.initializers.Constant):
        value = getattr(initializer, "value", None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def install_parameter_hooks() -> None:
    """Patches Keras' TF variable and optimizer once. Idempotent."""
    import tensorflow as tf
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    cls = core.Variable
    if getattr(cls, "_tfdist_parameter_hooks", False):
        return
    initialize, to_tensor = cls._initialize, cls.__tf_tensor__
    with_initializer = cls._initialize_with_initializer
    numpy, array, direct_assign = cls.numpy, cls.__array__, cls._direct_assign
    from_reference = TFOptimizer.add_variable_from_reference

    def _initialize(self, value):
        if not isinstance(value, tf.Variable):
            plan = getattr(tf.distribute.get_strategy(), "parameter_sharding", None)
            like = getattr(_LIKE, "reference", None)
            # A value given (not an initializer) stays whole: Keras takes the variable's
            # shape from the TF variable made here.
            shape = self._shape
            if plan is not None and shape is not None and (plan.wants(self, shape) or (
                    like is not None and tuple(like.shape) == tuple(shape))):
                self._value, shard = plan.create(shape, value, dict(
                    dtype=self._dtype, trainable=self.trainable, name=self.name,
                    aggregation=self._map_aggregation(self.aggregation),
                    synchronization=self._map_synchronization(self.synchronization)),
                    fill=getattr(_FILL, "value", None))
                self._value._tfdist_shard = shard
                return
        initialize(self, value)

    def _initialize_with_initializer(self, initializer):
        _FILL.value = _constant_of(initializer)
        try:
            return with_initializer(self, initializer)
        finally:
            _FILL.value = None

    def __tf_tensor__(self, dtype=None, name=None):
        shard = shard_of(self)
        if shard is None or tf_hooks.in_update():  # an optimizer's step: this replica's slice
            return to_tensor(self, dtype=dtype, name=name)
        if in_symbolic_scope():  # Keras' shape inference: only the shape matters
            value = tf.zeros(self._shape, self._dtype)
        elif _in_replica_function():
            value = shard.gather(self._value, after=getattr(_GATHER_AFTER, "tensors", None))
        elif tf.executing_eagerly():
            value = tf.constant(shard.full_numpy(self._value))
        else:
            value = shard.local_whole(self._value)
        return tf.convert_to_tensor(self._maybe_autocast(value), dtype=dtype, name=name)

    def numpy_(self):
        shard = shard_of(self)
        return numpy(self) if shard is None else shard.full_numpy(self._value)

    def __array__(self, dtype=None, copy=None):
        shard = shard_of(self)
        if shard is None:
            return array(self, dtype)
        value = shard.full_numpy(self._value)
        return value if dtype is None else value.astype(dtype)

    def _direct_assign(self, value):
        shard = shard_of(self)
        if shard is None:
            return direct_assign(self, value)
        return shard.assign_full(self._value, value)

    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        previous = getattr(_LIKE, "reference", None)
        _LIKE.reference = reference_variable if shard_of(reference_variable) else None
        try:
            return from_reference(self, reference_variable, name=name,
                                  initializer=initializer)
        finally:
            _LIKE.reference = previous

    # Each patch names what it wraps: other tfdist patches of the same methods chain.
    for patch, original in ((_initialize, initialize), (__tf_tensor__, to_tensor),
                            (_initialize_with_initializer, with_initializer),
                            (numpy_, numpy), (__array__, array),
                            (_direct_assign, direct_assign),
                            (add_variable_from_reference, from_reference)):
        patch.__wrapped__ = original
    cls._initialize = _initialize
    cls._initialize_with_initializer = _initialize_with_initializer
    cls.__tf_tensor__ = __tf_tensor__
    cls.numpy = numpy_
    cls.__array__ = __array__
    cls._direct_assign = _direct_assign
    TFOptimizer.add_variable_from_reference = add_variable_from_reference
    cls._tfdist_parameter_hooks = True
