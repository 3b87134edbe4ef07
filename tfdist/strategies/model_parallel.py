"""Tensor parallelism: weights split over the replicas, which form the "model" axis
(docs/tensor_parallel.md): one host (`ModelParallelStrategy`) or every worker
(`MultiWorkerModelParallelStrategy`)."""

from __future__ import annotations

import os

import tensorflow as tf

from tfdist import env
from tfdist._hooks import tf as tf_hooks
from tfdist._hooks.tensor_parallel import install_split_hooks, split_of
from tfdist.devices import default_devices, validate_devices
from tfdist.strategies._sync import SyncGradientsMixin
from tfdist.strategies._tensor_parallel import TensorParallel
from tfdist.strategies.arguments import check_model_parallel, check_multi_worker_model_parallel
from tfdist.strategies.mirrored import default_cross_device_ops
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy


class TensorParallelMixin:
    """Mixed into a synchronous strategy: variables split by a layout map, split layers'
    calls, and no gradient all-reduce for split variables. Call
    `_init_tensor_parallel` at the end of ``__init__``."""

    def _init_tensor_parallel(self, layout_map) -> None:
        self.tensor_parallel = TensorParallel(self, layout_map)
        install_split_hooks()

    def keras_check_call(self, model, method, arguments):
        super().keras_check_call(model, method, arguments)
        self.tensor_parallel.prepare(model)

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        # A split variable's gradient is already whole on its replica (for its slice).
        kept = [(None, v) if split_of(v) is not None else (g, v) for g, v in grads_and_vars]
        if any(g is not None for g, _ in kept):
            reduced = super().keras_reduce_gradients(kept, reduce)
            out = [(g, v) if split_of(v) is not None else (r, v)
                   for (g, v), (r, _) in zip(grads_and_vars, reduced)]
        else:
            out = list(grads_and_vars)
        optimizer = getattr(reduce, "args", (None,))[0]  # Keras' reduce, bound to it
        if optimizer is not None and (optimizer.clipnorm or optimizer.global_clipnorm):
            # Norms of whole variables: a split gradient's squares summed over the
            # replicas (its slices), as for fully sharded parameters.
            from tfdist.strategies._fsdp import clip_sharded

            clipped = clip_sharded(self, self.communicator, optimizer, [g for g, _ in out],
                                   [split_of(v) is not None for _, v in out])
            out = [(g, v) for g, (_, v) in zip(clipped, out)]
        return out


class ModelParallelStrategy(TensorParallelMixin, SyncGradientsMixin,
                            tf.distribute.MirroredStrategy):
    """Megatron-style tensor parallelism for Keras Dense, EinsumDense,
    MultiHeadAttention and Embedding layers, from a layout map (one host).

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
        self._init_tensor_parallel(layout_map)


class MultiWorkerModelParallelStrategy(TensorParallelMixin, MultiWorkerMirroredStrategy):
    """`ModelParallelStrategy` over every replica of every worker (TF_CONFIG, ``tfdist
    launch``): the "model" axis spans the processes.

    Args:
        layout_map: As `ModelParallelStrategy`.
        cluster_resolver: As `tfdist.MultiWorkerMirroredStrategy`.
        **kwargs: `tfdist.MultiWorkerMirroredStrategy`'s arguments
            (``shard_optimizer_state`` and ``accumulate_steps`` refused).

    Raises:
        ValueError: in an elastic job (the split variables cannot re-form).
    """

    def __init__(self, layout_map, cluster_resolver=None, **kwargs):
        kwargs = check_multi_worker_model_parallel(layout_map, **kwargs)
        kwargs["cluster_resolver"] = cluster_resolver
        if os.environ.get(env.ELASTIC_ADDR):
            raise ValueError("An elastic job cannot re-form split variables over a new "
                             "number of workers. Received: tfdist launch --min-workers")
        super().__init__(**kwargs)
        self._init_tensor_parallel(layout_map)
