"""Horovod as a strategy's ``extended``: replicas of every Horovod process, reduced by Horovod.

Each process mirrors the model on its local devices like `tfdist.MirroredStrategy`.
Every reduction first sums the local replicas on one device, then all-reduces that sum
across processes with Horovod (Gloo on CPU, NCCL on GPU): `HorovodCrossDeviceOps`,
which only moves tensors. Initial variable values are broadcast from rank 0 when the
variables are created.

`HorovodExtended` is the ``extended`` of `tfdist.HorovodStrategy` and of
``tfdist.MultiWorkerMirroredStrategy(engine="horovod")``.
"""

from __future__ import annotations

import contextlib
import logging
import re

import tensorflow as tf

from tfdist._hooks import tf as tf_hooks
from tfdist._hooks.extended import own_cross_device_ops_class, own_extended_class
from tfdist.devices import default_devices, validate_devices
from tfdist.engines.base import models_differ
from tfdist.engines.horovod import ops as comm

_tf = tf_hooks.tf_distribute_internals()


def _local_parts(value):
    """``value``'s local parts as they are (tensors or ``IndexedSlices``)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def _local_values(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return [tf.convert_to_tensor(v) for v in value.values]
    return [tf.convert_to_tensor(value)]


class HorovodCrossDeviceOps(own_cross_device_ops_class()):
    """Sums local replicas on one device, then all-reduces across processes with Horovod.

    It only moves tensors, in their own dtype: compression and byte counting are the
    strategy's communicator's (`tfdist.comm.communicator.Accounted`).

    Args:
        reduce_to_device: Device that holds the local sum.
    """

    def __init__(self, reduce_to_device: str):
        super().__init__()
        self._reduce_to_device = reduce_to_device

    def processes(self) -> int:
        # Stops the base class from skipping the reduction when a process has a
        # single local replica: the other processes still hold values.
        return comm.size()

    def all_reduce_values(self, reduce_op, per_replica_values):
        """Returns one reduced tensor (on the reduce device) per input value.

        ``IndexedSlices`` (an Embedding's gradient) stay sparse, as with TF's own
        cross-device ops: every replica's rows, gathered (`gather_slices`)."""
        sparse = {k: self.gather_slices(reduce_op, _local_parts(v))
                  for k, v in enumerate(per_replica_values)
                  if isinstance(_local_parts(v)[0], tf.IndexedSlices)}
        dense = [v for k, v in enumerate(per_replica_values) if k not in sparse]
        reduced = iter(self.all_reduce_dense(reduce_op, dense))
        return [sparse[k] if k in sparse else next(reduced)
                for k in range(len(per_replica_values))]

    def gather_slices(self, reduce_op, parts):
        """Sparse ``parts`` (one per local replica) of every process, concatenated
        (divided by the number of replicas for MEAN), as ``tf.IndexedSlices``."""
        with tf.device(self._reduce_to_device):
            values = comm.allgather(tf.concat([p.values for p in parts], 0))
            indices = comm.allgather(tf.concat([tf.cast(p.indices, tf.int64)
                                                for p in parts], 0))
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                values = values / tf.cast(len(parts) * comm.size(), values.dtype)
            return tf.IndexedSlices(values, indices, parts[0].dense_shape)

    def all_reduce_dense(self, reduce_op, per_replica_values):
        if not per_replica_values:
            return []
        local_values = [_local_values(v) for v in per_replica_values]
        with tf.device(self._reduce_to_device):
            local_sums = [vals[0] if len(vals) == 1 else tf.add_n(vals) for vals in local_values]
            sums = comm.allreduce(local_sums, op="sum")
            out = []
            for total, vals in zip(sums, local_values):
                if reduce_op == tf.distribute.ReduceOp.MEAN:
                    count = len(vals) * comm.size()
                    if total.dtype.is_floating or total.dtype.is_complex:
                        total = total / tf.cast(count, total.dtype)
                    else:
                        total = total // count
                out.append(total)
        return out

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        del options
        (total,) = self.all_reduce_values(reduce_op, [per_replica_value])
        return _tf.simple_broadcast(total, destinations, always_mirrored=True,
                                    canonicalize_devices=self.canonicalize_devices)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        del options
        totals = self.all_reduce_values(reduce_op, [v for v, _ in value_destination_pairs])
        return [_tf.simple_broadcast(t, d, always_mirrored=True,
                                     canonicalize_devices=self.canonicalize_devices)
                for t, (_, d) in zip(totals, value_destination_pairs)]

    def broadcast_implementation(self, tensor, destinations):
        return _tf.simple_broadcast(tensor, destinations, always_mirrored=True,
                                    canonicalize_devices=self.canonicalize_devices)


def _shape_of(shape, initial_value) -> str:
    """``"[3,4]"``: a variable's shape as Horovod prints it (from its initial value when
    ``shape`` is None)."""
    if shape is None:
        if isinstance(initial_value, _tf.CheckpointInitialValue):
            initial_value = initial_value.wrapped_value
        value = initial_value() if callable(initial_value) else initial_value
        shape = getattr(value, "shape", None)
    return "[" + ",".join(str(d) for d in tf.TensorShape(shape).as_list()) + "]"


@contextlib.contextmanager
def _without_tf_config_note():
    """Drops TF's "TF_CONFIG will be ignored" line while `MirroredExtended` starts.

    TF logs it whenever TF_CONFIG names a cluster, but under the Horovod engine tfdist
    reads that TF_CONFIG to bring up Horovod (`tfdist.engines.horovod`), so the line
    would mislead.
    """
    def keep(record: logging.LogRecord) -> bool:
        return "TF_CONFIG will be ignored" not in record.getMessage()

    logger = logging.getLogger("tensorflow")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class HorovodExtended(own_extended_class()):
    """`MirroredExtended` whose replicas span every Horovod process (TF's private
    extension points are mapped to the public-named methods here by
    `tfdist._hooks.extended`).

    Args:
        container_strategy: The strategy.
        devices: This process's devices.
        cross_device_ops: The `HorovodCrossDeviceOps` (default: one on ``devices[0]``).
        communicator: None, or a communicator every ``batch_reduce_to`` goes through
            (it must reduce with ``cross_device_ops`` itself, not ``batch_reduce_to``).
    """

    def __init__(self, container_strategy, devices, cross_device_ops=None, communicator=None):
        self._hvd_rank = comm.rank()
        self._hvd_size = comm.size()
        self._hvd_ops = cross_device_ops or HorovodCrossDeviceOps(devices[0])
        self._communicator = communicator
        with _without_tf_config_note():
            super().__init__(container_strategy, devices=devices,
                             cross_device_ops=self._hvd_ops)
        self.set_cluster_resolver(None)

    @property
    def horovod_ops(self) -> HorovodCrossDeviceOps:
        """The cross-device ops that move this extended's reductions."""
        return self._hvd_ops

    def reduce_through(self, communicator) -> None:
        """Makes every ``batch_reduce_to`` (a replica's ``all_reduce`` too) go through
        ``communicator``, which must reduce with `horovod_ops` (`tfdist.HorovodStrategy`:
        compressed and counted, as Horovod's ``Compression``)."""
        self._communicator = communicator

    def refresh_membership(self) -> None:
        """Reads this process's rank and the size again after Horovod re-formed
        (an elastic job): the replica count and ids follow them."""
        self._hvd_rank = comm.rank()
        self._hvd_size = comm.size()
        self.set_chief(self._hvd_rank == 0)  # the oldest member has the chief's role

    def set_cluster_resolver(self, resolver):
        """Sets what stock code reads of TF's multi-worker ``extended`` from ``resolver``.

        TF's tutorials read ``strategy.cluster_resolver`` (task type, id, cluster spec)
        and tf.keras' write-path rule reads the private ``_task_type``/``_task_id``;
        they are set as TF's ``CollectiveAllReduceExtended`` sets them, so both engines
        answer alike. Without a resolver (under ``horovodrun``), this process is
        ``worker-<rank>`` of ``size`` workers and rank 0 is the chief.

        Args:
            resolver: A TF ``ClusterResolver`` of the job, or None.
        """
        self.set_task_attributes(resolver, self._hvd_rank, self._hvd_size)

    # --- replicas -------------------------------------------------------------------
    def replicas_in_sync(self) -> int:
        return len(self.local_devices) * self._hvd_size

    def multi_worker_mode(self) -> bool:
        # As TF's: several processes. Keras 3 then averages metrics with `strategy.reduce`
        # and gathers `predict` outputs across them (_hooks.keras_trainer).
        return self._hvd_size > 1

    def replica_id_in_sync_group(self, replica_id) -> int:
        # As TF's multi-worker extended: this process's replicas follow the earlier ranks'.
        return self._hvd_rank * len(self.local_devices) + replica_id

    def local_replica_id(self, replica_id_in_sync_group) -> int:
        return replica_id_in_sync_group - self._hvd_rank * len(self.local_devices)

    # --- variables: rank 0's initial values everywhere -------------------------------
    def create_variable(self, next_creator, **kwargs):
        initial = kwargs.get("initial_value")
        if self._hvd_size > 1 and not _joins_running_job():
            initial_value = kwargs["initial_value"]
            if isinstance(initial_value, _tf.CheckpointInitialValue):
                initial_value = initial_value.wrapped_value

            def broadcast_initial_value():
                value = initial_value() if callable(initial_value) else initial_value
                with tf.device(self.local_devices[0]):
                    return comm.broadcast(value, root_rank=0)

            kwargs["initial_value"] = broadcast_initial_value
        try:
            return self.stock_create_variable(next_creator, **kwargs)
        except tf.errors.OpError as error:
            shapes = re.search(r"Mismatched BROADCAST tensor shapes: One rank sent a tensor of "
                               r"shape (\[[^\]]*\]), but another rank sent a tensor of shape "
                               r"(\[[^\]]*\])", error.message or "")
            if shapes is None:
                raise
            mine, other = (shape.replace(" ", "") for shape in shapes.groups())
            if mine != _shape_of(kwargs.get("shape"), initial):
                mine, other = other, mine
            me = getattr(self.container_strategy, "task_name", f"worker-{self._hvd_rank}")
            raise models_differ(kwargs.get("name"),
                                f": its shape is {mine} on {me} and {other} on another worker",
                                error.message) from None

    # --- reductions -----------------------------------------------------------------
    def own_cross_device_ops(self):
        return self._hvd_ops

    def reduce_to_destinations(self, reduce_op, value, destinations, options):
        if _tf.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value

        if _joins_running_job():  # reads within fit's set-up, before this worker trains
            return tf.nest.map_structure(
                lambda v: self._local_reduce(reduce_op, v, destinations), value)

        def reduce_one(v):
            if not isinstance(v, tf.distribute.DistributedValues) and (
                    self.replicas_in_sync() == 1):
                return _tf.reduce_non_distributed_value(reduce_op, v, destinations,
                                                        self.replicas_in_sync())
            # As in MultiWorkerMirroredStrategy, a plain tensor is this process's value.
            return self._hvd_ops.reduce(reduce_op, v, destinations=destinations, options=options)

        return tf.nest.map_structure(reduce_one, value)

    def _local_reduce(self, reduce_op, value, destinations):
        """``value`` reduced over this process's replicas only."""
        values = _local_values(value)
        with tf.device(self.local_devices[0]):
            total = values[0] if len(values) == 1 else tf.add_n(values)
            if reduce_op == tf.distribute.ReduceOp.MEAN and len(values) > 1:
                total = total / len(values)
        return _tf.simple_broadcast(total, destinations or self.local_devices[0],
                                    always_mirrored=True, canonicalize_devices=True)

    def batch_reduce_to_destinations(self, reduce_op, value_destination_pairs, options):
        if self._communicator is None:
            return self._hvd_ops.batch_reduce(reduce_op, value_destination_pairs,
                                              options=options)
        op = {"SUM": "sum", "MEAN": "mean"}[getattr(reduce_op, "value", str(reduce_op).upper())]
        return self._communicator.all_reduce(
            self.container_strategy, [v for v, _ in value_destination_pairs],
            [d for _, d in value_destination_pairs], op=op)

    def gather_to_destinations(self, value, destinations, axis, options):
        del options
        with tf.device(self.local_devices[0]):
            vals = _local_values(value)
            local = vals[0] if len(vals) == 1 else tf.concat(vals, axis=axis)
            if axis != 0:
                local = tf.experimental.numpy.moveaxis(local, axis, 0)
            gathered = comm.allgather(local)
            if axis != 0:
                gathered = tf.experimental.numpy.moveaxis(gathered, 0, axis)
        return _tf.simple_broadcast(gathered, destinations, always_mirrored=True,
                                    canonicalize_devices=True)

    # --- input: each process reads its shard of every global batch -------------------
    def input_context(self):
        return tf.distribute.InputContext(num_input_pipelines=self._hvd_size,
                                          input_pipeline_id=self._hvd_rank,
                                          num_replicas_in_sync=self.replicas_in_sync())

    def distribute_dataset(self, dataset, options):
        elastic = getattr(self.container_strategy, "_elastic_dataset", None)
        if elastic is not None:  # an elastic fit's training data (tfdist.strategies.elastic.fit)
            return elastic(dataset)
        if (options and options.experimental_replication_mode
                == tf.distribute.InputReplicationMode.PER_REPLICA):
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported "
                                      "in `distribute_datasets_from_function`.")
        return self.stock_distribute_dataset(dataset, options)


def _joins_running_job() -> bool:
    """Whether this process joined a running elastic job and does not train yet.

    Its variables get the job's values in ``fit`` (`tfdist.strategies.elastic.fit`), not
    when made; and until its first train step, reads of on-read variables (Keras resets
    its metrics when an epoch starts) and fit's build from a batch stay on this process:
    the members are in the middle of an epoch.
    """
    from tfdist.engines.horovod import elastic

    member = elastic.member()
    return member is not None and not member.training


def rank_devices(devices=None) -> list[str]:
    """This rank's devices: ``devices`` checked, or its GPU (by local rank), or its CPUs."""
    if devices is not None:
        return validate_devices(devices)
    gpus = tf.config.list_logical_devices("GPU")
    return [gpus[comm.local_rank() % len(gpus)].name] if gpus else default_devices()
