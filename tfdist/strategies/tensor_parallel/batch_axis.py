"""A split variable also sharded over the "batch" axis: a kernel laid out
``("batch", "model")`` or ``("model", "batch")`` on a ``(d, m)`` data x model mesh,
d > 1 (`tfdist.strategies.tensor_parallel.splits`), as Keras' ``ModelParallel`` lays it out on
JAX: tensor parallelism over "model", fully sharded parameters (issue #33) over "batch".

Replica r (data index ``r // m``, model index ``r % m``) stores block ``r // m`` (of d,
on the axis laid out "batch") of its model slice ``r % m``: 1/(d*m) of the variable.
A variable laid out over "batch" alone (``("batch", None)``, ``Split.axis`` None) is
its own slice: 1/d of it, the same block on the m replicas of a model group.
When its layer runs, the slice is all-gathered within the replica's batch group (the d
replicas of its model index, `tfdist.comm.groups`); the gather's gradient is
reduce-scattered there, so each replica receives its block's gradient summed over the
batch axis (the strategy does not reduce it again). A variable over "batch" alone is
read by a data-parallel layer (each replica's own rows), so its block's gradient is
then also all-reduced within the model group (m > 1). All go through the strategy's
accounted communicator (``bytes_communicated``).
"""

from __future__ import annotations

import numpy as np

from tfdist.strategies.tensor_parallel.ops import merge, move_from_front, move_to_front


def check_alone(path, shape, axes, d) -> None:
    """Raises unless a trainable variable laid out over "batch" alone can be stored 1/d."""
    at = axes.index("batch")
    if len(axes) != len(shape) or axes.count("batch") > 1 or any(
            a not in (None, "batch") for a in axes) or shape[at] % d:
        raise ValueError(
            f"Variable {path!r} of shape {list(shape)} cannot be sharded on axis {at} "
            f"over the {d} replicas of the 'batch' axis (its layout must name 'batch' "
            f"once, on an axis that is a multiple of {d}, with one entry per axis). "
            f"Received: layout={axes}")


def block(whole, split, replica: int):
    """Replica ``replica``'s stored block of the whole numpy value ``whole``."""
    m = split.plan.replicas
    part = whole if split.axis is None else np.split(whole, m, axis=split.axis)[replica % m]
    if split.batch_axis is None:
        return part
    return np.split(part, split.batches, axis=split.batch_axis)[replica // m]


def assemble(blocks, split):
    """The whole numpy value from every replica's block (in replica order)."""
    m = split.plan.replicas
    slices = [np.concatenate([blocks[i * m + j] for i in range(split.batches)],
                             axis=split.batch_axis) for j in range(m)]
    return slices[0] if split.axis is None else np.concatenate(slices, axis=split.axis)


def full_numpy(split, value):
    """Cross-replica: the whole value of the mirrored blocks ``value`` (with several
    workers an all-gather of every replica's block, so every worker must call it)."""
    strategy = split.plan.strategy
    if getattr(strategy, "num_workers", 1) == 1:
        return assemble([np.asarray(v) for v in value.values], split)
    from tfdist.comm.communicator import gather_numpy

    blocks = np.split(gather_numpy(strategy, value), strategy.num_replicas_in_sync)
    return assemble(blocks, split)


def gather(split, local):
    """Replica context: this replica's model slice from the blocks of its batch group
    (all-gathered on the "batch" axis; gradient: reduce-scattered, each replica keeping
    its block summed over the group)."""
    import tensorflow as tf

    plan, axis = split.plan, split.batch_axis
    communicator, groups = plan.strategy.communicator, plan.batch_groups
    rows = split.axis is None and plan.model_groups.size > 1  # a data-parallel reader

    @tf.custom_gradient
    def op(x):
        front = move_to_front(x, axis)  # static: the stored block's shape
        whole = merge(lambda d, v: communicator.in_group(groups, "all_gather", d, v), front)
        whole = tf.ensure_shape(whole, [front.shape[0] * split.batches, *front.shape[1:]])

        def grad(dy):
            flat = tf.reshape(move_to_front(tf.convert_to_tensor(dy), axis), [-1])
            mine = merge(lambda d, v: communicator.in_group(groups, "reduce_scatter", d, v,
                                                             "sum"), flat)
            if rows:  # the other rows of the mesh: the model group's replicas'
                mine = merge(lambda d, v: communicator.in_group(
                    plan.model_groups, "all_reduce", d, v, "sum"), mine)
            return move_from_front(tf.reshape(mine, front.shape), axis)

        return move_from_front(whole, axis), grad

    return op(local)
