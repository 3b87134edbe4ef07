"""Hooks for tensor parallelism (`tfdist.strategies.tensor_parallel.splits`): Keras variables
stored split over the replicas of the "model" axis.

Why: Keras 3 makes a variable's TF value in the private ``_initialize`` of
``keras.src.backend.tensorflow.core.Variable`` and keeps its shape in the private
``_shape``. A variable the layout map splits gets a mirrored TF variable whose replica r
holds slice r, made here; its Keras shape stays the whole variable's, as on Keras with
JAX (``count_params``, ``summary`` and ``set_weights`` see whole variables), while the
layer's math and the optimizer's updates work on the TF slices. A slice also sharded
over the "batch" axis is stored as its block (as are its slots), and
gathered when its split layer's call reads it. A variable laid out over "batch" alone
is stored as its block too and gathered when any layer reads it in a replica function
(while Keras infers shapes, its block is repeated to the whole shape). ``numpy``/``__array__`` (saves,
``get_weights``) read the value directly and ``assign`` (loads, ``set_weights``) checks
the whole shape first: both are patched to gather or cut the whole value. An optimizer
slot made from a split variable (``TFOptimizer.add_variable_from_reference``) is split
alike, so that saves hold it whole too. A read of a
split variable outside a split layer's call in a replica function (a plain
``model(x)``) would see one slice and give a wrong result: ``__tf_tensor__`` refuses it.
Which layers consume a layer's output is the private ``_outbound_nodes``, a model's
layers its private ``_flatten_layers``, and which layer made an output its private
``_keras_history``; the layer making a variable (to read an EinsumDense's equation
when its kernel is split) the ``caller`` of Keras' private name-scope stack; a tensor's
Keras mask its private ``get_keras_mask`` (and ``set_keras_mask``); a
MultiHeadAttention's projections its private ``_query_dense`` (etc.).
``tests/test_hooks_tensor_parallel.py`` fails loudly when a Keras upgrade removes these.
Nothing changes for any other variable.

The strategy side is duck-typed: the running strategy's ``tensor_parallel`` attribute
(`tfdist.strategies.tensor_parallel.splits.TensorParallel`) decides and creates; a split TF
variable carries ``_tfdist_split`` (`tfdist.strategies.tensor_parallel.splits.Split`).
"""

from __future__ import annotations

import contextlib
import threading

from tfdist._hooks import tf as tf_hooks

_CALL = threading.local()  # set while a split layer's call runs
_LIKE = threading.local()  # the split reference of the optimizer slot being made, if any


def split_of(variable):
    """The `Split` of a Keras or TF variable stored split, else None."""
    value = getattr(variable, "_value", variable)
    try:
        return getattr(value, "_tfdist_split", None)
    except (AttributeError, ValueError):
        return None


def tf_value(variable):
    """The TF variable holding a Keras variable's value (its slices when split)."""
    return variable._value


@contextlib.contextmanager
def in_split_call():
    """Marks a split layer's call: its split variables may be read (as slices)."""
    previous = getattr(_CALL, "active", False)
    _CALL.active = True
    try:
        yield
    finally:
        _CALL.active = previous


def consumers(layer) -> list:
    """The layers that take ``layer``'s output in a functional graph (empty when
    unknown: a subclassed model)."""
    return [node.operation for node in getattr(layer, "_outbound_nodes", [])]


def all_layers(model) -> list:
    """Every layer nested in ``model`` (the private ``_flatten_layers``)."""
    return list(model._flatten_layers(include_self=False))


def output_layers(model) -> list:
    """The layers whose outputs are ``model``'s (the private ``_keras_history``)."""
    found = []
    for tensor in getattr(model, "outputs", None) or []:
        history = getattr(tensor, "_keras_history", None)
        if history is not None:
            found.append(history[0])
    return found


def attention_parts(layer) -> dict:
    """A MultiHeadAttention's projection layers that exist, by role: ``query``,
    ``key``, ``value``, ``gate``, ``output`` (Keras keeps them private)."""
    names = {"query": "_query_dense", "key": "_key_dense", "value": "_value_dense",
             "gate": "_gate_dense", "output": "_output_dense"}
    found = {role: getattr(layer, name, None) for role, name in names.items()}
    return {role: part for role, part in found.items() if part is not None}


def keras_mask_of(tensor):
    """The Keras mask a tensor carries, or None (Keras keeps it private)."""
    from keras.src import backend

    return backend.get_keras_mask(tensor)


def set_keras_mask(tensor, mask) -> None:
    """Sets (None: clears) the Keras mask a tensor carries (Keras keeps it private)."""
    from keras.src import backend

    backend.set_keras_mask(tensor, mask)


