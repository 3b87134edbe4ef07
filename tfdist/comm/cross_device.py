"""A `tf.distribute.CrossDeviceOps` wrapper that counts the bytes it all-reduces."""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.accounting import ByteCounter


def _payload_bytes(value) -> int:
    """Bytes of one replica's share of ``value`` (static shape)."""
    component = value.values[0] if hasattr(value, "values") else value
    component = tf.convert_to_tensor(component)
    return int(component.shape.num_elements() or 0) * component.dtype.size


class CountingCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Delegates every reduction to ``inner`` and adds its payload to ``counter``.

    Args:
        inner: The `tf.distribute.CrossDeviceOps` that does the work.
        counter: Where the bytes go, once per reduction.
    """

    def __init__(self, inner: tf.distribute.CrossDeviceOps, counter: ByteCounter):
        super().__init__()
        self.inner = inner
        self.counter = counter

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.counter.add(_payload_bytes(per_replica_value))
        return self.inner.reduce_implementation(reduce_op, per_replica_value, destinations,
                                                options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.counter.add(sum(_payload_bytes(v) for v, _ in value_destination_pairs))
        return self.inner.batch_reduce_implementation(reduce_op, value_destination_pairs,
                                                      options)

    def broadcast_implementation(self, tensor, destinations):
        return self.inner.broadcast_implementation(tensor, destinations)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return self.inner._gather_implementation(per_replica_value, destinations, axis,
                                                 options)
