"""Overlapped syncs (Streaming DiLoCo): `tfdist.ModelAverageStrategy`'s ``sync_delay``
and ``mix``.

With ``sync_delay=τ`` the traced train step does not average. After each train-function
call (`tfdist.keras.handoff.KerasHandoff.keras_after_train_step`), at fragment ``f``'s
step ``s`` of the schedule:

1. a tf.function copies this replica's outer gradient ``anchor - w`` of each piece of
   the fragment (a variable, or rows of one: `tfdist.comm.fragments.Piece`), and its
   non-trainable floats, into an *outgoing* buffer;
2. a Python thread runs a second tf.function, traced beforehand on the calling thread:
   the mean over every replica of every worker and the fragment's outer step on its
   anchors (the strategy's own exchange, with its compression and byte count). TF ops
   release the GIL, so it runs while the worker takes its next ``τ`` inner steps;
3. after step ``s + τ`` the thread is joined (the only step that may wait) and a third
   tf.function sets ``w = mix * anchor + (1 - mix) * w`` for the fragment's pieces
   (non-trainable floats: the same blend of their mean).

`DelayedSyncs.finish` joins and applies an exchange in flight at once: ``fit``'s end,
``evaluate``/``predict`` and saves call it (through ``strategy.average``) before their
full average.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from tfdist.strategies import _average_steps
from tfdist.strategies._average_state import (agreed_variables, assign_piece, piece_of,
                                              tf_variable)


def check_steps_per_execution(model, sync_delay, mix) -> None:
    """The exchanges run between train-function calls: one step per call."""
    steps = getattr(model, "steps_per_execution", 1) or 1
    if int(steps) > 1:
        raise ValueError("sync_delay > 0 or mix < 1 needs steps_per_execution=1 (an "
                         "exchange starts and is applied between steps). Received: "
                         f"steps_per_execution={steps}, sync_delay={sync_delay}, mix={mix}")


class _Pending:
    """An exchange in flight: its fragment, the step that applies it, its thread."""

    def __init__(self, fragment, apply_at, thread, errors):
        self.fragment, self.apply_at, self.thread, self.errors = \
            fragment, apply_at, thread, errors


class _Buffers:
    """One optimizer's outgoing copies, received means and tf.functions."""

    def __init__(self, state, plain_vars):
        import keras

        self.state = state
        self.plain_vars = list(plain_vars)
        # Made eagerly in the strategy's scope: one copy per replica.
        self.outgoing = [keras.Variable(tf.zeros_like(tf_variable(a).read_value()),
                                        trainable=False, dtype=a.dtype,
                                        name=f"tfdist_outgoing_{i}")
                         for i, a in enumerate(state.anchors)]  # one per piece
        self.plain_out = [_zeros_like(v, f"tfdist_plain_out_{i}")
                          for i, v in enumerate(self.plain_vars)]
        self.plain_in = [_zeros_like(v, f"tfdist_plain_in_{i}")
                         for i, v in enumerate(self.plain_vars)]
        self.functions = {}   # fragment -> (snapshot, exchange concrete fn, apply)
        self.last_step = None
        self.pending = None
        self.applied_at = None  # (step, fragment) of the last apply


def _zeros_like(variable, name):
    return tf.Variable(tf.zeros_like(tf_variable(variable).read_value()), trainable=False,
                       name=name)


