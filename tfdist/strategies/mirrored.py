"""One host, many devices: gradients summed every step (through the strategy's communicator)."""

from __future__ import annotations

import tensorflow as tf

from tfdist._hooks import tf as tf_hooks
from tfdist.devices import (are_soft_placed_on_the_cpu, cpu_device_names, default_devices,
                            validate_devices)
from tfdist.strategies._sync import SyncGradientsMixin
from tfdist.strategies.options.arguments import MIN_SHARD_ELEMENTS, check_mirrored, check_sharding


def default_cross_device_ops(devices: list[str]) -> tf.distribute.CrossDeviceOps | None:
    """The all-reduce tfdist uses when the user names none.

    On CPU-only replicas (logical CPUs) `ReductionToOneDevice` was 2-5x faster than
    TF's default ring collective (benchmarks/mirrored.md), and it needs no collective
    group keys. GPUs keep TF's choice (NCCL). GPUs named on a host without GPUs run on
    the CPU (soft placement): `ReductionToOneDevice` there too (TF's choice, its
    collective all-reduce, hung in ``fit`` there).
    """
    if len(devices) > 1 and all("CPU" in d.upper() for d in devices):
        return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
    if len(devices) > 1 and are_soft_placed_on_the_cpu(devices):  # GPUs named, none here
        return tf.distribute.ReductionToOneDevice(reduce_to_device=cpu_device_names()[0])
    return None


def make_local_extended(strategy, devices=None):
    """TF's ``MirroredExtended`` over this host's ``devices``, as `MirroredStrategy` makes
    it (checked devices, the measured all-reduce, its own collective keys), for a
    strategy that is not a ``MirroredStrategy`` (one-host model averaging).

    Args:
        strategy: The container strategy.
        devices: Device names; default: every local GPU, or else every logical CPU.
    """
    devices = validate_devices(devices) if devices is not None else default_devices()
    tf_hooks.assign_collective_key_base(strategy)
    return tf_hooks.tf_distribute_internals().MirroredExtended(
        strategy, devices=devices, cross_device_ops=default_cross_device_ops(devices))


class MirroredStrategy(SyncGradientsMixin, tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` that works on CPU hosts and in notebooks.

    Differences from TF's class: devices are checked (a missing device is a clear
    error; GPUs named on a host without GPUs run on the CPU, with a warning, as in
    TF), CPU replicas use the measured fastest all-reduce, several instances can live
    in one process, and `tfdist.CommunicationOptions` (compression, gradient
    accumulation) apply.

    Args:
        devices: Device names; default: every local GPU, or else every logical CPU
            (see `tfdist.devices.use_logical_cpus`).
        cross_device_ops: A `tf.distribute.CrossDeviceOps`, ``"collective"`` for TF's
            own collective all-reduce, or None for the choice of
            `default_cross_device_ops`.
        communication_options: A `tfdist.CommunicationOptions`.
        compression: Shortcut for ``communication_options.compression``.
        accumulate_steps: Shortcut for ``communication_options.accumulate_steps``.
        shard_optimizer_state: Each replica keeps 1/N of the optimizer state (ZeRO-2:
            gradients reduce-scattered, slices updated, weights all-gathered; see
            docs/zero.md). Element-wise Keras optimizers only.
        shard_parameters: Each replica stores 1/N of every large trainable variable
            and of its optimizer state (ZeRO-3 / FSDP, docs/fsdp.md).
        min_shard_elements: With ``shard_parameters``: smaller variables stay whole.
        shard_filter: With ``shard_parameters``: None, or ``f(path)`` returning True
            (shard), False (keep whole) or None (the ``min_shard_elements`` rule).
        reshard_after_forward: With ``shard_parameters``: True (gathered again for the
            backward pass) or False (kept from the forward pass to the backward pass).

    Attributes:
        communicator: The `tfdist.comm.communicator.Accounted` communicator gradients
            are all-reduced through (compression, byte counting).
        bytes_communicated: Gradient bytes all-reduced so far, after compression.
        rank, size, num_workers, is_chief: One process: 0, 1, 1 and True.
    """

    rank = 0
    size = 1
    num_workers = 1
    is_chief = True


    def __init__(self, devices=None, cross_device_ops=None, communication_options=None,
                 compression=None, accumulate_steps=None, shard_optimizer_state=False,
                 shard_parameters=False, min_shard_elements=MIN_SHARD_ELEMENTS,
                 shard_filter=None, reshard_after_forward=True):
        options = check_mirrored(devices, communication_options, compression,
                                 accumulate_steps, shard_optimizer_state, shard_parameters,
                                 min_shard_elements, shard_filter, reshard_after_forward)
        sharding = check_sharding(shard_parameters, min_shard_elements, shard_filter,
                                  reshard_after_forward, shard_optimizer_state)
        devices = validate_devices(devices) if devices is not None else default_devices()
        if cross_device_ops is None:
            cross_device_ops = default_cross_device_ops(devices)
        elif cross_device_ops == "collective":
            cross_device_ops = None
        elif not isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
            raise ValueError("cross_device_ops must be a tf.distribute.CrossDeviceOps, "
                             f"'collective' or None. Received: {cross_device_ops!r}")
        tf_hooks.assign_collective_key_base(self)
        self._init_sync_gradients(options, shard_optimizer_state=shard_optimizer_state,
                                  sharding=sharding)
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
