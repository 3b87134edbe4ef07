"""Sharded optimizer state (ZeRO-1/2) for the synchronous strategies.

With ``shard_optimizer_state=True`` each step's gradients are flattened into buckets
(`BUCKET_BYTES`, one dtype each, padded to a multiple of the replicas in sync N),
reduce-scattered through the strategy's communicator (compression and byte counting
stay there), and replica r applies the optimizer to slice r of every bucket only: an
inner Keras optimizer of the same class and config per replica, built on plain flat
slice variables of that replica's device, so its slots hold ~1/N of the elements.
The updated slices are all-gathered and written into the full (mirrored) weights
before the next forward pass.

Keras' rules are kept: weight decay (``weight_decay``, ``exclude_from_weight_decay``:
a 0/1 mask over the slice), clipping (``clipvalue`` element-wise; ``clipnorm`` per
variable and ``global_clipnorm`` over every shard: one small all-reduce), the
learning rate (schedules read the outer optimizer's ``iterations``).
Only optimizers whose update is element-wise are accepted (`SHARDABLE`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tfdist._hooks import zero as zero_hooks
from tfdist.comm.communicator import per_replica, replica_ids
from tfdist.strategies.zero import sparse as _sparse

# Keras optimizers whose update_step works element by element.
SHARDABLE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Lion",
             "Ftrl")
# Bytes of gradients per bucket (one reduce-scatter and one all-gather each): fewer,
# larger collectives (benchmarks/zero.py: 4 MB buckets made Horovod's step slower).
BUCKET_BYTES = 16 * 2**20


def check_shardable(optimizer) -> None:
    """Raises a ValueError naming ``optimizer`` unless its state can be sharded."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer  # the loss scale itself is one scalar
    name = type(optimizer).__name__
    if getattr(keras.optimizers, name, None) is not type(optimizer) or name not in SHARDABLE:
        raise ValueError(
            "shard_optimizer_state=True shards the state of element-wise optimizers only "
            f"({', '.join(SHARDABLE)}); {name} needs whole tensors or is not known to "
            f"update element-wise. Received: optimizer={name}")
    if zero_hooks.backend_update_step_overridden(optimizer):
        raise ValueError(f"shard_optimizer_state=True cannot shard {name}: it updates "
                         f"outside update_step. Received: optimizer={name}")
    if optimizer.use_ema or optimizer.gradient_accumulation_steps:
        raise ValueError(
            "shard_optimizer_state=True does not combine with the optimizer's use_ema or "
            f"gradient_accumulation_steps (use accumulate_steps). Received: "
            f"use_ema={optimizer.use_ema}, "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}")


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Variables flattened one after the other, padded to ``slice_size * N``."""

    members: tuple      # indices into the variable list
    offsets: tuple
    sizes: tuple
    shapes: tuple
    dtype: str
    slice_size: int

    def pieces(self, replica):
        """``[(member position, start, stop)]`` of replica's slice, and the padding."""
        lo, hi = replica * self.slice_size, (replica + 1) * self.slice_size
        found = []
        for k, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            start, stop = max(lo, offset), min(hi, offset + size)
            if start < stop:
                found.append((k, start - offset, stop - offset))
        end = self.offsets[-1] + self.sizes[-1]
        return found, max(0, hi - max(lo, end))


def make_buckets(variables, replicas: int, bucket_bytes: int) -> list:
    """The variables in order, in buckets of one dtype and about ``bucket_bytes``."""
    groups, current = [], []
    for index, v in enumerate(variables):
        dtype = np.dtype(v.dtype)
        nbytes = sum(math.prod(variables[i].shape) for i in current) * dtype.itemsize
        if current and (np.dtype(variables[current[0]].dtype) != dtype
                        or nbytes + math.prod(v.shape) * dtype.itemsize > bucket_bytes):
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    buckets = []
    for group in groups:
        sizes = [math.prod(variables[i].shape) for i in group]
        offsets = np.cumsum([0] + sizes[:-1]).tolist()
        buckets.append(Bucket(tuple(group), tuple(offsets), tuple(sizes),
                              tuple(tuple(variables[i].shape) for i in group),
                              np.dtype(variables[group[0]].dtype).name,
                              max(1, math.ceil(sum(sizes) / replicas))))
    return buckets


