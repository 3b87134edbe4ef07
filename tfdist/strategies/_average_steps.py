"""Model averaging's cross-replica steps: anchors, deltas, the exchange, forced averages.

Functions taking a `tfdist.ModelAverageStrategy` and its per-optimizer
`tfdist.strategies._average_state.State`: the state made once (anchors, outer
optimizers, residuals), each replica's delta ``anchor - w``, the scheduled average inside
the train step (one ``tf.cond`` per fragment), the exchange of a fragment (also run by
`tfdist.strategies._delayed`), and the forced average of every per-replica variable.
Anchors, deltas and residuals are per piece (`tfdist.comm.fragments.Piece`): a whole
variable, or a block of its rows when a fragment boundary cuts it.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfdist._hooks import keras_optimizer
from tfdist.comm.fragments import split_fragments, variable_rows
from tfdist.strategies import _outer
from tfdist.strategies._average_state import (State, assign_piece, is_replicated_float,
                                              make_residuals, piece_of, piece_value, scale,
                                              tf_variable)


def optimizer_slots(optimizer) -> list:
    """The optimizer's per-replica floats (momentum, moments), not its step or rate."""
    skip = {id(optimizer.iterations)}
    learning_rate = keras_optimizer.learning_rate_variable(optimizer)
    if learning_rate is not None:
        skip.add(id(learning_rate))
    return [v for v in optimizer.variables if id(v) not in skip and is_replicated_float(v)]


def ensure_state(strategy, optimizer, variables, distribution=None) -> None:
    """Creates the anchors (and outer optimizer) once, outside the traced step."""
    del distribution
    if id(optimizer) in strategy._states:
        return
    import keras

    tf_vars = [tf_variable(v) for v in variables]
    split = split_fragments([v.shape.num_elements() * v.dtype.size for v in tf_vars],
                            strategy.fragments, [variable_rows(v.shape) for v in tf_vars])
    pieces = [piece for fragment in split for piece in fragment]
    fragments, start = [], 0
    for fragment in split:  # piece indices of each fragment
        fragments.append(list(range(start, start + len(fragment))))
        start += len(fragment)
    with tf.init_scope(), strategy.scope():
        anchors = [keras.Variable(piece_of(tf.identity(tf_vars[p.variable]), p),
                                  trainable=False, dtype=variables[p.variable].dtype,
                                  name=f"tfdist_anchor_{p.variable}"
                                  + ("" if p.whole else f"_{p.start}"))
                   for p in pieces]
        outers = []
        for indices in fragments if strategy._outer_template is not None else ():
            outers.append(_outer.make_outer(strategy._outer_template))
            outers[-1].build([anchors[i] for i in indices])
        residuals = make_residuals(anchors) if strategy.outer_compression else None
    strategy._states[id(optimizer)] = State(optimizer, variables, pieces, anchors,
                                            optimizer_slots(optimizer), outers,
                                            fragments, residuals)


def local_deltas(state) -> list:
    """In replica context: ``anchor - w`` for this replica, one per piece (``w`` the
    piece's rows of the variable)."""
    return [tf_variable(anchor) - piece_value(state.variables[piece.variable], piece)
            for piece, anchor in zip(state.pieces, state.anchors)]


def merge_step(strategy, state, plain_vars, distribution, deltas, plain) -> None:
    """Cross-replica: average each fragment whose step the optimizer's counter is
    (the values averaged as plain means go with every fragment's average)."""
    step = tf.cast(tf_variable(state.optimizer.iterations), tf.int64) + 1
    for fragment, indices in enumerate(state.fragments):
        def average(fragment=fragment, indices=indices):
            average_now(strategy, distribution, state, deltas, plain_vars, plain, outer=True,
                        fragment=fragment, indices=indices)
            return tf.constant(True)

        tf.cond(strategy.averager.should_average(step, fragment), average,
                lambda: tf.constant(False))


def average_now(strategy, distribution, state, deltas, plain_vars, plain, outer,
                fragment=0, indices=None, flush=False) -> None:
    """Cross-replica: all-reduce, then set anchors and every replica's weights (of
    the pieces at ``indices``, default all); ``flush`` as in `exchange`."""
    if indices is None:
        indices = range(len(state.pieces))
    plain_tf = [tf_variable(v) for v in plain_vars]
    mean_plain = exchange(strategy, distribution, state, deltas, plain, plain_tf, fragment,
                          indices, outer, flush)
    extended = distribution.extended
    for i in indices:
        piece = state.pieces[i]
        extended.update(tf_variable(state.variables[piece.variable]),
                        lambda v, a, piece=piece: assign_piece(v, piece, a),
                        args=(tf_variable(state.anchors[i]),), group=False)
    for variable, mean in zip(plain_tf, mean_plain):
        extended.update(variable, lambda v, m: v.assign(tf.cast(m, v.dtype)),
                        args=(mean,), group=False)


