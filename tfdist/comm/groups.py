"""Collectives within groups of replicas: one axis of a data x model mesh.

The n replicas of a job (``replica_id_in_sync_group``, rank-major) form a ``(d, m)``
mesh as Keras' ``DeviceMesh((d, m), ["batch", "model"])`` lays out its devices: replica r
has data index ``r // m`` and model index ``r % m``. A `ReplicaGroups` is one axis:
``"model"`` (the m replicas of one data index, consecutive) or ``"batch"`` (the d
replicas of one model index, every m-th). Its collectives run within each group only
(true subgroup collectives: a group of m sends what m replicas send), through TF's
public collective V2 ops (``tf.raw_ops.CollectiveGatherV2``, ``CollectiveReduceV2``
and ``CollectiveAllToAllV2``), on one host and across workers alike.

Keys: each `ReplicaGroups` takes its own block of group keys from ``GROUP_KEY_START``
up, far above the strategies' (``tfdist._hooks.tf.assign_collective_key_base``: a base
of k * 10,000 plus a few), and every collective a fresh instance key from
``INSTANCE_KEY_START`` up, far above the strategies' own, each time its step runs
(``tfdist._hooks.tf.call_time_value``, as TF's own collectives: TF caches an
instance's shape, and a partial last batch has other shapes). Both counters are per
process and advance in the order the collectives are traced and run, which is the
same on every worker (the same program), as TF's own keys do.

TF has no ring reduce-scatter on CPU (its ``CollectiveReduceScatterV2`` is NCCL only):
`reduce_scatter` is an all-to-all of the blocks (``CollectiveAllToAllV2``, which TF runs
on CPU and GPU), then each replica sums the blocks it received: each block crosses the
wire once, half what an all-reduce sends.
"""

from __future__ import annotations

import itertools

GROUP_KEY_START = 1 << 30
INSTANCE_KEY_START = 1 << 30
_KEYS_PER_AXIS = 1 << 16  # groups an axis may have
_axes = itertools.count(0)
_instances = itertools.count(INSTANCE_KEY_START)

AXES = ("batch", "model")


def axis_members(replicas: int, model_parallel: int, axis: str, group: int) -> list[int]:
    """The replicas of group ``group`` of ``axis`` (`ReplicaGroups`), in position order."""
    m = model_parallel
    if axis == "model":
        return list(range(group * m, (group + 1) * m))
    return list(range(group, replicas, m))


def is_mesh(replicas: int, model_parallel: int) -> bool:
    """Whether a "model" axis of size m forms a data x model mesh of the n ``replicas``
    (m < n), the one rule the strategies and the engines follow.

    Raises:
        ValueError: m does not divide n.
    """
    if replicas % model_parallel:
        raise ValueError(f"model_parallel must divide the {replicas} replicas in sync (a "
                         f"{replicas} // m x m mesh). Received: model_parallel={model_parallel}")
    return model_parallel < replicas


