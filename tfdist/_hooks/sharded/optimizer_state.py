"""Hook: Keras optimizer slots of a sharded variable are sharded alike, and updated
shard by shard on the shards' own ps.

See `install_sharded_optimizer_state` and `allow_sharded_updates` for why;
``tests/test_hooks_sharded.py`` fails loudly when a TF/Keras upgrade removes what they
touch.
"""

from __future__ import annotations

import contextlib

from tfdist._hooks.sharded.parts import shard_gradient, sharded_parts, sharded_slots
from tfdist._hooks.sharded.row_blocks import update_in_row_blocks


# Elementwise Keras optimizers: one update_step per shard of a sharded variable, on that
# shard of the variable, gradient and slots. Others (Lamb's norms, Muon, Adafactor's
# factored moments) update a sharded variable as a whole.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
                          "Adadelta", "Ftrl", "Lion")


def updates_shard_by_shard(optimizer) -> bool:
    """Whether ``optimizer``'s update_step is one of `ELEMENTWISE_OPTIMIZERS`'.

    Why: only an elementwise update gives each shard, updated alone, the rows the
    whole variable's update gives.
    """
    import keras

    step = type(optimizer).update_step
    return any(step is getattr(keras.optimizers, name).update_step
               for name in ELEMENTWISE_OPTIMIZERS)


@contextlib.contextmanager
def _shard_view(optimizer, variable, index, part):
    """While ``optimizer.update_step(grad, part)`` is traced for shard ``index`` of
    ``variable``: ``part`` has ``variable``'s slots, each seen as its own shard ``index``."""
    slots = sharded_slots(optimizer, variable)
    indices = optimizer._trainable_variables_indices
    key = optimizer._var_key(part)
    added = key not in indices  # a shard may share its key with the sharded variable
    indices[key] = optimizer._get_variable_index(variable)
    saved = [slot._value for slot in slots]
    for slot, value in zip(slots, saved):
        slot._value = value.variables[index]
    try:
        yield
    finally:
        for slot, value in zip(slots, saved):
            slot._value = value
        if added:
            del indices[key]


def install_sharded_optimizer_state() -> None:
    """Keras optimizer slots of a sharded variable are sharded alike, on the same ps.

    Why: Keras' ``TFOptimizer.add_variable_from_reference`` creates each slot (Adam's
    moments, momentum, ...) under ``colocate_vars_with(variable.value)``; for a
    `ShardedVariable` that puts ONE unsharded copy on the chief (TF 2.21). Patched:

    - ``add_variable_from_reference`` for a sharded variable makes the slot a Keras
      variable whose value is a `ShardedVariable` with one shard per shard of the
      variable, each colocated with it (same rows, same ps), initialized by Keras'
      initializer at the shard's shape (a ``variable_creator_scope`` around Keras'
      own method). The optimizer's variables keep Keras' order and names, so saved
      optimizer state reads as the unsharded one's.
    - ``_distributed_tf_update_step``: for `ELEMENTWISE_OPTIMIZERS`, the full-shape
      gradient of a sharded variable is cut into its shards' rows, and
      ``update_step`` runs once per shard, through ``extended.update(shard, ...)``
      (colocated with the shard: the update runs on its ps), with the slots swapped to
      their shard (`_shard_view`: the private ``_trainable_variables_indices``, and the
      Keras variables' ``_value``, while tracing). Other optimizers update the whole
      `ShardedVariable` (`allow_sharded_updates`). Variables that are not sharded keep
      Keras' path.
    """
    import functools

    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers import base_optimizer

    if getattr(TFOptimizer, "_tfdist_sharded_state", False):
        return
    original_add = TFOptimizer.add_variable_from_reference
    original_update = TFOptimizer._distributed_tf_update_step

    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        parts = sharded_parts(reference_variable)
        if parts is None:
            return original_add(self, reference_variable, name=name, initializer=initializer)
        init = keras.initializers.get(initializer)

        def creator(next_creator, **kwargs):
            shards = []
            for i, part in enumerate(parts):
                kw = dict(kwargs, shape=part.shape, name=f"{kwargs.get('name')}/part_{i}",
                          initial_value=functools.partial(init, tuple(part.shape),
                                                          dtype=kwargs.get("dtype")))
                if tf.distribute.has_strategy():  # its creator colocates (no partitioning)
                    kw.update(colocate_with=part, use_resource=True)
                    shards.append(next_creator(**kw))
                else:
                    with tf.device(part.device):
                        shards.append(next_creator(**kw))
            return tf.__internal__.distribute.ShardedVariable(shards)

        with tf.init_scope(), tf.variable_creator_scope(creator):
            slot = base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)
        self.__dict__.setdefault("_tfdist_sharded_slots", {}).setdefault(
            self._var_key(reference_variable), []).append(slot)
        return slot

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        sharded = [(g, v) for g, v in grads_and_vars if sharded_parts(v) is not None]
        if not sharded or not updates_shard_by_shard(self):
            return original_update(self, distribution, grads_and_vars, learning_rate)
        original_update(self, distribution, [(g, v) for g, v in grads_and_vars
                                             if sharded_parts(v) is None], learning_rate)
        for grad, var in sharded:
            offset = 0
            for index, part in enumerate(sharded_parts(var)):
                def update_shard(shard, grad, learning_rate, var=var, index=index):
                    with _shard_view(self, var, index, shard):
                        update_in_row_blocks(self, var, shard, grad, learning_rate)

                distribution.extended.update(
                    part, update_shard, args=(shard_gradient(grad, offset, part),
                                              learning_rate), group=False)
                offset += int(part.shape[0])

    add_variable_from_reference.__doc__ = original_add.__doc__
    add_variable_from_reference._tfdist_original = original_add
    _distributed_tf_update_step._tfdist_original = original_update
    add_variable_from_reference.__wrapped__ = original_add  # what each chains to
    _distributed_tf_update_step.__wrapped__ = original_update
    TFOptimizer.add_variable_from_reference = add_variable_from_reference
    TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step
    TFOptimizer._tfdist_sharded_state = True


def allow_sharded_updates(extended) -> None:
    """Lets ``strategy.extended.update`` take a `ShardedVariable` (Keras' optimizer).

    Why: Keras 3's TF optimizer updates each variable with ``extended.update(var, fn)``;
    the parameter-server extended's private ``_update`` colocates ``fn`` with ``var``,
    which a `ShardedVariable` refuses ("doesn't support being used as a reference").
    For a sharded variable ``fn`` runs uncolocated: its assign/scatter ops update each
    shard on that shard's own ps. Other variables keep TF's path.
    """
    import tensorflow as tf
    from tensorflow.python.distribute import distribute_lib

    original = extended._update

    def _update(var, fn, args, kwargs, group):
        if not isinstance(var, tf.__internal__.distribute.ShardedVariable):
            return original(var, fn, args, kwargs, group)
        with distribute_lib.UpdateContext(var.variables[0].device):
            result = fn(var, *extended._select_single_value(args),
                        **extended._select_single_value(kwargs))
        return result if group else tf.nest.map_structure(extended._local_results, result)

    extended._update = _update
