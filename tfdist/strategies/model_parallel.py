"""Tensor parallelism: weights split over the replicas, which form the "model" axis
(docs/tensor_parallel.md): one host (`ModelParallelStrategy`) or every worker
(`MultiWorkerModelParallelStrategy`); with ``model_parallel=m`` < replicas, a data x
model mesh of groups of m (`tfdist.comm.groups`)."""

from __future__ import annotations

import os

import tensorflow as tf

from tfdist import env
from tfdist._hooks import tf as tf_hooks
from tfdist._hooks.tensor_parallel import install_split_hooks, split_of
from tfdist.comm.groups import is_mesh
from tfdist.devices import default_devices, validate_devices
from tfdist.engines.registry import AUTO, engine_with_groups
from tfdist.strategies.tensor_parallel import checks as tp_checks
from tfdist.strategies._sync import SyncGradientsMixin
from tfdist.strategies.tensor_parallel.splits import TensorParallel
from tfdist.strategies.options.arguments import check_model_parallel, check_multi_worker_model_parallel
from tfdist.strategies.mirrored import default_cross_device_ops
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy


class TensorParallelMixin:
    """Mixed into a synchronous strategy: variables split by a layout map, split layers'
    calls, and no gradient all-reduce for split variables. Call
    `_init_tensor_parallel` at the end of ``__init__``."""

    def _init_tensor_parallel(self, layout_map, model_parallel=None) -> None:
        n = self.num_replicas_in_sync
        mesh = model_parallel is not None and is_mesh(n, model_parallel)  # m divides n
        if mesh and not self.communicator.supports_groups:
            raise ValueError(
                f"A data x model mesh (model_parallel < replicas) needs collectives within "
                f"groups of replicas, which engine={getattr(self, 'engine', None)!r} does not "
                f"have: use engine='tf'. Received: model_parallel={model_parallel}")
        self.tensor_parallel = TensorParallel(self, layout_map, model_parallel)
        tp_checks.warn_unknown_axes(self.tensor_parallel.rules)
        self._unmatched_warned = set()  # layout map keys warned about once
        install_split_hooks()

    @property
    def save_needs_every_worker(self) -> bool:
        """A save gathers every worker's slices of the split variables (a collective)."""
        return True

    def keras_check_call(self, model, method, arguments):
        super().keras_check_call(model, method, arguments)
        tp_checks.check_last_batch(method, arguments, self.num_replicas_in_sync)
        self.tensor_parallel.prepare(model)
        tp_checks.warn_unmatched_keys(self.tensor_parallel, model, self._unmatched_warned)

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        # A split variable's gradient is whole over its model group (summed over the
        # groups holding the same slice on a data x model mesh).
        grads_and_vars = self._reduce_split(list(grads_and_vars))
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
            # replicas (its slices, each held by d replicas), as for fully sharded
            # parameters.
            from tfdist.strategies.fsdp.shards import clip_sharded

            m = self.tensor_parallel.model_parallel
            copies = [_copies(split_of(v), self.num_replicas_in_sync // m, m)
                      for _, v in out]
            clipped = clip_sharded(self, self.communicator, optimizer, [g for g, _ in out],
                                   [split_of(v) is not None for _, v in out], copies=copies)
            out = [(g, v) for g, (_, v) in zip(clipped, out)]
        return out

    def _reduce_split(self, grads_and_vars):
        plan = self.tensor_parallel
        # A block sharded over the batch axis arrives summed over it (its gather's
        # gradient is a reduce-scatter there).
        split = [i for i, (g, v) in enumerate(grads_and_vars)
                 if g is not None and split_of(v) is not None
                 and split_of(v).batch_axis is None]
        if plan.batch_groups is None or not split:
            return grads_and_vars
        summed = tf.distribute.get_replica_context().merge_call(
            plan.reduce_split_gradients, args=([grads_and_vars[i][0] for i in split],))
        for i, grad in zip(split, summed):
            grads_and_vars[i] = (grad, grads_and_vars[i][1])
        return grads_and_vars


def _copies(split, d, m) -> int:
    """How many replicas hold the same part of a split variable: its slice d (one per
    data index), a block sharded over "batch" once, a block over "batch" alone m (the
    replicas of a model group)."""
    if split is None or split.batch_axis is None:
        return d
    return m if split.axis is None else 1


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
            names (``"model"`` and ``"batch"`` each at most once, else None) or a
            ``keras.distribution.TensorLayout``; or a ``keras.distribution.LayoutMap``.
        devices: Device names; default: every local GPU, or else every logical CPU.
        communication_options, compression: As `tfdist.MirroredStrategy`; the
            compression casts what is all-reduced or reduce-scattered (gradients and
            partial sums), not what is all-gathered.
        accumulate_steps: Refused above 1 (not implemented with split variables).
        model_parallel: The size m of the "model" axis; it divides the replica count n.
            Default (None): every replica (m = n). With m < n the replicas form an
            ``(n // m, m)`` data x model mesh, as Keras'
            ``DeviceMesh((d, m), ["batch", "model"])``: replica r has data index
            ``r // m`` and model index ``r % m``, holds slice ``r % m`` of each split
            variable, and its model-axis collectives run within its group of m
            (TF's collective V2 ops, `tfdist.comm.groups`). There a Dense or
            EinsumDense kernel laid out ``("batch", "model")`` or ``("model",
            "batch")`` is also sharded over the d replicas of the batch axis: each
            stores 1/(d*m) of it (`tfdist.strategies.tensor_parallel.batch_axis`); a variable laid out
            over "batch" alone (``("batch", None)``) is stored 1/d per replica.

    Attributes:
        tensor_parallel: The `tfdist.strategies.tensor_parallel.splits.TensorParallel` plan.
        communicator: The accounted communicator every collective goes through.
        bytes_communicated: Bytes sent so far (activations and gradients), after
            compression.
    """

    rank = 0
    size = 1
    num_workers = 1
    is_chief = True

    def __init__(self, layout_map, devices=None, communication_options=None,
                 compression=None, accumulate_steps=None, model_parallel=None):
        options = check_model_parallel(layout_map, devices, communication_options,
                                       compression, accumulate_steps, model_parallel)
        devices = validate_devices(devices) if devices is not None else default_devices()
        tp_checks.check_mesh_fits(layout_map, len(devices))
        tf_hooks.assign_collective_key_base(self)
        self._init_sync_gradients(options)
        super().__init__(devices=devices, cross_device_ops=default_cross_device_ops(devices))
        self._init_tensor_parallel(layout_map, model_parallel)


class MultiWorkerModelParallelStrategy(TensorParallelMixin, MultiWorkerMirroredStrategy):
    """`ModelParallelStrategy` over every replica of every worker (TF_CONFIG, ``tfdist
    launch``): the "model" axis spans the processes.

    Args:
        layout_map: As `ModelParallelStrategy`.
        cluster_resolver: As `tfdist.MultiWorkerMirroredStrategy`.
        model_parallel: As `ModelParallelStrategy`, over every replica of every worker.
            With m < n the model-axis collectives run within groups: TF's collective
            V2 ops under ``engine="tf"``, Horovod's ops within process sets under
            ``engine="horovod"`` (one replica per process). With ``model_parallel``
            given, ``engine="auto"`` picks ``"tf"``.
        **kwargs: `tfdist.MultiWorkerMirroredStrategy`'s arguments
            (``shard_optimizer_state`` and ``accumulate_steps`` refused).

    Raises:
        ValueError: in an elastic job (the split variables cannot re-form).
    """

    def __init__(self, layout_map, cluster_resolver=None, model_parallel=None, **kwargs):
        kwargs = check_multi_worker_model_parallel(layout_map, model_parallel=model_parallel,
                                                   **kwargs)
        kwargs["cluster_resolver"] = cluster_resolver
        if model_parallel is not None and kwargs.get("engine", AUTO) == AUTO:
            kwargs["engine"] = engine_with_groups()
        if os.environ.get(env.ELASTIC_ADDR):
            raise ValueError("An elastic job cannot re-form split variables over a new "
                             "number of workers. Received: tfdist launch --min-workers")
        self._mesh_model_parallel = model_parallel
        super().__init__(**kwargs)
        self._init_tensor_parallel(layout_map, model_parallel)

    def _engine_setup(self, options, **more):
        # The engine learns the mesh before it starts (Horovod declares its process
        # sets then).
        more.setdefault("model_parallel", self._mesh_model_parallel)
        return super()._engine_setup(options, **more)
