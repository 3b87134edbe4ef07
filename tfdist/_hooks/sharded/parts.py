"""What a variable a partitioner split is made of: its shards, slots and gradient rows.

Under ``tfdist.ParameterServerStrategy(variable_partitioner=...)`` a Keras variable's
value is a TF ``ShardedVariable`` (``tf.__internal__``): one variable per ps task,
split along axis 0. The other files of this package build on these readers.
"""

from __future__ import annotations


def sharded_parts(variable):
    """The shard variables of a Keras/TF variable sharded by a partitioner, or None.

    Why: Keras does not know sharded variables; TF exposes their class only under
    ``tf.__internal__`` (tested in tests/test_hooks_sharded.py).
    """
    import tensorflow as tf

    value = getattr(variable, "value", variable)
    if isinstance(value, tf.__internal__.distribute.ShardedVariable):
        return list(value.variables)
    return None


def sharded_variable(shards):
    """One variable made of ``shards`` (split along axis 0), as a partitioner makes it.

    Why: TF exposes ``ShardedVariable`` only under ``tf.__internal__``; the sync
    parameter-server step sums a sharded variable's gradient in a variable sharded alike.
    """
    import tensorflow as tf

    return tf.__internal__.distribute.ShardedVariable(shards)


def sharded_slots(optimizer, variable) -> list:
    """The optimizer variables created (sharded) for the sharded ``variable``.

    Why: kept per optimizer under Keras' private ``_var_key`` of the variable, as Keras
    keys its own slots (see `optimizer_state.install_sharded_optimizer_state`).
    """
    return list(getattr(optimizer, "_tfdist_sharded_slots", {}).get(
        optimizer._var_key(variable), []))


def shard_gradient(grad, offset, part):
    """Rows ``offset:offset + rows(part)`` of a full-shape gradient, as ``part``'s."""
    import tensorflow as tf

    rows = int(part.shape[0])
    if not isinstance(grad, tf.IndexedSlices):
        return grad[offset:offset + rows]
    indices = tf.cast(grad.indices, tf.int64)
    mine = tf.logical_and(indices >= offset, indices < offset + rows)
    return tf.IndexedSlices(tf.boolean_mask(grad.values, mine),
                            tf.boolean_mask(indices, mine) - offset,
                            tf.constant(part.shape.as_list(), tf.int64))