def exchange(strategy, distribution, state, deltas, plain, plain_tf, fragment, indices,
             outer=True, flush=False) -> list:
    """Cross-replica: the mean of ``deltas`` (of the pieces at ``indices``) steps those
    anchors (outer step or plain mean); returns the means of ``plain`` (to ``plain_tf``).

    ``flush`` (with ``outer_compression``): ``delta + residual`` goes exactly and the
    residuals become zero; else the deltas go compressed, with error feedback."""
    anchors = [tf_variable(state.anchors[i]) for i in indices]
    residuals = None if state.residuals is None else [
        tf_variable(state.residuals[i]) for i in indices]
    mean_deltas, mean_plain = strategy.averager.average(
        distribution, [deltas[i] for i in indices], anchors, plain, plain_tf,
        residuals=residuals, flush=flush)
    if outer and state.outers:
        _outer.apply_outer_step(distribution, state.outers[fragment], anchors, mean_deltas)
    else:
        for anchor, delta in zip(anchors, mean_deltas):
            distribution.extended.update(
                anchor, lambda a, d: a.assign_sub(tf.cast(d, a.dtype)), args=(delta,),
                group=False)
    return mean_plain


def make_force_fn(strategy, state, plain_vars, flush):
    """A tf.function that averages the anchored weights and ``plain_vars`` (no outer
    step); ``flush`` as in `exchange`."""

    def merge_force(distribution, deltas, plain):
        average_now(strategy, distribution, state, deltas, plain_vars, plain, outer=False,
                    flush=flush)

    def replica_fn():
        plain = [tf.identity(tf_variable(v)) for v in plain_vars]
        tf.distribute.get_replica_context().merge_call(
            merge_force, args=(local_deltas(state), plain))

    @tf.function
    def force():
        strategy.run(replica_fn)

    return force


def force_average(strategy, model, optimizer, state, full) -> None:
    """Averages the per-replica floats of ``model`` (the anchored weights as deltas, the
    rest as plain means) and, if ``full``, of ``optimizer``, exactly (flushing any
    error-feedback residuals); a tf.function is made once per variable set."""
    anchored = {id(v) for v in state.variables}
    slots = optimizer_slots(optimizer) if full else []
    plain = [v for v in list(model.weights) + slots
             if id(v) not in anchored and is_replicated_float(v)]
    flush = full and state.residuals is not None
    key = (tuple(id(v) for v in plain), flush)
    if key not in state.force_fns:
        state.force_fns[key] = make_force_fn(strategy, state, plain, flush)
    state.force_fns[key]()


def local_apply(strategy, optimizer, apply_fn, grads, variables):
    """Replaces Keras' optimizer step in replica context (see
    `tfdist.strategies.model_average`): the local update, then the scheduled average."""
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError("ModelAverageStrategy does not support gradient accumulation. "
                         "Received: gradient_accumulation_steps="
                         f"{optimizer.gradient_accumulation_steps}")
    # Keras scaled the loss by 1/N for a SUM all-reduce that does not happen here.
    grads = [scale(g, strategy.num_replicas_in_sync) for g in grads]
    result = apply_fn(optimizer, grads, variables)
    context = tf.distribute.get_replica_context()
    context.merge_call(functools.partial(ensure_state, strategy, optimizer, list(variables)))
    state = strategy._states[id(optimizer)]
    if strategy._delayed is not None:
        return result  # averaged after the step (keras_after_train_step)
    # Averaged as values with the weights: the optimizer slots when asked, and the
    # model's non-trainable floats (BatchNorm's moving statistics) under fit.
    plain_vars = ((state.slots if strategy.average_optimizer_state else [])
                  + strategy._model_state.get(id(optimizer), []))
    plain = [tf.identity(tf_variable(v)) for v in plain_vars]
    context.merge_call(functools.partial(merge_step, strategy, state, plain_vars),
                       args=(local_deltas(state), plain))
    return result
