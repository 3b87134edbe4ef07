"""Model averaging's stages, used by every path of the runner
(`tfdist.strategies.averaging.runner`): each replica's outer gradient ``anchor - w``,
the exchange of a fragment (its mean over every replica steps the fragment's anchors,
with the outer optimizer or as a plain mean), the apply (``w = mix * anchor + (1 - mix)
* w``) and the forced average of every per-replica variable.

Functions take an `tfdist.comm.averaging.PeriodicAverager` (the wire) and an
`tfdist.strategies.averaging.fragment.AveragingState`; none reads a private attribute.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist._hooks import keras_optimizer
from tfdist.strategies.averaging import outer as outer_step
from tfdist.strategies.averaging.fragment import (assign_piece, is_replicated_float,
                                                  piece_of, piece_value, tf_variable)


def optimizer_slots(optimizer) -> list:
    """The optimizer's per-replica floats (momentum, moments), not its step or rate."""
    skip = {id(optimizer.iterations)}
    learning_rate = keras_optimizer.learning_rate_variable(optimizer)
    if learning_rate is not None:
        skip.add(id(learning_rate))
    return [v for v in optimizer.variables if id(v) not in skip and is_replicated_float(v)]


def scale(grad, factor):
    """``grad * factor`` (dense or IndexedSlices; None stays None)."""
    if grad is None or factor == 1:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def local_deltas(state) -> list:
    """In replica context: ``anchor - w`` for this replica, one per piece (``w`` the
    piece's rows of the variable)."""
    return [tf_variable(anchor) - piece_value(state.variables[piece.variable], piece)
            for piece, anchor in zip(state.pieces, state.anchors)]


def exchange(averager, distribution, state, deltas, plain, plain_tf, fragment,
             outer=True, flush=False) -> list:
    """Cross-replica: the mean of ``deltas`` (one per piece of ``fragment``, a
    `Fragment` or None for every piece) steps those anchors (outer step or plain mean);
    returns the means of ``plain`` (to ``plain_tf``).

    ``flush`` (with ``outer_compression``): ``delta + residual`` goes exactly and the
    residuals become zero; else the deltas go compressed, with error feedback."""
    fragments = state.fragments if fragment is None else [fragment]
    anchors = [tf_variable(a) for f in fragments for a in f.anchors]
    residuals = None if fragments[0].residuals is None else [
        tf_variable(r) for f in fragments for r in f.residuals]
    mean_deltas, mean_plain = averager.average(
        distribution, list(deltas), anchors, plain, plain_tf, residuals=residuals,
        flush=flush)
    if outer and fragment is not None and fragment.outer is not None:
        outer_step.apply_outer_step(distribution, fragment.outer, anchors, mean_deltas)
    else:
        for anchor, delta in zip(anchors, mean_deltas):
            distribution.extended.update(
                anchor, lambda a, d: a.assign_sub(tf.cast(d, a.dtype)), args=(delta,),
                group=False)
    return mean_plain


def blend(variable, new, mix, piece=None):
    """Sets ``variable`` (or its ``piece``) to ``mix * new + (1 - mix) * itself``."""
    new = tf.cast(new, variable.dtype)
    if piece is not None and not piece.whole:
        if mix != 1:
            new = (tf.cast(mix, variable.dtype) * new
                   + tf.cast(1 - mix, variable.dtype) * piece_of(variable, piece))
        return assign_piece(variable, piece, new)
    if mix == 1:
        return variable.assign(new)
    return variable.assign(tf.cast(mix, variable.dtype) * new
                           + tf.cast(1 - mix, variable.dtype) * variable)


def apply(extended, state, fragment, plain_vars, plain_means, mix=1.0) -> None:
    """Cross-replica: each replica's pieces of ``fragment`` (None: every piece) take
    their anchors, and ``plain_vars`` their means, blended by ``mix``."""
    for f in state.fragments if fragment is None else [fragment]:
        for piece, anchor in zip(f.pieces, f.anchors):
            extended.update(tf_variable(state.variables[piece.variable]),
                            lambda v, a, piece=piece: blend(v, a, mix, piece),
                            args=(tf_variable(anchor),), group=False)
    for variable, mean in zip(plain_vars, plain_means):
        extended.update(tf_variable(variable), lambda v, m: blend(v, m, mix),
                        args=(mean,), group=False)


def average_now(averager, distribution, state, deltas, plain_vars, plain, outer,
                fragment=None, flush=False, mix=1.0) -> None:
    """Cross-replica: exchange ``fragment`` (None: every piece), then apply it."""
    plain_tf = [tf_variable(v) for v in plain_vars]
    means = exchange(averager, distribution, state, deltas, plain, plain_tf, fragment,
                     outer, flush)
    apply(distribution.extended, state, fragment, plain_vars, means, mix)


def make_force_fn(strategy, state, plain_vars, flush):
    """A tf.function that averages the anchored weights and ``plain_vars`` (no outer
    step); ``flush`` as in `exchange`."""

    def merge_force(distribution, deltas, plain):
        average_now(strategy.averager, distribution, state, deltas, plain_vars, plain,
                    outer=False, flush=flush)

    def replica_fn():
        plain = [tf.identity(tf_variable(v)) for v in plain_vars]
        tf.distribute.get_replica_context().merge_call(
            merge_force, args=(local_deltas(state), plain))

    @tf.function
    def force():
        strategy.run(replica_fn)

    return force


def force_average(strategy, model, state, full) -> None:
    """Averages the per-replica floats of ``model`` (the anchored weights as deltas, the
    rest as plain means) and, if ``full``, of the optimizer, exactly (flushing any
    error-feedback residuals); a tf.function is made once per variable set."""
    anchored = {id(v) for v in state.variables}
    slots = optimizer_slots(state.optimizer) if full else []
    plain = [v for v in list(model.weights) + slots
             if id(v) not in anchored and is_replicated_float(v)]
    flush = full and state.residuals is not None
    key = (tuple(id(v) for v in plain), flush)
    if key not in state.force_fns:
        state.force_fns[key] = make_force_fn(strategy, state, plain, flush)
    state.force_fns[key]()
