"""Optimizer wrappers, unwrapped the same way by every strategy and the PS step driver."""

from __future__ import annotations


def inner_optimizer(optimizer):
    """The optimizer that updates the weights, under any wrappers.

    ``keras.optimizers.LossScaleOptimizer`` (which ``compile`` adds under a
    ``mixed_float16`` policy) wraps another optimizer in ``inner_optimizer``; the
    inner one runs the per-variable updates, owns the slots and counts
    ``iterations``. Anything else is returned as it is (None included).
    """
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def sharded_wrapper(optimizer):
    """The sharded optimizer wrapper (`tfdist.keras.ShardedOptimizer`, the one with
    ``sharded_update``) at or inside ``optimizer``, or None."""
    while optimizer is not None and not hasattr(optimizer, "sharded_update"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer
