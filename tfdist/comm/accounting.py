"""Counting the bytes a strategy all-reduces.

Convention: the payload one worker contributes to an all-reduce, after compression, is
counted once per reduction (not once per local replica, not times the ring factor).
`tfdist.comm.communicator.Accounted` is the only place that counts.
"""

from __future__ import annotations


class ByteCounter:
    """An int64 counter that graph code can increment; read it with `total`.

    Its variable is a plain host variable, never a distributed one, even when it is
    made inside another strategy's scope (a strategy created under
    ``keras.distribution.set_distribution`` of an earlier one, or in ``with s.scope():``).
    """

    def __init__(self, name: str = "tfdist_bytes_allreduced"):
        import tensorflow as tf

        from tfdist._hooks.zero import plain_variables

        with plain_variables(), tf.device("/cpu:0"):
            self._variable = tf.Variable(0, dtype=tf.int64, trainable=False, name=name,
                                         synchronization=tf.VariableSynchronization.NONE,
                                         aggregation=tf.VariableAggregation.NONE)

    def add(self, nbytes):
        """Adds ``nbytes`` (a Python int or scalar tensor). Call once per reduction."""
        import tensorflow as tf

        return self._variable.assign_add(tf.cast(nbytes, tf.int64))

    @property
    def variable(self):
        """The counter's ``tf.Variable`` (committed in an elastic job)."""
        return self._variable

    @property
    def total(self) -> int:
        return int(self._variable.numpy())


def payload_bytes(value, compression=None):
    """Bytes one replica's ``value`` takes on the wire under ``compression``.

    Floating tensors count at the compression dtype. IndexedSlices (embedding
    gradients) travel uncompressed: their values plus their indices.

    Returns:
        An int, or an int64 scalar tensor when the shape is not static.
    """
    import tensorflow as tf

    from tfdist.comm.compression import get_compression

    if isinstance(value, tf.IndexedSlices):
        return payload_bytes(value.values) + payload_bytes(value.indices)
    policy = get_compression(compression)
    if value.shape.num_elements() is not None:
        return policy.wire_bytes(value)
    dtype = tf.as_dtype(value.dtype)
    if policy.wire_dtype is not None and dtype.is_floating:
        dtype = tf.as_dtype(policy.wire_dtype)
    return tf.size(value, out_type=tf.int64) * dtype.size
