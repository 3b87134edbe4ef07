"""Communicators: how a strategy's tensors move between replicas and workers.

A `Communicator` all-reduces (sum or mean), all-gathers and reduce-scatters (sharded
optimizer state, `tfdist.strategies.zero.sharded_state`), called in cross-replica context with
per-replica values (what ``merge_call`` hands over); where it ``supports_groups``, also
within the groups of one axis of a data x model mesh (`Communicator.in_group`,
`tfdist.comm.groups`). `StrategyCommunicator` uses the
strategy's own cross-device ops: TF's collectives (gRPC ring on CPU, NCCL on GPU),
ReductionToOneDevice on one host, or whatever cross-device ops an engine's
``extended`` reduces with (`tfdist.engines`).

`Accounted` wraps any communicator once: it casts floating payloads for the wire
(`tfdist.comm.compression`) and counts the bytes one replica contributes
(`tfdist.comm.accounting.payload_bytes`). Every strategy that compresses or counts
(the synchronous ones for gradients, model averaging for weights) does so only here;
all-gathers (model averaging's quantised outer gradients, `tfdist.comm.quantize`) are
counted there too, as sent, and reduce-scatters as the whole payload one replica
contributes (as an all-reduce).
IndexedSlices (embedding gradients) travel uncompressed. An engine that moves tensors
another way gives its own `Communicator` subclass (`tfdist.engines.Engine.make_inner_communicator`).
"""

from __future__ import annotations

import abc

from tfdist.comm.accounting import ByteCounter, payload_bytes
from tfdist.comm.compression import get_compression

OPS = ("sum", "mean")
KINDS = ("all_gather", "all_reduce", "reduce_scatter")  # of `Communicator.in_group`