def creating_layer():
    """The layer whose ``add_weight`` is making a variable now, or None (Keras opens
    its name scope with ``caller=layer``; the stack is its private global state)."""
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    return getattr(stack[-1], "caller", None) if stack else None


def in_shape_inference() -> bool:
    """Whether Keras is only inferring shapes (its private symbolic scope)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def _batch_only_read(variable, split, value):
    """A read of a variable laid out over "batch" alone (``value``: this replica's
    block): gathered whole in a replica function, the block itself in an optimizer's
    update, repeated to the whole shape while Keras infers shapes (only shapes count)."""
    import tensorflow as tf
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    if tf_hooks.in_update():
        return value
    if in_symbolic_scope():
        return tf.concat([value] * split.batches, axis=split.batch_axis)
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        raise ValueError(
            f"Variable {variable.path!r} is sharded over the 'batch' axis (axis "
            f"{split.batch_axis} of {list(split.full_shape)}): only the strategy's fit, "
            "evaluate or predict reads it. Received: a read outside them (a direct "
            "model(x) call?)")
    return split.gather(value)


def install_split_hooks() -> None:
    """Patches Keras' TF variable once. Idempotent; chains to any earlier patch."""
    import tensorflow as tf
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    cls = core.Variable
    if getattr(cls, "_tfdist_split_hooks", False):
        return
    initialize, to_tensor = cls._initialize, cls.__tf_tensor__
    numpy, array, assign = cls.numpy, cls.__array__, cls.assign
    from_reference = TFOptimizer.add_variable_from_reference

    def _initialize(self, value):
        like = split_of(getattr(_LIKE, "reference", None))
        if like is not None and not isinstance(value, tf.Variable):
            # An optimizer slot of a split variable: split alike (its initial value,
            # zeros, the same on every replica). Keras' initializer reads ``_shape``
            # when TF calls it: the stored shape while it is made, the whole after.
            whole, self._shape = self._shape, like.stored_shape
            try:
                initialize(self, value)
            finally:
                self._shape = whole
            self._value._tfdist_split = like.like(self.path)
            return
        if not isinstance(value, tf.Variable) and self._shape is not None:
            plan = getattr(tf.distribute.get_strategy(), "tensor_parallel", None)
            axis = None if plan is None else plan.split_axis(self.path, tuple(self._shape),
                                                            self.trainable)
            if axis is not None:
                self._value, split = plan.create(self.path, tuple(self._shape), axis, value,
                                                 dict(dtype=self._dtype,
                                                      trainable=self.trainable,
                                                      name=self.name))
                self._value._tfdist_split = split  # its Keras shape stays the whole
                return
        initialize(self, value)

    def __tf_tensor__(self, dtype=None, name=None):
        split = split_of(self)
        if split is not None and split.axis is None:
            return _batch_only_read(self, split, to_tensor(self, dtype=dtype, name=name))
        if split is not None and not (getattr(_CALL, "active", False) or tf_hooks.in_update()
                                      or in_symbolic_scope()):
            raise ValueError(
                f"Variable {self.path!r} is split over the 'model' axis "
                f"(axis {split.axis} of {list(split.full_shape)}): only its layer's call "
                "in the strategy's fit, evaluate or predict reads it. Received: a read "
                "outside them (a direct model(x) call?)")
        value = to_tensor(self, dtype=dtype, name=name)
        if split is not None and split.batch_axis is not None and getattr(
                _CALL, "active", False) and not (tf_hooks.in_update() or in_symbolic_scope()):
            value = split.gather(value)  # its block, gathered over the batch axis
        return value

    def numpy_(self):
        split = split_of(self)
        return numpy(self) if split is None else split.full_numpy(self._value)

    def __array__(self, dtype=None, copy=None):
        split = split_of(self)
        if split is None:
            return array(self, dtype)
        value = split.full_numpy(self._value)
        return value if dtype is None else value.astype(dtype)

    def assign_(self, value):
        split = split_of(self)
        if split is None:
            return assign(self, value)
        split.assign_full(self._value, value)
        return value

    for patch, original in ((_initialize, initialize), (__tf_tensor__, to_tensor),
                            (numpy_, numpy), (__array__, array), (assign_, assign)):
        patch.__wrapped__ = original  # what it chains to
    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        previous = getattr(_LIKE, "reference", None)
        _LIKE.reference = reference_variable if split_of(reference_variable) else None
        try:
            return from_reference(self, reference_variable, name=name,
                                  initializer=initializer)
        finally:
            _LIKE.reference = previous

    add_variable_from_reference.__wrapped__ = from_reference
    TFOptimizer.add_variable_from_reference = add_variable_from_reference
    cls._initialize = _initialize
    cls.__tf_tensor__ = __tf_tensor__
    cls.numpy = numpy_
    cls.__array__ = __array__
    cls.assign = assign_
    cls._tfdist_split_hooks = True
