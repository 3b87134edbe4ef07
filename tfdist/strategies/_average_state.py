"""Model averaging's per-optimizer state and variable helpers.

Used by `tfdist.ModelAverageStrategy` (tfdist/strategies/model_average.py): the state it
keeps for each trained optimizer (anchors, slots, outer optimizers, fragments and their
pieces), and how it reads, scales and recognises
per-replica variables and reads or writes a piece (rows of a variable) of them.
"""

from __future__ import annotations

import os

import tensorflow as tf



class State:
    """Per-optimizer averaging state, made on the first traced step."""

    def __init__(self, optimizer, variables, pieces, anchors, slots, outers, fragments,
                 residuals=None):
        self.optimizer = optimizer
        self.variables = variables    # the trainable keras Variables the optimizer updates
        self.pieces = pieces          # `tfdist.comm.fragments.Piece`s, in fragment order
        self.anchors = anchors        # keras Variables: each piece at the last average
        self.slots = slots            # the optimizer's per-variable state (momentum, ...)
        self.outers = outers          # one outer optimizer (a copy) per fragment, or []
        self.outer = outers[0] if outers else None
        self.fragments = fragments    # piece indices of each fragment, in order
        self.residuals = residuals    # error feedback of outer_compression (per piece), or None
        self.averaged_at = 0          # optimizer step of the last forced average
        self.full_at = 0              # ... of the last full one (slots too, exact)
        self.force_fns = {}           # forced-average tf.functions by variable set


def make_residuals(variables):
    """Zero error-feedback residuals (float32, local to each replica), one per variable
    (per piece's anchor).

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


def piece_of(value, piece):
    """``value`` (a variable's tensor or per-device variable) restricted to ``piece``:
    itself for a whole piece, else its rows ``piece.start:piece.stop``."""
    return value if piece.whole else value[piece.start:piece.stop]


def piece_value(variable, piece):
    """In replica context: this replica's value of ``piece`` of the Keras ``variable``
    (the variable itself for a whole piece, as the un-cut code path always read it)."""
    value = tf_variable(variable)
    return value if piece.whole else tf.convert_to_tensor(value)[piece.start:piece.stop]


def assign_piece(variable, piece, value):
    """Assigns ``value`` to ``piece`` of a per-device ``variable`` (sliced for a cut)."""
    if piece.whole:
        return variable.assign(value)
    return variable[piece.start:piece.stop].assign(value)


def agreed_variables(state, piece_indices) -> list:
    """The variables every row of which is in the pieces at ``piece_indices`` (those an
    exchange of those pieces leaves equal on every worker), in order."""
    chosen = set(piece_indices)
    partial = {p.variable for j, p in enumerate(state.pieces) if j not in chosen}
    touched = sorted({state.pieces[j].variable for j in chosen} - partial)
    return [state.variables[i] for i in touched]