class Communicator(abc.ABC):
    """All-reduce over every replica of every worker; and, where ``supports_groups``,
    within the groups of one mesh axis (`in_group`)."""

    supports_groups = False  # whether `in_group` runs (a data x model mesh needs it)

    def in_group(self, group, kind: str, distribution, value, op: str = "sum"):
        """``kind`` (``"all_gather"``, ``"all_reduce"`` or ``"reduce_scatter"``) of a
        per-replica ``value`` within each group of ``group`` (a
        `tfdist.comm.groups.ReplicaGroups`), in cross-replica context.

        Returns:
            A per-replica value: each replica its group's result.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no collectives within groups of replicas (needed "
            "by a data x model mesh); implement Communicator.in_group")

    @abc.abstractmethod
    def all_reduce(self, distribution, values: list, destinations: list, op: str = "mean"
                   ) -> list:
        """Reduces each per-replica value across all replicas (cross-replica context).

        Args:
            distribution: The strategy.
            values: Per-replica values (or plain tensors: this worker's value).
            destinations: One variable per value, whose devices receive the result.
            op: ``"sum"`` or ``"mean"``.

        Returns:
            One reduced value per input (mirrored, or a plain tensor).
        """

    def all_gather(self, distribution, value):
        """Concatenates every replica's ``value`` along axis 0, in replica order
        (cross-replica context).

        Args:
            distribution: The strategy.
            value: A per-replica value (or a plain tensor: this worker's value); every
                replica's has the same shape.

        Returns:
            One tensor on the current device, the same on every worker.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot all-gather (needed by ModelAverageStrategy's "
            "outer_compression); implement Communicator.all_gather")

    def reduce_scatter(self, distribution, values: list, op: str = "sum") -> list:
        """Reduces each flat per-replica value and leaves replica r with slice r
        (cross-replica context).

        Default: an all-reduce, then each replica keeps its slice (the bytes of an
        all-reduce); communicators with a true reduce-scatter override it.

        Args:
            distribution: The strategy.
            values: Per-replica 1-D values (or plain tensors: this worker's value),
                their length a multiple of ``distribution.num_replicas_in_sync``.
            op: ``"sum"`` or ``"mean"``.

        Returns:
            One per-replica value per input: on each local replica, its slice (replica
            ``r`` of ``n`` in sync holds elements ``[r*len/n, (r+1)*len/n)``).
        """
        reduced = self.all_reduce(distribution, values, [None] * len(values), op)
        return [local_slices(distribution, distribution.experimental_local_results(r))
                for r in reduced]


def replica_ids(distribution) -> list[int]:
    """The replica ids in sync of this worker's local replicas (rank-major)."""
    local = len(distribution.extended.worker_devices)
    rank = getattr(distribution, "rank", 0)
    return [rank * local + i for i in range(local)]


def local_slices(distribution, fulls) -> object:
    """Per local replica, its slice of the full reduced value ``fulls[i]``
    (`Communicator.reduce_scatter`'s result)."""
    import tensorflow as tf

    n = distribution.num_replicas_in_sync
    devices = distribution.extended.worker_devices
    parts = []
    for i, replica in enumerate(replica_ids(distribution)):
        full = fulls[min(i, len(fulls) - 1)]
        size = flat_length(full) // n
        with tf.device(devices[i]):
            parts.append(tf.identity(full[replica * size:(replica + 1) * size]))
    return per_replica(parts)


def flat_length(tensor):
    """The length of 1-D ``tensor``: static when known (an int), else a scalar tensor.

    A bucket flattened from gradients of unknown static shape (a Dense kernel's on a
    3-D input is ``(None, units)`` in a traced step) has no static length."""
    import tensorflow as tf

    length = tensor.shape[0]
    return length if length is not None else tf.shape(tensor)[0]


def initial_value(distribution, value, dtype):
    """The whole initial value of a variable made in ``distribution``'s scope (call in
    ``tf.init_scope``): ``value`` (or ``value()``) as a tensor; on several workers the
    chief's, broadcast as the strategy's variable creator broadcasts it."""
    import tensorflow as tf

    full = tf.convert_to_tensor(value() if callable(value) else value, dtype=dtype)
    if getattr(distribution, "num_workers", 1) > 1:
        whole = tf.Variable(full, trainable=False, name="tfdist_initial_value")
        full = tf.convert_to_tensor(whole.values[0])
        del whole
    return full


def gather_numpy(distribution, value, axis: int = 0):
    """Cross-replica: every replica's piece of ``value`` (a mirrored variable's
    components, one per local replica, on every worker), concatenated on ``axis`` in
    replica order, as a numpy array. The strategy's ``gather``: with several workers a
    collective, so every worker must call it."""
    import numpy as np
    import tensorflow as tf

    parts = [tf.convert_to_tensor(v) for v in value.values]
    return np.asarray(distribution.gather(per_replica(parts, always_wrap=True), axis=axis))


def per_replica(parts, always_wrap: bool = False):
    """``parts`` (one per local replica) as one per-replica value (a tensor if one,
    unless ``always_wrap``)."""
    if len(parts) == 1 and not always_wrap:
        return parts[0]
    from tfdist._hooks import tf as tf_hooks

    return tf_hooks.tf_distribute_internals().regroup(parts, always_wrap=always_wrap)


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}. Received: op={op!r}")
    return op


def check_in_group(kind: str, op: str) -> None:
    """Refuses a ``kind`` or ``op`` that `Communicator.in_group` does not run, in one
    wording for every engine's communicator."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}. Received: kind={kind!r}")
    _check_op(op)


class StrategyCommunicator(Communicator):
    """The strategy's own cross-device ops (``distribution.extended.batch_reduce_to``).

    Args:
        cross_device_ops: Reduce with these `tf.distribute.CrossDeviceOps` instead of
            ``batch_reduce_to``: for a strategy whose ``batch_reduce_to`` itself goes
            through this communicator (`tfdist.HorovodStrategy`).
    """

    supports_groups = True

    def __init__(self, cross_device_ops=None):
        self._cross_device_ops = cross_device_ops

    def in_group(self, group, kind, distribution, value, op="sum"):
        """TF's collective V2 ops within each group (`tfdist.comm.groups`)."""
        check_in_group(kind, op)
        if kind == "all_gather":
            return group.all_gather(distribution, value)
        return getattr(group, kind)(distribution, value, op)

    def all_reduce(self, distribution, values, destinations, op="mean"):
        import tensorflow as tf

        if not values:
            return []
        reduce_op = {"sum": tf.distribute.ReduceOp.SUM,
                     "mean": tf.distribute.ReduceOp.MEAN}[_check_op(op)]
        pairs = [(v, d if d is not None else _destination(v))
                 for v, d in zip(values, destinations)]
        if self._cross_device_ops is not None:
            return self._cross_device_ops.batch_reduce(reduce_op, pairs)
        return distribution.extended.batch_reduce_to(reduce_op, pairs)

    def all_gather(self, distribution, value):
        """The strategy's own gather (TF's collective all-gather across workers,
        Horovod's ``allgather`` under the Horovod engine, a concat on one host)."""
        return distribution.gather(value, axis=0)

    def reduce_scatter(self, distribution, values, op="sum"):
        """Local replicas summed on the first device; across workers, the engine's
        reduce-scatter (`reduce_scatter_workers`), else an all-reduce; then split."""
        import tensorflow as tf

        _check_op(op)
        workers = getattr(distribution, "size", 1)
        devices = distribution.extended.worker_devices
        out = []
        for value in values:
            parts = distribution.experimental_local_results(value)
            with tf.device(devices[0]):
                total = tf.add_n(list(parts)) if len(parts) > 1 else tf.identity(parts[0])
                if workers > 1:
                    length = flat_length(total)
                    total = self.reduce_scatter_workers(distribution, total)
                    if total is None:  # no reduce-scatter across workers
                        return super().reduce_scatter(distribution, values, op)
                    total = tf.reshape(total, [length // workers])
                if op == "mean":
                    total = total / distribution.num_replicas_in_sync
            out.append(_split_local(distribution, total))
        return out

    def reduce_scatter_workers(self, distribution, tensor):
        """This worker's 1/W of ``tensor`` summed over the W workers, or None when the
        engine has no reduce-scatter (then an all-reduce is used)."""
        del distribution, tensor
        return None


def _split_local(distribution, worker_part):
    """A worker's part split over its local replicas, one piece per device."""
    import tensorflow as tf

    devices = distribution.extended.worker_devices
    size = flat_length(worker_part) // len(devices)
    pieces = []
    for i, device in enumerate(devices):
        with tf.device(device):
            pieces.append(tf.identity(worker_part[i * size:(i + 1) * size]))
    return per_replica(pieces)


def _destination(value):
    """Where ``value``'s reduction lands when no variable is given: its own devices.

    As TF's replica-context ``all_reduce`` (a plain tensor: one replica, its device).
    """
    import tensorflow as tf

    return value.device if isinstance(value, tf.Tensor) else value


class Accounted(Communicator):
    """Any communicator, with compression on the wire and byte counting, once.

    Args:
        inner: The communicator that moves the tensors.
        compression: None, ``"fp16"``, ``"bf16"`` or a compression policy.
        counter: The `ByteCounter` to add one replica's payload to, per reduction.
    """

    def __init__(self, inner: Communicator, compression=None,
                 counter: ByteCounter | None = None):
        self.inner = inner
        self.compression = get_compression(compression)
        self.counter = counter if counter is not None else ByteCounter()

    @property
    def bytes(self) -> int:
        return self.counter.total

    @property
    def supports_groups(self) -> bool:
        return self.inner.supports_groups

    def in_group(self, group, kind, distribution, value, op="sum"):
        """The inner communicator's collective within each group, counting one replica's
        payload (what a replica contributes to its group: its rows to an all-gather,
        its whole value to a reduce); the reduces compressed."""
        import tensorflow as tf

        part = distribution.experimental_local_results(value)[0]
        compress = kind != "all_gather" and self.compression.wire_dtype is not None \
            and tf.as_dtype(part.dtype).is_floating
        self.counter.add(payload_bytes(part, self.compression if compress else None))
        if not compress:
            return self.inner.in_group(group, kind, distribution, value, op)
        dtype = tf.as_dtype(part.dtype)
        wire = []
        for piece in distribution.experimental_local_results(value):
            with tf.device(piece.device):
                wire.append(self.compression.compress(piece)[0])
        out = []
        for piece in distribution.experimental_local_results(
                self.inner.in_group(group, kind, distribution, per_replica(wire), op)):
            with tf.device(piece.device):
                out.append(self.compression.decompress(piece, dtype))
        return per_replica(out)

    def all_reduce(self, distribution, values, destinations, op="mean"):
        import tensorflow as tf

        # One replica's payload, once per reduction (every replica sends the same shapes).
        self.counter.add(sum(payload_bytes(distribution.experimental_local_results(v)[0],
                                           self.compression) for v in values))
        if self.compression.wire_dtype is None:  # nothing to cast
            return self.inner.all_reduce(distribution, values, destinations, op)
        from tfdist._hooks import tf as tf_hooks

        regroup = tf_hooks.tf_distribute_internals().regroup
        wire, dtypes = [], []
        for value in values:
            parts = distribution.experimental_local_results(value)
            if isinstance(parts[0], tf.IndexedSlices):  # sparse: sent as it is
                wire.append(value)
                dtypes.append(None)
                continue
            cast = []
            for part in parts:
                with tf.device(part.device):
                    cast.append(self.compression.compress(part)[0])
            wire.append(regroup(cast) if len(parts) > 1 else cast[0])
            dtypes.append(tf.as_dtype(parts[0].dtype))
        reduced = self.inner.all_reduce(distribution, wire, destinations, op)
        return [r if dtype is None else self._decompress(distribution, r, dtype)
                for r, dtype in zip(reduced, dtypes)]

    def all_gather(self, distribution, value):
        """The inner communicator's all-gather, sent as it is (a quantised payload),
        counting one replica's bytes."""
        self.counter.add(payload_bytes(distribution.experimental_local_results(value)[0]))
        return self.inner.all_gather(distribution, value)

    def reduce_scatter(self, distribution, values, op="sum"):
        """The inner reduce-scatter, compressed, counting one replica's whole payload
        (what it contributes, as for an all-reduce)."""
        import tensorflow as tf

        self.counter.add(sum(payload_bytes(distribution.experimental_local_results(v)[0],
                                           self.compression) for v in values))
        if self.compression.wire_dtype is None:
            return self.inner.reduce_scatter(distribution, values, op)
        wire, dtypes = [], []
        for value in values:
            parts = distribution.experimental_local_results(value)
            cast = []
            for part in parts:
                with tf.device(part.device):
                    cast.append(self.compression.compress(part)[0])
            wire.append(per_replica(cast))
            dtypes.append(tf.as_dtype(parts[0].dtype))
        out = []
        for scattered, dtype in zip(self.inner.reduce_scatter(distribution, wire, op), dtypes):
            parts = []
            for part in distribution.experimental_local_results(scattered):
                with tf.device(part.device):
                    parts.append(self.compression.decompress(part, dtype))
            out.append(per_replica(parts))
        return out

    def _decompress(self, distribution, value, dtype):
        import tensorflow as tf

        if isinstance(value, tf.distribute.DistributedValues):
            from tfdist._hooks import tf as tf_hooks

            parts = []
            for part in distribution.experimental_local_results(value):
                with tf.device(part.device):
                    parts.append(self.compression.decompress(part, dtype))
            # Same wrapper as the engine's result (Mirrored from cross-device ops).
            return tf_hooks.tf_distribute_internals().regroup(parts, wrap_class=type(value))
        return self.compression.decompress(value, dtype)
