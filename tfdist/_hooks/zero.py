"""Hooks for sharded optimizer state (`tfdist.strategies.zero.sharded_state`): plain per-replica
variables, Keras' weight-decay rule, and TF's collective reduce-scatter and all-to-all.

``tests/test_hooks_zero.py`` fails loudly when a TF or Keras upgrade removes what they touch.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def plain_variables():
    """Inside, variables are plain (one device, no strategy) even under a strategy.

    Also what `tfdist.comm.accounting.ByteCounter` is made in: a strategy's counters
    are its own, whichever strategy's scope it is created in.

    Why: each replica's optimizer slice and its slots belong to that replica alone;
    the strategy's variable creator would mirror them (full copies everywhere, and
    assignments broadcast). TF has no public way to leave a strategy's scope from
    inside it: the scope lives in the graph's private ``_distribution_strategy_stack``
    and ``_variable_creator_stack``, emptied here for the eager context and restored.
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops

    with tf.init_scope():
        graph = ops.get_default_graph()
        strategies, creators = (graph._distribution_strategy_stack,
                                graph._variable_creator_stack)
        graph._distribution_strategy_stack = []
        graph._variable_creator_stack = []
        try:
            yield
        finally:
            graph._distribution_strategy_stack = strategies
            graph._variable_creator_stack = creators


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether Keras applies ``optimizer``'s weight decay to ``variable``.

    Why: ``exclude_from_weight_decay`` is kept in private fields read by the private
    ``_use_weight_decay``; a sharded step decays a flat slice of many variables and
    needs the rule per variable to build its mask.
    """
    return optimizer._use_weight_decay(variable)


def backend_update_step_overridden(optimizer) -> bool:
    """Whether the optimizer class does work outside ``update_step`` (Nadam)."""
    from tfdist._hooks.keras_optimizer import overrides_backend_update_step

    return overrides_backend_update_step(optimizer)


def _single_launcher(distribution, tensor):
    """The strategy's one collective launcher (private: ``CollectiveAllReduce._launchers``),
    or None when it does not reduce with TF's collectives or has several local replicas."""
    from tensorflow.python.distribute import cross_device_ops

    ops = distribution.extended._get_cross_device_ops(tensor)
    if not isinstance(ops, cross_device_ops.CollectiveAllReduce) or len(ops._launchers) != 1:
        return None
    return ops._launchers[0]


def _keys(launcher):
    """The launcher's group, a fresh instance key and its ordering token, as TF issues
    its own collectives (so ours are ordered with theirs and never collide)."""
    token = launcher._get_ordering_token()
    return dict(group_size=launcher._group_size, group_key=launcher._group_key,
                instance_key=launcher._next_instance_key(),
                ordering_token=[token] if token is not None else [],
                timeout_seconds=launcher._options.timeout_seconds or 0)


def collective_reduce_scatter(distribution, tensor):
    """``tensor`` summed over every worker; this worker's 1/W of it (TF's collective).

    Why: TF's multi-worker cross-device ops (``CollectiveAllReduce``) have all-reduce
    and all-gather but no reduce-scatter, although TF has the collective op
    (``CollectiveReduceScatterV2``). It is issued here with the strategy's own group,
    instance keys and ordering token (private members of its replica launcher), so it
    is ordered with, and never collides with, the strategy's other collectives. One
    local replica per worker only (the group is the replicas). TF implements it with
    NCCL only (``collective_param_resolver_local.cc`` names no CPU implementation: on
    CPU it fails with "CollectiveRegistry::Lookup did not find collective
    implementation"), so CPU workers get None (see `collective_all_to_all`).

    Returns:
        The slice, or None when the strategy does not reduce with TF's collectives, has
        several local replicas, or runs on CPU.
    """
    import tensorflow as tf
    from tensorflow.python.ops import gen_collective_ops

    launcher = _single_launcher(distribution, tensor)
    if launcher is None or "GPU" not in launcher._device.upper():
        return None
    with tf.device(launcher._device):
        return gen_collective_ops.collective_reduce_scatter_v2(
            tensor, merge_op="Add", final_op="Id",
            communication_hint=launcher._options.implementation.value, **_keys(launcher))


def collective_all_to_all(distribution, tensor):
    """Flat ``tensor`` cut into W blocks, block w sent to worker w: this worker's
    ``(W, len/W)`` blocks, row v from worker v (TF's ``CollectiveAllToAllV2``).

    Why: as `collective_reduce_scatter` (the strategy's group, keys and ordering token
    are private members of its replica launcher); TF runs all-to-all on CPU too (its
    ``AllToAll`` collective, ``core/common_runtime/all_to_all.cc``), so summing the rows
    is a reduce-scatter that sends each block once. One local replica per worker only.

    Returns:
        The blocks, or None when the strategy does not reduce with TF's collectives or
        has several local replicas.
    """
    import tensorflow as tf

    launcher = _single_launcher(distribution, tensor)
    if launcher is None:
        return None
    with tf.device(launcher._device):
        return tf.raw_ops.CollectiveAllToAllV2(
            input=tf.reshape(tensor, [launcher._group_size, -1]), **_keys(launcher))
