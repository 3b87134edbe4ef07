"""Model averaging's per-optimizer state, its argument checks and variable helpers.

Used by `tfdist.ModelAverageStrategy` (tfdist/strategies/model_average.py): the state it
keeps for each trained optimizer (anchors, slots, outer optimizers, fragments), the
check of ``fragments``, and how it reads, scales and recognises per-replica variables.
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfdist.checks import check_int


class State:
    """Per-optimizer averaging state, made on the first traced step."""

    def __init__(self, optimizer, variables, anchors, slots, outers, fragments,
                 residuals=None):
        self.optimizer = optimizer
        self.variables = variables    # the trainable keras Variables the optimizer updates
        self.anchors = anchors        # keras Variables: the weights at the last average
        self.slots = slots            # the optimizer's per-variable state (momentum, ...)
        self.outers = outers          # one outer optimizer (a copy) per fragment, or []
        self.outer = outers[0] if outers else None
        self.fragments = fragments    # variable indices of each fragment, in order
        self.residuals = residuals    # error feedback of outer_compression (per replica), or None
        self.averaged_at = 0          # optimizer step of the last forced average
        self.full_at = 0              # ... of the last full one (slots too, exact)
        self.force_fns = {}           # forced-average tf.functions by variable set


def make_residuals(variables):
    """Zero error-feedback residuals (float32, local to each replica), one per variable.

    Call in the strategy's scope, outside any traced function."""
    import keras

    return [keras.Variable(tf.zeros(v.shape, tf.float32), trainable=False,
                           dtype="float32", name=f"tfdist_residual_{i}")
            for i, v in enumerate(variables)]


def wants_multi_worker(cluster_resolver) -> bool:
    """Whether the replicas span several workers (a resolver, or TF_CONFIG with many)."""
    if cluster_resolver is not None:
        return True
    if not os.environ.get("TF_CONFIG"):
        return False
    from tfdist.cluster import resolve_cluster

    return resolve_cluster(None).num_workers > 1


def check_fragments(period: int, fragments, average_optimizer_state) -> int:
    """``fragments`` checked against ``period`` (see `ModelAverageStrategy`)."""
    fragments = check_int("fragments", fragments, 1)
    if period % fragments:
        raise ValueError("period must be a multiple of fragments: fragment f averages "
                         "f * period / fragments steps into each period. Received: "
                         f"period={period}, fragments={fragments}")
    if fragments > 1 and average_optimizer_state:
        raise ValueError("average_optimizer_state needs fragments=1 (the slots are not "
                         f"split into fragments). Received: fragments={fragments}")
    return fragments


def tf_variable(variable):
    """The TF variable behind a Keras variable (or ``variable`` itself)."""
    return variable.value if hasattr(variable, "path") and hasattr(variable, "value") \
        else variable


def is_replicated_float(variable) -> bool:
    """A floating variable whose per-replica copies may differ (mirrored, on write)."""
    v = tf_variable(variable)
    return (isinstance(v, tf.distribute.DistributedValues) and v.dtype.is_floating
            and v.synchronization != tf.VariableSynchronization.ON_READ)


def scale(grad, factor):
    """``grad * factor`` (dense or IndexedSlices; None stays None)."""
    if grad is None or factor == 1:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)
