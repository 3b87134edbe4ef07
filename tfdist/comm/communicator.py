"""Communicators: how a strategy's tensors move between replicas and workers.

A `Communicator` all-reduces (sum or mean), broadcasts and waits at a barrier, called in
cross-replica context with per-replica values (what ``merge_call`` hands over). Two
engines implement it:

- `StrategyCommunicator` (``"tf"``): the strategy's own cross-device ops, i.e. TF's
  collectives (gRPC ring on CPU, NCCL on GPU), ReductionToOneDevice on one host, or
  Horovod's ops under ``engine="horovod"``;
- `HorovodCommunicator` (``"horovod"``): `tfdist.comm.horovod` directly, one replica
  per process (the deprecated ``ModelAverageStrategy(backend="horovod")``).

`Accounted` wraps any of them once: it casts floating payloads for the wire
(`tfdist.comm.compression`) and counts the bytes one replica contributes. Adding an
engine means adding one `Communicator` subclass.
"""

from __future__ import annotations

import abc

from tfdist.comm.accounting import ByteCounter
from tfdist.comm.compression import get_compression

OPS = ("sum", "mean")


class Communicator(abc.ABC):
    """All-reduce, broadcast and barrier over every replica of every worker."""

    name: str = ""

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

    def broadcast(self, distribution, values: list, destinations: list, root_replica: int = 0
                  ) -> list:
        """Replica ``root_replica``'s value of each per-replica value, everywhere."""
        import tensorflow as tf

        def keep_root(value):
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return value * tf.cast(tf.equal(replica, root_replica), value.dtype)

        masked = [distribution.run(keep_root, args=(value,)) for value in values]
        return self.all_reduce(distribution, masked, destinations, op="sum")

    def barrier(self, distribution) -> None:
        """Returns when every replica reached it (a one-element all-reduce)."""
        import tensorflow as tf

        self.all_reduce(distribution, [tf.zeros([1])], [None], op="sum")


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}. Received: op={op!r}")
    return op


class StrategyCommunicator(Communicator):
    """The strategy's own cross-device ops (``distribution.extended.batch_reduce_to``)."""

    name = "tf"

    def all_reduce(self, distribution, values, destinations, op="mean"):
        import tensorflow as tf

        if not values:
            return []
        reduce_op = {"sum": tf.distribute.ReduceOp.SUM,
                     "mean": tf.distribute.ReduceOp.MEAN}[_check_op(op)]
        pairs = [(v, d if d is not None else v) for v, d in zip(values, destinations)]
        return distribution.extended.batch_reduce_to(reduce_op, pairs)


class HorovodCommunicator(Communicator):
    """`tfdist.comm.horovod` ops across processes; one replica per process."""

    name = "horovod"

    def __init__(self, name_prefix: str = "tfdist"):
        self._prefix = name_prefix

    def all_reduce(self, distribution, values, destinations, op="mean"):
        from tfdist.comm import horovod  # lazy: only this engine imports Horovod

        del destinations
        local = []
        for value in values:
            parts = distribution.experimental_local_results(value)
            if len(parts) != 1:
                raise ValueError("the horovod communicator runs one replica per process. "
                                 f"Received: {len(parts)} local replicas")
            local.append(parts[0])
        return horovod.allreduce(local, op={"sum": "sum", "mean": "average"}[_check_op(op)],
                                 name=self._prefix)


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
        self.name = inner.name
        self.compression = get_compression(compression)
        self.counter = counter if counter is not None else ByteCounter()

    @property
    def bytes(self) -> int:
        return self.counter.total

    def all_reduce(self, distribution, values, destinations, op="mean"):
        from tfdist import _hooks

        internals = _hooks.tf_distribute_internals()
        import tensorflow as tf

        if self.compression.wire_dtype is None:  # nothing to cast: count and pass on
            self.counter.add(sum(self.compression.wire_bytes(
                distribution.experimental_local_results(v)[0]) for v in values))
            return self.inner.all_reduce(distribution, values, destinations, op)
        wire, dtypes, nbytes = [], [], 0
        for value in values:
            parts = distribution.experimental_local_results(value)
            cast = []
            for part in parts:
                with tf.device(part.device):
                    cast.append(self.compression.compress(part))
            wire.append(internals.regroup([c for c, _ in cast]) if len(parts) > 1
                        else cast[0][0])
            dtypes.append(cast[0][1])
            nbytes += self.compression.wire_bytes(parts[0])
        self.counter.add(nbytes)
        reduced = self.inner.all_reduce(distribution, wire, destinations, op)
        return [self._decompress(distribution, r, dtype) for r, dtype in zip(reduced, dtypes)]

    def _decompress(self, distribution, value, dtype):
        import tensorflow as tf

        if isinstance(value, tf.distribute.DistributedValues):
            parts = [self.compression.decompress(p, dtype)
                     for p in distribution.experimental_local_results(value)]
            from tfdist import _hooks

            return _hooks.tf_distribute_internals().regroup(parts)
        return self.compression.decompress(value, dtype)


def make_communicator(engine: str, compression=None, counter: ByteCounter | None = None,
                      name: str = "tfdist") -> Accounted:
    """The accounted communicator of ``engine`` (``"tf"`` or ``"horovod"``).

    ``name`` prefixes Horovod's op names (ranks match tensors by name).
    """
    if engine == "tf":
        inner = StrategyCommunicator()
    elif engine == "horovod":
        inner = HorovodCommunicator(name)
    else:
        raise ValueError(f"engine must be 'tf' or 'horovod'. Received: engine={engine!r}")
    return Accounted(inner, compression, counter)
