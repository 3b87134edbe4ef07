"""Tensor parallelism on one host: Dense kernels split over the local replicas, which
form the "model" axis (docs/tensor_parallel.md)."""

from __future__ import annotations

import tensorflow as tf

from tfdist._hooks import tf as tf_hooks
from tfdist._hooks.tensor_parallel import install_split_hooks, split_of
from tfdist.devices import default_devices, validate_devices
from tfdist.strategies._sync import SyncGradientsMixin
from tfdist.strategies._tensor_parallel import TensorParallel
from tfdist.strategies.arguments import check_model_parallel
from tfdist.strategies.mirrored import default_cross_device_ops


class ModelParallelStrategy(SyncGradientsMixin, tf.distribute.MirroredStrategy):
    """Megatron-style tensor parallelism for Keras Dense layers, from a layout map.

    Every local replica is one shard of the "model" axis. A Dense kernel laid out
    ``(None, "model")`` is column-parallel (each replica holds and computes its output
    columns, the bias split alike), ``("model", None)`` row-parallel (its input rows;
    the partial sums added over the replicas, the bias once). A column layer feeding
    only row layers hands them its activation split. Layers with no split variable run
    data-parallel on each replica's rows of the batch, their gradients all-reduced.

    Args:
        layout_map: ``{variable path regex: layout}``, a layout being a tuple of axis
            names (``"model"`` once, else None) or a
            ``keras.distribution.TensorLayout``; or a ``keras.distribution.LayoutMap``.
        devices: Device names; default: every local GPU, or else every logical CPU.
        communication_options, compression: As `tfdist.MirroredStrategy`; the
            compression casts what is all-reduced or reduce-scattered (gradients and
            partial sums), not what is all-gathered.
        accumulate_steps: Refused above 1 (not implemented with split variables).

    Attributes:
        tensor_parallel: The `tfdist.strategies._tensor_parallel.TensorParallel` plan.
        communicator: The accounted communicator every collective goes through.
        bytes_communicated: Bytes sent so far (activations and gradients), after
            compression.
    """

    rank = 0
    size = 1
    num_workers = 1
    is_chief = True

    def __init__(self, layout_map, devices=None, communication_options=None,
                 compression=None, accumulate_steps=None):
        options = check_model_parallel(layout_map, devices, communication_options,
                                       compression, accumulate_steps)
        devices = validate_devices(devices) if devices is not None else default_devices()
        tf_hooks.assign_collective_key_base(self)
        self._init_sync_gradients(options)
        super().__init__(devices=devices, cross_device_ops=default_cross_device_ops(devices))
        self.tensor_parallel = TensorParallel(self, layout_map)
        install_split_hooks()

    def keras_check_call(self, model, method, arguments):
        super().keras_check_call(model, method, arguments)
        optimizer = getattr(model, "optimizer", None)
        for name in ("clipnorm", "global_clipnorm"):
            if method == "fit" and getattr(optimizer, name, None):
                # Each replica would see only its slices of the split gradients.
                raise ValueError(f"ModelParallelStrategy does not clip by norm yet. "
                                 f"Received: {name}={getattr(optimizer, name)}")
        self.tensor_parallel.prepare(model)

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        # A split variable's gradient is already whole on its replica.
        kept = [(None, v) if split_of(v) is not None else (g, v) for g, v in grads_and_vars]
        if not any(g is not None for g, _ in kept):
            return list(grads_and_vars)
        reduced = super().keras_reduce_gradients(kept, reduce)
        return [(g, v) if split_of(v) is not None else (r, v)
                for (g, v), (r, _) in zip(grads_and_vars, reduced)]