class ShardedOptimizerState:
    """One optimizer's sharded state on this worker's replicas.

    Args:
        strategy: The strategy (its local devices and replica ids).
        optimizer: The model's Keras optimizer (the "outer" one: learning rate,
            iterations, weight decay and clipping settings).
        variables: The Keras variables it updates.
        bucket_bytes: Gradient bytes per bucket (default `BUCKET_BYTES`).
    """

    def __init__(self, strategy, optimizer, variables, bucket_bytes=None):
        import keras
        import tensorflow as tf

        self.replicas = strategy.num_replicas_in_sync
        self.devices = list(strategy.extended.worker_devices)
        self.replica_ids = replica_ids(strategy)
        self.buckets = make_buckets(variables, self.replicas, bucket_bytes or BUCKET_BYTES)
        self.optimizers, self.slices = [], []
        with zero_hooks.plain_variables():
            config = optimizer.get_config()
            for i, device in enumerate(self.devices):
                with tf.device(device):
                    inner = type(optimizer).from_config(dict(config,
                                                             name=f"tfdist_shard_{i}"))
                    slices = [keras.Variable(np.zeros(b.slice_size, b.dtype), trainable=False,
                                             name=f"tfdist_shard_{i}_bucket_{k}")
                              for k, b in enumerate(self.buckets)]
                    inner.build(slices)
                self.optimizers.append(inner)
                self.slices.append(slices)
        self._masks = self._segment_constants(optimizer, variables)

    def slot_elements(self) -> list[int]:
        """Per local replica: elements of its optimizer's slots (not counters)."""
        counts = []
        for inner in self.optimizers:
            counts.append(sum(math.prod(v.shape) for v in inner.variables
                              if len(v.shape) > 0))
        return counts

    def _segment_constants(self, optimizer, variables):
        """Per (local replica, bucket): the weight-decay mask (or None) and the segment
        id (variable index; padding: len(variables)) of each slice element."""
        decay = optimizer.weight_decay is not None
        out = []
        for replica in self.replica_ids:
            row = []
            for b in self.buckets:
                ids = np.full(b.slice_size, len(variables), np.int32)
                mask = np.zeros(b.slice_size, b.dtype)
                pieces, _ = b.pieces(replica)
                at = 0
                for k, start, stop in pieces:
                    ids[at:at + stop - start] = b.members[k]
                    if decay and zero_hooks.uses_weight_decay(optimizer,
                                                              variables[b.members[k]]):
                        mask[at:at + stop - start] = 1
                    at += stop - start
                row.append((mask if decay else None, ids))
            out.append(row)
        return out

    # ---- one step (cross-replica context) ------------------------------------------------

    def apply(self, distribution, communicator, optimizer, grads, variables, scale=None
              ) -> None:
        """Reduce-scatters ``grads``, updates each replica's slices, all-gathers them
        into ``variables``.

        Args:
            distribution: The strategy.
            communicator: Its `tfdist.comm.communicator.Accounted` communicator.
            optimizer: The outer Keras optimizer.
            grads: One per-replica gradient per variable (summed over replicas by the
                reduce-scatter: Keras scales each replica's loss by 1/N).
            variables: The Keras variables, in `make_buckets`' order.
            scale: None, or a factor for the gradients (``1/accumulate_steps``).
        """
        import tensorflow as tf

        flat, sparse = [], []
        local_grads = [distribution.experimental_local_results(g) for g in grads]
        for b in self.buckets:
            parts, pairs = [], []
            for i, device in enumerate(self.devices):
                with tf.device(device):
                    part, found = self._flatten(b, [local_grads[m][i] for m in b.members])
                    if scale is not None:
                        part = part * tf.cast(scale, b.dtype)
                        if found is not None:
                            found = (found[0], found[1] * tf.cast(scale, b.dtype))
                    parts.append(part)
                    pairs.append(found)
            flat.append(per_replica(parts))
            sparse.append(None if pairs[0] is None else _sparse.gather_occurrences(
                distribution, communicator, pairs))
        scattered = [distribution.experimental_local_results(s)
                     for s in communicator.reduce_scatter(distribution, flat, op="sum")]
        for k, (b, found) in enumerate(zip(self.buckets, sparse)):
            if found is not None:
                scattered[k] = [self._with_occurrences(b, i, part, found)
                                for i, part in enumerate(scattered[k])]
        shard_grads = self._clip(distribution, communicator, optimizer, scattered,
                                 len(variables))
        updated = []
        for i, device in enumerate(self.devices):
            with tf.device(device):
                updated.append(self._update_replica(i, optimizer, shard_grads[i], variables))
        for k, b in enumerate(self.buckets):
            full = communicator.all_gather(
                distribution, per_replica([row[k] for row in updated], always_wrap=True))
            for position, m in enumerate(b.members):
                offset, size = b.offsets[position], b.sizes[position]
                target = getattr(variables[m], "value", variables[m])
                target.assign(tf.reshape(full[offset:offset + size], b.shapes[position]))

    def _flatten(self, b, grads):
        """One replica's gradients of bucket ``b`` as one flat dense tensor of static
        length (a sparse member's part is zeros), and the sparse members' occurrences
        (`tfdist.strategies.zero.sparse.occurrences`, concatenated) or None."""
        import tensorflow as tf

        pieces, indices, values = [], [], []
        for position, grad in enumerate(grads):
            size = b.sizes[position]
            if _sparse.is_sparse(grad):
                pieces.append(tf.zeros([size], b.dtype))
                found = _sparse.occurrences(grad, b.offsets[position], b.shapes[position],
                                            b.dtype)
                indices.append(found[0])
                values.append(found[1])
                continue
            # The variable's static size: the gradient's shape may be unknown in a traced
            # step (a Dense kernel's on a 3-D input is (None, units)).
            pieces.append(tf.reshape(tf.cast(tf.convert_to_tensor(grad), b.dtype), [size]))
        padding = b.slice_size * self.replicas - sum(b.sizes)
        if padding:
            pieces.append(tf.zeros([padding], b.dtype))
        flat = tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]
        if not indices:
            return flat, None
        return flat, (tf.concat(indices, 0), tf.concat(values, 0))

    def _with_occurrences(self, b, i, dense, found):
        """Local replica ``i``'s slice gradient of ``b`` with the occurrences in it."""
        import tensorflow as tf

        with tf.device(self.devices[i]):
            return _sparse.slice_gradient(dense, found[0], found[1],
                                          self.replica_ids[i] * b.slice_size, b.slice_size)

    def _update_replica(self, i, optimizer, grads, variables):
        """Local replica ``i``: its slices set from the weights, decayed, updated."""
        import tensorflow as tf

        inner, replica = self.optimizers[i], self.replica_ids[i]
        inner.iterations.assign(tf.cast(optimizer.iterations, inner.iterations.dtype))
        out = []
        for k, (b, var, grad) in enumerate(zip(self.buckets, self.slices[i], grads)):
            pieces, padding = b.pieces(replica)
            values = [tf.reshape(_read(variables[b.members[m]]), [-1])[start:stop]
                      for m, start, stop in pieces]
            if padding:
                values.append(tf.zeros([padding], b.dtype))
            var.assign(tf.concat(values, 0) if len(values) > 1 else values[0])
            lr = tf.cast(optimizer.learning_rate, b.dtype)
            mask = self._masks[i][k][0]
            if mask is not None:  # Keras' decay, before the update, on masked elements
                wd = tf.cast(optimizer.weight_decay, b.dtype)
                var.assign(var - var * wd * lr * mask)
            inner.update_step(grad, var, lr)
            out.append(tf.convert_to_tensor(var))
        return out

    def _clip(self, distribution, communicator, optimizer, scattered, num_vars):
        """Per local replica, its gradient slices clipped as the optimizer says."""
        import tensorflow as tf

        grads = [[scattered[k][i] for k in range(len(self.buckets))]
                 for i in range(len(self.devices))]
        if optimizer.clipvalue:  # a sparse gradient: each occurrence, as ops.clip
            v = optimizer.clipvalue
            return [[tf.clip_by_value(g, -v, v) for g in row] for row in grads]
        if not (optimizer.clipnorm or optimizer.global_clipnorm):
            return grads
        sums = []
        for i, device in enumerate(self.devices):
            with tf.device(device):
                sums.append(tf.add_n([
                    _sparse.squares_by_segment(g, self._masks[i][k][1], num_vars + 1)
                    for k, g in enumerate(grads[i])])[:num_vars])
        (total,) = communicator.all_reduce(distribution, [per_replica(sums, always_wrap=True)],
                                           [None], op="sum")
        squares = distribution.experimental_local_results(total)[0]
        out = []
        for i, device in enumerate(self.devices):
            with tf.device(device):
                if optimizer.global_clipnorm:
                    norm = tf.sqrt(tf.reduce_sum(squares))
                    clip = optimizer.global_clipnorm
                    scales = [clip * tf.minimum(1.0 / norm, 1.0 / clip)] * len(grads[i])
                    # As Keras' `IndexedSlices * scale`: a sparse gradient becomes dense.
                    grads[i] = [tf.convert_to_tensor(g) for g in grads[i]]
                else:
                    clip = optimizer.clipnorm
                    norms = tf.sqrt(squares)
                    per_var = tf.concat([clip / tf.maximum(norms, clip), [1.0]], 0)
                    scales = [tf.gather(per_var, self._masks[i][k][1])
                              for k in range(len(self.buckets))]
                out.append([_sparse.scale(g, s) for g, s in zip(grads[i], scales)])
        return out


def _read(variable):
    """A Keras (or TF) variable's current value as a tensor."""
    import tensorflow as tf

    return tf.convert_to_tensor(getattr(variable, "value", variable))
