"""What every synchronous tfdist strategy adds to Keras' gradient all-reduce:
compression, byte counting and local gradient accumulation (`CommunicationOptions`).

Accumulation does not use Keras' ``gradient_accumulation_steps``: Keras puts the
all-reduce inside a ``cond`` in replica context, which MirroredStrategy rejects
("merge_call called while defining a new graph"). Here each replica adds its gradient
to a local (ON_READ) accumulator, then one unconditional ``merge_call`` decides in
cross-replica context whether this is the k-th micro-batch; only then are the sums
all-reduced (once per k) and applied.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfdist import _hooks
from tfdist.comm.accounting import ByteCounter
from tfdist.comm.compression import get_compression
from tfdist.comm.options import CommunicationOptions
from tfdist.strategies._fit import KerasFitMixin


def _local_accumulators(variables) -> list:
    """One replica-local (ON_READ) zero accumulator per variable; call in the scope."""
    with tf.init_scope():
        return [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                            synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM,
                            name="tfdist_grad_accumulator")
                for v in variables]


class SyncGradientsMixin(KerasFitMixin):
    """Mixed into a strategy class; call `_init_sync_gradients` in its ``__init__``.

    The strategy then casts floating gradients to the compression dtype for the
    all-reduce, counts the bytes each worker contributes (`bytes_communicated`), and
    sums ``accumulate_steps`` micro-batches locally before each all-reduce. A strategy
    whose cross-device ops compress and count themselves sets
    ``_compresses_in_cross_device_ops`` and hands gradients to Keras' own reduce.
    """

    _compresses_in_cross_device_ops = False

    def _init_sync_gradients(self, options: CommunicationOptions) -> None:
        self.communication = options
        self._byte_counter = ByteCounter()
        self._accumulators = {}
        # Micro-batches seen, a host counter (created outside any scope).
        self._micro_steps = ByteCounter("tfdist_micro_steps")
        _hooks.install_keras_hooks()

    @property
    def bytes_communicated(self) -> int:
        """Gradient bytes this worker has all-reduced (after compression)."""
        return self._byte_counter.total

    # ---- every step: compress and count around Keras' own all-reduce -----------------

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        compression = self.communication.compression_policy
        wire, dtypes = [], []
        for grad, var in grads_and_vars:
            if grad is None or isinstance(grad, tf.IndexedSlices):
                wire.append((grad, var))
                dtypes.append(None)
                continue
            cast, dtype = compression.compress(grad)
            wire.append((cast, var))
            dtypes.append(dtype)
        self._count_once_per_worker(_wire_bytes([g for g, _ in grads_and_vars], compression))
        reduced = reduce(wire)
        return [(grad if dtype is None else compression.decompress(grad, dtype), var)
                for (grad, var), dtype in zip(reduced, dtypes)]

    def _count_once_per_worker(self, nbytes: int) -> None:
        """Every local replica runs this; only the first local one adds."""
        local_replicas = len(self.extended.worker_devices)
        replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
        is_first_local = tf.equal(tf.math.floormod(replica_id, local_replicas), 0)
        self._byte_counter.add(tf.cast(is_first_local, tf.int64) * nbytes)

    # ---- accumulate_steps > 1: replaces Keras' optimizer step (see module docstring) ----

    def keras_local_update(self):
        if self.communication.accumulate_steps > 1:
            return self._accumulate_apply
        return None

    def _accumulate_apply(self, optimizer, apply_fn, grads, variables):
        del apply_fn
        if optimizer.weight_decay or optimizer.use_ema or optimizer.gradient_accumulation_steps:
            raise ValueError("accumulate_steps does not combine with the optimizer's "
                             "weight_decay, use_ema or gradient_accumulation_steps. Received: "
                             f"weight_decay={optimizer.weight_decay}, "
                             f"use_ema={optimizer.use_ema}")
        variables = [getattr(v, "value", v) for v in variables]
        context = tf.distribute.get_replica_context()
        context.merge_call(functools.partial(self._ensure_accumulators, optimizer, variables))
        sums = self._accumulators[id(optimizer)]
        compression = self._accumulate_compression()
        totals = [acc.read_value() + tf.convert_to_tensor(g) for acc, g in zip(sums, grads)]
        wire = [compression.compress(t)[0] for t in totals]
        is_update = context.merge_call(
            functools.partial(self._merge_accumulated, optimizer, variables), args=(wire,))
        for acc, total in zip(sums, totals):
            acc.assign(total * (1 - tf.cast(is_update, total.dtype)))

    def _accumulate_compression(self):
        if self._compresses_in_cross_device_ops:
            return get_compression(None)
        return self.communication.compression_policy

    def _ensure_accumulators(self, optimizer, variables, distribution):
        if id(optimizer) not in self._accumulators:
            with self.scope():
                self._accumulators[id(optimizer)] = _local_accumulators(variables)

    def _merge_accumulated(self, optimizer, variables, distribution, wire):
        """Cross-replica: on every k-th micro-batch, all-reduce the sums and apply them."""
        steps = self.communication.accumulate_steps
        compression = self._accumulate_compression()
        is_update = tf.equal(tf.math.floormod(self._micro_steps.add(1), steps), 0)

        def update():
            reduced = distribution.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, list(zip(wire, variables)))
            if not self._compresses_in_cross_device_ops:
                self._byte_counter.add(_wire_bytes(
                    distribution.experimental_local_results(w)[0] for w in wire))
            grads = [compression.decompress(
                distribution.experimental_local_results(r)[0], v.dtype) / steps
                for r, v in zip(reduced, variables)]
            grads = optimizer._clip_gradients(grads)
            _hooks.keras_distributed_update(optimizer, distribution, grads, variables)
            return tf.constant(True)

        def skip():
            # Keras' apply() adds 1 to iterations after this: net zero until an update.
            optimizer._iterations.assign_sub(1)
            return tf.constant(False)

        return tf.cond(is_update, update, skip)


def _wire_bytes(grads, compression=None) -> int:
    compression = compression or get_compression(None)
    total = 0
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            total += (compression.wire_bytes(grad.values)
                      + grad.indices.shape.num_elements() * grad.indices.dtype.size)
        else:
            total += compression.wire_bytes(grad)
    return total
