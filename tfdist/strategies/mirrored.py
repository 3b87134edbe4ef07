"""One host, many devices: gradients summed every step."""

from __future__ import annotations

import tensorflow as tf

from tfdist import _hooks
from tfdist.comm.accounting import ByteCounter
from tfdist.comm.cross_device import CountingCrossDeviceOps
from tfdist.devices import default_devices, validate_devices


def default_cross_device_ops(devices: list[str]) -> tf.distribute.CrossDeviceOps | None:
    """The all-reduce tfdist uses when the user names none.

    On CPU-only replicas (logical CPUs) `ReductionToOneDevice` was 3-5x faster than
    TF's default ring collective (see benchmarks/RESULTS.md), and it needs no
    collective group keys. GPUs keep TF's choice (NCCL).
    """
    if len(devices) > 1 and all("CPU" in d.upper() for d in devices):
        return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
    return None


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` that works on CPU hosts and in notebooks.

    Differences from TF's class: devices are checked (a missing device is a clear
    error), CPU replicas use the measured fastest all-reduce, and several instances can
    live in one process.

    Args:
        devices: Device names; default: every local GPU, or else every logical CPU
            (see `tfdist.devices.use_logical_cpus`).
        cross_device_ops: A `tf.distribute.CrossDeviceOps`, ``"collective"`` for TF's
            own collective all-reduce, or None for the choice of
            `default_cross_device_ops`.
    """

    def __init__(self, devices=None, cross_device_ops=None):
        devices = validate_devices(devices) if devices is not None else default_devices()
        if cross_device_ops is None:
            cross_device_ops = default_cross_device_ops(devices)
        elif cross_device_ops == "collective":
            cross_device_ops = None
        elif not isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
            raise ValueError("cross_device_ops must be a tf.distribute.CrossDeviceOps, "
                             f"'collective' or None. Received: {cross_device_ops!r}")
        _hooks.assign_collective_key_base(self)
        self._byte_counter = ByteCounter()
        if cross_device_ops is not None:
            cross_device_ops = CountingCrossDeviceOps(cross_device_ops, self._byte_counter)
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)

    @property
    def bytes_communicated(self) -> int:
        """Bytes all-reduced so far: one replica's payload per reduction.

        Counted for tfdist's default and user-given cross-device ops; TF's own
        collective (``cross_device_ops="collective"``) is not counted.
        """
        return self._byte_counter.total
