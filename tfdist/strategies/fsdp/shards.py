"""Fully sharded parameters (ZeRO-3 / FSDP) for the synchronous strategies.

With ``shard_parameters=True`` every trainable floating Keras variable of at least
``min_shard_elements`` elements (or that ``shard_filter(path)`` names) made in the
strategy's scope is stored as 1/N per replica: its TF value is a mirrored variable of
``ceil(size / N)`` elements whose replica r holds elements ``[r*s, (r+1)*s)`` of the
flattened, zero-padded value (`Shard`). Keras' own optimizer then builds its slots from
it the same way (`tfdist._hooks.fsdp`), so the optimizer state is sharded like the
parameters and updated slice by slice (element-wise optimizers only).

When a layer reads the variable in a replica function, the slices are all-gathered
through the strategy's communicator into the whole value (`Shard.gather`); the gather's
gradient is a reduce-scatter, so each replica receives its slice's gradient summed over
every replica, and the strategy's gradient all-reduce leaves it out. Outside a replica
function (``get_weights``, saves, loads) the value is gathered or scattered whole: a
collective, so every worker takes part, as in sharded optimizer state.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tfdist.comm.communicator import gather_numpy, initial_value, per_replica, replica_ids
from tfdist.strategies.zero import sparse as _sparse
from tfdist.strategies.options.arguments import MIN_SHARD_ELEMENTS


@dataclasses.dataclass(eq=False)
class Shard:
    """How one variable is cut: ``size`` elements of ``shape`` in slices of ``slice_size``."""

    plan: "ParameterSharding"
    shape: tuple
    size: int
    slice_size: int

    def gather(self, value, after=None):
        """Replica context: the whole value of the mirrored slices ``value``
        (all-gathered; gradient reduce-scattered).

        ``after``: the reading layer's inputs. The gather then waits for them (a zero
        computed from the first floating one is added to the slice, a data dependency as
        TF's ``recompute_grad`` makes for XLA), so TF's executor does not run every
        layer's gather at the step's start: one layer's whole weights live at a time.
        (A control dependency on the slice's read instead changed the trained weights
        in tests/test_fsdp.py; why is not understood.)"""
        import tensorflow as tf

        local = tf.convert_to_tensor(value)  # this replica's slice (its read is watched)
        floats = [t for t in (after or ()) if tf.is_tensor(t) and t.dtype.is_floating]
        if floats:
            first = tf.reshape(floats[0], [-1])[:1]
            zero = tf.stop_gradient(tf.reduce_sum(tf.zeros_like(first)))
            local = local + tf.cast(zero, local.dtype)
        return self.plan.all_gather(local, self)

    def full_numpy(self, value):
        """Cross-replica: the whole value as a numpy array (a collective)."""
        return gather_numpy(self.plan.strategy, value)[:self.size].reshape(self.shape)

    def local_whole(self, value):
        """Cross-replica, in a graph: the whole value from this worker's slices (the
        other workers' slices read as zeros: a traced function outside a replica
        function cannot run the gather on every worker)."""
        import tensorflow as tf

        parts = [tf.convert_to_tensor(v) for v in value.values]
        ids = replica_ids(self.plan.strategy)
        flat = tf.concat(parts, 0)
        if len(ids) < self.plan.replicas:
            at = ids[0] * self.slice_size
            flat = tf.pad(flat, [[at, self.slice_size * self.plan.replicas - at
                                  - len(ids) * self.slice_size]])
        return tf.reshape(flat[:self.size], self.shape)

    def assign_full(self, target, value):
        """Cross-replica: each local replica of ``target`` takes its slice of ``value``."""
        flat = self.pad(np.asarray(value, dtype=np.dtype(target.dtype.name)))
        for component, replica in zip(target.values, replica_ids(self.plan.strategy)):
            component.assign(flat[replica * self.slice_size:(replica + 1) * self.slice_size])

    def pad_tensor(self, flat):
        import tensorflow as tf

        padding = self.slice_size * self.plan.replicas - self.size
        return tf.pad(flat, [[0, padding]]) if padding else flat  # no copy when even

    def pad(self, value):
        flat = np.reshape(value, [-1])
        return np.pad(flat, (0, self.slice_size * self.plan.replicas - self.size))


class ParameterSharding:
    """A strategy's ``parameter_sharding``: which variables are sharded, and how.

    Args:
        strategy: The strategy (its replicas and its ``communicator``).
        min_shard_elements: Variables with fewer elements stay whole.
        shard_filter: None, or ``f(path) -> True | False | None`` (None: the size rule).
        reshard_after_forward: Whether a layer's gathered values are dropped after its
            forward pass and gathered again for its backward pass.
    """

    def __init__(self, strategy, min_shard_elements=MIN_SHARD_ELEMENTS, shard_filter=None,
                 reshard_after_forward=True):
        self.strategy = strategy
        self.min_shard_elements = min_shard_elements
        self.shard_filter = shard_filter
        self.reshard_after_forward = reshard_after_forward

    @property
    def replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    def wants(self, variable, shape) -> bool:
        """Whether the Keras ``variable`` of ``shape`` being made is stored sharded."""
        import keras

        if not variable.trainable or not keras.backend.is_float_dtype(variable.dtype):
            return False
        shape = tuple(shape)
        if not shape or any(d is None for d in shape):
            return False
        decided = None if self.shard_filter is None else self.shard_filter(variable.path)
        if decided is not None:
            if not isinstance(decided, bool):
                raise ValueError("shard_filter must return True, False or None. Received: "
                                 f"{decided!r} for path={variable.path!r}")
            return decided
        return math.prod(shape) >= self.min_shard_elements

    def create(self, shape, value, arguments, fill=None):
        """The mirrored slice variable of a Keras variable of ``shape`` whose initial
        value is ``value`` (a tensor or a function returning one); ``arguments``: its
        ``tf.Variable`` keyword arguments (dtype, trainable, name, aggregation,
        synchronization). The whole initial value is made once, then cut (in a
        multi-worker job, the chief's is broadcast first), unless ``fill`` (a constant
        initializer's value: optimizer slots, biases) is given: then only the slices.

        Returns:
            ``(the mirrored slice variable, its Shard)``.
        """
        import tensorflow as tf

        size = math.prod(shape)
        shard = Shard(self, tuple(shape), size, max(1, math.ceil(size / self.replicas)))
        if fill is not None:
            return self._filled(shard, fill, arguments), shard
        with tf.init_scope():
            full = initial_value(self.strategy, value, arguments["dtype"])
            flat = np.reshape(full.numpy(), [-1])
            del full

            def piece(replica):  # a copy of one slice (the whole is never padded)
                part = flat[replica * shard.slice_size:(replica + 1) * shard.slice_size]
                return np.pad(part, (0, shard.slice_size - part.size))

            created = tf.Variable(piece(0), **arguments)
            for component, replica in zip(created.values, replica_ids(self.strategy)):
                component.assign(piece(replica))
            del flat
        return created, shard

    def _filled(self, shard, fill, arguments):
        """The slice variable of a constant ``fill`` (padding 0), never whole."""
        import tensorflow as tf

        dtype = np.dtype(tf.as_dtype(arguments["dtype"]).as_numpy_dtype)

        def piece(replica):
            at = np.arange(replica * shard.slice_size, (replica + 1) * shard.slice_size)
            return np.where(at < shard.size, fill, 0).astype(dtype)

        with tf.init_scope():
            created = tf.Variable(piece(0), **arguments)
            for component, replica in zip(created.values, replica_ids(self.strategy)):
                component.assign(piece(replica))
        return created

    def all_gather(self, local, shard):
        """Replica context: every replica's slice of ``shard``'s variable, concatenated
        and shaped; the gradient is reduce-scattered (summed over replicas, each keeps
        its slice). A sparse gradient (an embedding lookup) keeps Keras' semantics, as
        in `tfdist.strategies.zero.sharded_state`: each replica receives every occurrence falling in
        its slice, as a 1-D ``tf.IndexedSlices``."""
        import tensorflow as tf

        communicator = self.strategy.communicator

        @tf.custom_gradient
        def gather(part):
            context = tf.distribute.get_replica_context()
            full = context.merge_call(
                lambda distribution, x: communicator.all_gather(distribution, x),
                args=(part,))

            def grad(upstream):
                context = tf.distribute.get_replica_context()
                if isinstance(upstream, tf.IndexedSlices):
                    return context.merge_call(self._scatter_sparse, args=(upstream, shard))
                flat = shard.pad_tensor(tf.reshape(tf.convert_to_tensor(upstream), [-1]))
                return context.merge_call(
                    lambda distribution, g: communicator.reduce_scatter(
                        distribution, [g], op="sum")[0], args=(flat,))

            return tf.reshape(full[:shard.size], shard.shape), grad

        return gather(local)

    def _scatter_sparse(self, distribution, grads, shard):
        """Cross-replica: per local replica, the occurrences in its slice."""
        import tensorflow as tf

        local = distribution.experimental_local_results(grads)
        dtype = local[0].values.dtype
        pairs = [_sparse.occurrences(g, 0, shard.shape, dtype) for g in local]
        indices, values = _sparse.gather_occurrences(distribution, self.strategy.communicator,
                                                     pairs)
        parts = []
        for device, replica in zip(distribution.extended.worker_devices,
                                   replica_ids(distribution)):
            with tf.device(device):
                parts.append(_sparse.slice_gradient(
                    tf.zeros([shard.slice_size], dtype), indices, values,
                    replica * shard.slice_size, shard.slice_size))
        return per_replica(parts, always_wrap=True)


def clip_sharded(distribution, communicator, optimizer, grads, sharded, copies=1):
    """Replica context: ``grads`` clipped as ``optimizer``'s ``clipnorm`` or
    ``global_clipnorm`` say, over whole variables (a sharded gradient's squares are
    summed over the replicas: one all-reduce of one value per sharded variable).

    Keras clips again afterwards; on clipped gradients that is a no-op (every local
    norm is then at most the clip).

    An ``IndexedSlices``' values are squared as they are, duplicate ids included: Keras
    does so on one device (``ops.square`` squares each occurrence before the duplicates
    are summed), so the norm is not the dense gradient's, on purpose.

    Args:
        grads: Per variable: its gradient (reduced, or this replica's slice of it).
        sharded: Per variable: whether its gradient is a slice.
        copies: How many replicas hold each slice (the d of a d x m tensor-parallel
            mesh, whose batch axis has summed them): its squares are counted once. An
            int, or one per variable.
    """
    import tensorflow as tf

    def squares(g):
        g = g.values if isinstance(g, tf.IndexedSlices) else g
        return tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))

    positions = [i for i, g in enumerate(grads) if g is not None]
    local = [squares(grads[i]) for i in positions]
    cut = [i for i, p in enumerate(positions) if sharded[p]]
    if cut:
        total = tf.distribute.get_replica_context().merge_call(
            lambda d, v: communicator.all_reduce(d, [v], [None], op="sum")[0],
            args=(tf.stack([local[i] for i in cut]),))
        counts = [copies[positions[i]] for i in cut] if isinstance(copies, (list, tuple)) \
            else [copies] * len(cut)
        if any(c > 1 for c in counts):
            total = total / tf.constant(counts, total.dtype)
        for k, i in enumerate(cut):
            local[i] = total[k]
    out = list(grads)
    if optimizer.global_clipnorm:
        clip = optimizer.global_clipnorm
        norm = tf.sqrt(tf.add_n(local))
        factors = [clip * tf.minimum(1.0 / norm, 1.0 / clip)] * len(positions)
    else:
        clip = optimizer.clipnorm
        factors = [clip / tf.maximum(tf.sqrt(sq), clip) for sq in local]
    for p, factor in zip(positions, factors):
        out[p] = _sparse.scale(grads[p], tf.cast(factor, grads[p].dtype))
    return out


def sharded_elements(model) -> list[int]:
    """Per local replica: the elements of the sharded variables (model and optimizer)
    it holds."""
    from tfdist._hooks.fsdp import shard_of, tf_value

    variables = list(model.weights)
    if getattr(model, "optimizer", None) is not None:
        variables += list(model.optimizer.variables)
    counts = None
    for variable in variables:
        if shard_of(variable) is None:
            continue
        sizes = [math.prod(v.shape) for v in tf_value(variable).values]
        counts = sizes if counts is None else [a + b for a, b in zip(counts, sizes)]
    return counts or []