class DelayedSyncs:
    """Runs the delayed exchanges of a `tfdist.ModelAverageStrategy`.

    Args:
        strategy: The strategy (`_average_steps.exchange` moves a fragment with its averager
            and steps its anchors).
        sync_delay: Inner steps between an exchange's start and its apply.
        mix: Weight of the new global fragment in the apply.
    """

    def __init__(self, strategy, sync_delay, mix):
        self.strategy = strategy
        self.sync_delay = sync_delay
        self.mix = mix
        self._buffers = {}  # id(optimizer) -> _Buffers

    def after_step(self, state, plain_vars) -> None:
        """After a train-function call: apply a due exchange, start a scheduled one."""
        buffers = self._buffers_for(state, plain_vars)
        step = int(state.optimizer.iterations.numpy())
        if step == buffers.last_step:
            return
        buffers.last_step = step
        pending = buffers.pending
        if pending is not None and step >= pending.apply_at:
            self._complete(buffers, step)
        for fragment in range(len(state.fragments)):
            if self.strategy.is_average_step(step, fragment):
                if buffers.pending is not None:  # not due yet (the step counter moved)
                    self._complete(buffers, step)
                self._start(buffers, fragment, step)
                if self.sync_delay == 0:
                    self._complete(buffers, step)

    def finish(self, state, apply=True) -> bool:
        """Joins the exchange in flight, if any, and applies it now (or drops it: the
        weights are about to be loaded). Returns whether there was one."""
        buffers = None if state is None else self._buffers.get(id(state.optimizer))
        if buffers is None or buffers.pending is None:
            return False
        self._complete(buffers, int(state.optimizer.iterations.numpy()), apply)
        return True

    def agreed_variables(self, state) -> list:
        """The variables of the fragment applied after the step just run (every row of
        them in it), when every worker holds them equal (``mix=1``); else none."""
        buffers = self._buffers.get(id(state.optimizer))
        if self.mix != 1 or buffers is None or buffers.applied_at is None:
            return []
        step, fragment = buffers.applied_at
        if step != int(state.optimizer.iterations.numpy()):
            return []
        return agreed_variables(state, state.fragments[fragment])

    # ---- internals -------------------------------------------------------------------

    def _buffers_for(self, state, plain_vars):
        buffers = self._buffers.get(id(state.optimizer))
        if buffers is None or [id(v) for v in buffers.plain_vars] != [id(v) for v in plain_vars]:
            if buffers is not None and buffers.pending is not None:
                self._complete(buffers, buffers.last_step)
            with self.strategy.scope():
                buffers = _Buffers(state, plain_vars)
            self._buffers[id(state.optimizer)] = buffers
        return buffers

    def _start(self, buffers, fragment, step) -> None:
        snapshot, exchange, _ = self._functions(buffers, fragment)
        snapshot()
        errors = []

        def run():
            try:
                exchange()
            except BaseException as error:  # re-raised on the main thread at the apply
                errors.append(error)

        thread = threading.Thread(target=run, name=f"tfdist-exchange-{fragment}",
                                  daemon=True)
        thread.start()
        buffers.pending = _Pending(fragment, step + self.sync_delay, thread, errors)

    def _complete(self, buffers, step, apply=True) -> None:
        pending, buffers.pending = buffers.pending, None
        pending.thread.join()
        if pending.errors:
            raise pending.errors[0]
        if apply:
            self._functions(buffers, pending.fragment)[2]()
            buffers.applied_at = (step, pending.fragment)

    def _functions(self, buffers, fragment):
        """The fragment's snapshot, exchange (traced here, run on a thread) and apply."""
        if fragment not in buffers.functions:
            with self.strategy.scope():
                exchange = tf.function(self._exchange_fn(buffers, fragment))
                buffers.functions[fragment] = (
                    tf.function(self._snapshot_fn(buffers, fragment)),
                    exchange.get_concrete_function(),
                    tf.function(self._apply_fn(buffers, fragment)))
        return buffers.functions[fragment]

    def _snapshot_fn(self, buffers, fragment):
        state, extended = buffers.state, self.strategy.extended

        def snapshot():
            for i in state.fragments[fragment]:
                piece = state.pieces[i]
                extended.update(tf_variable(buffers.outgoing[i]),
                                lambda o, a, w, piece=piece: o.assign(a - piece_of(w, piece)),
                                args=(tf_variable(state.anchors[i]),
                                      tf_variable(state.variables[piece.variable])),
                                group=False)
            for out, variable in zip(buffers.plain_out, buffers.plain_vars):
                extended.update(out, lambda o, v: o.assign(v), args=(tf_variable(variable),),
                                group=False)

        return snapshot

    def _exchange_fn(self, buffers, fragment):
        state, strategy = buffers.state, self.strategy
        indices = state.fragments[fragment]

        def merge(distribution, deltas, plain):
            full = [None] * len(state.pieces)
            for i, delta in zip(indices, deltas):
                full[i] = delta
            means = _average_steps.exchange(strategy, distribution, state, full, plain,
                                            buffers.plain_in, fragment, indices)
            for received, mean in zip(buffers.plain_in, means):
                distribution.extended.update(
                    received, lambda r, m: r.assign(tf.cast(m, r.dtype)), args=(mean,),
                    group=False)

        def replica_fn():
            deltas = [tf.identity(tf_variable(buffers.outgoing[i])) for i in indices]
            plain = [tf.identity(v) for v in buffers.plain_out]
            tf.distribute.get_replica_context().merge_call(merge, args=(deltas, plain))

        def exchange():
            strategy.run(replica_fn)

        return exchange

    def _apply_fn(self, buffers, fragment):
        state, extended, mix = buffers.state, self.strategy.extended, self.mix

        def blend(variable, new, piece=None):
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

        def apply():
            for i in state.fragments[fragment]:
                piece = state.pieces[i]
                extended.update(tf_variable(state.variables[piece.variable]),
                                lambda v, a, piece=piece: blend(v, a, piece),
                                args=(tf_variable(state.anchors[i]),), group=False)
            for variable, received in zip(buffers.plain_vars, buffers.plain_in):
                extended.update(tf_variable(variable), blend, args=(received,), group=False)

        return apply