def mesh_groups(replicas: int, model_parallel: int) -> list[list[int]]:
    """Every group of both axes of the ``(replicas // m, m)`` mesh: the d "model" groups,
    then the m "batch" groups; none when m = n (`is_mesh`, which refuses an m that does
    not divide n)."""
    m = model_parallel
    if not is_mesh(replicas, m):
        return []
    return ([axis_members(replicas, m, "model", g) for g in range(replicas // m)]
            + [axis_members(replicas, m, "batch", g) for g in range(m)])


class ReplicaGroups:
    """One axis of the ``(replicas // model_parallel, model_parallel)`` mesh.

    Args:
        replicas: Replicas in sync (n).
        model_parallel: The size of the model axis (m; it divides n).
        axis: ``"model"`` (groups of m consecutive replicas) or ``"batch"`` (groups of
            n / m replicas, every m-th).
        devices: This worker's replica devices (``extended.worker_devices``).
        timeout_seconds: How long a collective waits for its group (0: forever).
    """

    def __init__(self, replicas: int, model_parallel: int, axis: str, devices,
                 timeout_seconds: float | None = None):
        if axis not in AXES:
            raise ValueError(f"axis must be one of {list(AXES)}. Received: axis={axis!r}")
        self.replicas, self.model_parallel, self.axis = replicas, model_parallel, axis
        self.size = model_parallel if axis == "model" else replicas // model_parallel
        self.timeout_seconds = float(timeout_seconds or 0)
        self.key_base = GROUP_KEY_START + next(_axes) * _KEYS_PER_AXIS
        import tensorflow as tf

        # One ordering token per device, as TF's own collectives have: a tf.function
        # chains stateful ops without a resource in program order, which would make
        # device 0's collective wait for device 1's before device 1 may start it.
        self.tokens = {}
        for device in devices:
            with tf.init_scope(), tf.device(device):
                self.tokens[device] = tf.Variable(0.0, trainable=False,
                                                  name="tfdist_group_order")

    def group_of(self, replica: int) -> int:
        """The index of ``replica``'s group on this axis."""
        m = self.model_parallel
        return replica // m if self.axis == "model" else replica % m

    def members(self, replica: int) -> list[int]:
        """The replicas of ``replica``'s group on this axis, in position order."""
        return axis_members(self.replicas, self.model_parallel, self.axis,
                            self.group_of(replica))

    def position(self, replica: int) -> int:
        """``replica``'s position in its group (TF ranks a group's devices in the
        rank-major replica order)."""
        m = self.model_parallel
        return replica % m if self.axis == "model" else replica // m

    def _run(self, distribution, value, make):
        """``make(part, group_key, instance_key, ordering token)`` on each local
        replica's device."""
        import tensorflow as tf

        from tfdist._hooks.tf import call_time_value
        from tfdist.comm.communicator import per_replica, replica_ids

        # A fresh key on every call of the step (a partial last batch changes shapes).
        with tf.device("CPU:0"):
            instance_key = call_time_value(lambda: next(_instances), tf.int32)
        devices = distribution.extended.worker_devices
        out = []
        for part, device, replica in zip(distribution.experimental_local_results(value),
                                         devices, replica_ids(distribution)):
            with tf.device(device):
                out.append(make(tf.convert_to_tensor(part),
                                self.key_base + self.group_of(replica), instance_key,
                                [self.tokens[device].handle]))
        return per_replica(out)

    def all_gather(self, distribution, value):
        """Each group's values concatenated on axis 0 in group order (cross-replica
        context); a per-replica value (each replica its group's)."""
        import tensorflow as tf

        def gather(part, group_key, instance_key, token):
            # CollectiveGatherV2 takes no bfloat16 (mixed_bfloat16 activations): it
            # gathers them as float32, which holds every bfloat16 value exactly.
            gathered = tf.raw_ops.CollectiveGatherV2(
                input=tf.cast(part, tf.float32) if part.dtype == tf.bfloat16 else part,
                group_size=self.size, group_key=group_key, instance_key=instance_key,
                ordering_token=token, timeout_seconds=self.timeout_seconds)
            # TF's shape function forgets every dimension: the group's parts share
            # this one's shape, so only axis 0 grows (consumers needing every feature,
            # such as LayerNormalization, need them static).
            if part.shape.rank is not None:
                rows = part.shape[0]
                gathered.set_shape([None if rows is None else rows * self.size,
                                    *part.shape[1:]])
            return tf.cast(gathered, part.dtype)

        return self._run(distribution, value, gather)

    def all_reduce(self, distribution, value, op: str = "sum"):
        """Each group's values summed (or averaged, ``op="mean"``); per-replica."""
        import tensorflow as tf

        def reduce(part, group_key, instance_key, token):
            return tf.raw_ops.CollectiveReduceV2(
                input=part, group_size=self.size, group_key=group_key,
                instance_key=instance_key, ordering_token=token, merge_op="Add",
                final_op="Div" if op == "mean" else "Id",
                timeout_seconds=self.timeout_seconds)

        return self._run(distribution, value, reduce)

    def reduce_scatter(self, distribution, value, op: str = "sum"):
        """A flat value summed over each group; each replica keeps its block
        (position p of g: elements ``[p*len/g, (p+1)*len/g)``; len a multiple of g);
        per-replica. An all-to-all of the g blocks, then a local sum of those received."""
        import tensorflow as tf

        def scatter(part, group_key, instance_key, token):
            blocks = tf.raw_ops.CollectiveAllToAllV2(
                input=tf.reshape(part, [self.size, -1]), group_size=self.size,
                group_key=group_key, instance_key=instance_key, ordering_token=token,
                timeout_seconds=self.timeout_seconds)
            total = tf.reduce_sum(blocks, axis=0)
            if op == "mean":
                return tf.raw_ops.Div(x=total, y=tf.cast(self.size, total.dtype))
            return total

        return self._run(distribution, value, scatter)
