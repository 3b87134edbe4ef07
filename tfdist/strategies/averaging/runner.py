"""Model averaging's runner: when each fragment's exchange starts and when it is applied.

One schedule for every ``sync_delay``: fragment ``f``'s exchange starts after its step
``s`` of the schedule and is applied after step ``s + sync_delay`` as
``w = mix * anchor + (1 - mix) * w``. Its stages are those of
`tfdist.strategies.averaging.exchange`: each replica's outer gradient ``anchor - w``,
the exchange (mean over every replica of every worker, outer step on the anchors), the
apply. The delay only decides where they run:

- ``sync_delay=0``: start and apply are the same step. With ``mix=1`` the stages run
  inside the traced train step (`Runner.local_update`, one ``tf.cond`` per fragment),
  so custom loops and ``steps_per_execution > 1`` average too; with ``mix < 1`` they run
  right after the train-function call, as below with no step in between.
- ``sync_delay=τ > 0``: after the train-function call of step ``s``
  (`tfdist.keras.handoff.KerasHandoff.keras_after_train_step`) a tf.function copies the
  outer gradient (and the non-trainable floats) into the fragment's outgoing buffers; a
  Python thread runs the exchange (traced beforehand on the calling thread; TF ops
  release the GIL) while the worker takes τ more steps; after step ``s + τ`` the thread
  is joined (the only step that may wait) and the apply runs.

`Runner.finish` joins and applies an exchange in flight at once: ``fit``'s end,
``evaluate``/``predict`` and saves call it (through ``strategy.average``).
"""

from __future__ import annotations

import functools
import threading

import tensorflow as tf

from tfdist.strategies.averaging import exchange as stages
from tfdist.strategies.averaging.fragment import agreed_variables, piece_of, tf_variable


def check_steps_per_execution(model, sync_delay, mix) -> None:
    """The exchanges run between train-function calls: one step per call."""
    steps = getattr(model, "steps_per_execution", 1) or 1
    if int(steps) > 1:
        raise ValueError("sync_delay > 0 or mix < 1 needs steps_per_execution=1 (an "
                         "exchange starts and is applied between steps). Received: "
                         f"steps_per_execution={steps}, sync_delay={sync_delay}, mix={mix}")


class Pending:
    """An exchange in flight: the step that applies it, its thread, its errors."""

    def __init__(self, apply_at, thread, errors):
        self.apply_at, self.thread, self.errors = apply_at, thread, errors


class Exchanges:
    """The runner's record of one optimizer: the non-trainable floats' buffers, the
    traced functions of each fragment, the last step seen and the last apply."""

    def __init__(self, state, plain_vars):
        import keras

        self.plain_vars = list(plain_vars)
        for fragment in state.fragments:  # made eagerly in the strategy's scope
            fragment.outgoing = [
                keras.Variable(tf.zeros_like(tf_variable(a).read_value()), trainable=False,
                               dtype=a.dtype, name=f"tfdist_outgoing_{i}")
                for i, a in zip(fragment.indices, fragment.anchors)]
        self.plain_out = [_zeros_like(v, f"tfdist_plain_out_{i}")
                          for i, v in enumerate(self.plain_vars)]
        self.plain_in = [_zeros_like(v, f"tfdist_plain_in_{i}")
                         for i, v in enumerate(self.plain_vars)]
        self.functions = {}   # fragment index -> (snapshot, exchange concrete fn, apply)
        self.last_step = None
        self.applied_at = None  # (step, fragment index) of the last apply


def _zeros_like(variable, name):
    return tf.Variable(tf.zeros_like(tf_variable(variable).read_value()), trainable=False,
                       name=name)


class Runner:
    """Runs the exchanges of a `tfdist.ModelAverageStrategy` (see the module's words).

    Args:
        strategy: The strategy; only its public API is used (``averager``,
            ``extended``, ``scope``, ``run``, ``is_average_step``,
            ``num_replicas_in_sync``, ``averaging_state_for``, ``plain_variables``).
        sync_delay: Inner steps between an exchange's start and its apply.
        mix: Weight of the new global fragment in the apply.
    """

    def __init__(self, strategy, sync_delay=0, mix=1.0):
        self.strategy = strategy
        self.sync_delay = sync_delay
        self.mix = mix

    @property
    def in_step(self) -> bool:
        """Whether the exchanges run inside the traced train step (delay 0, mix 1)."""
        return self.sync_delay == 0 and self.mix == 1

    # ---- inside the train step ---------------------------------------------------------

    def local_update(self, optimizer, apply_fn, grads, variables):
        """Replaces Keras' optimizer step in replica context (see
        `tfdist.strategies.averaging.model_average`): the local update, then the
        scheduled exchanges when they run in the step."""
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ValueError("ModelAverageStrategy does not support gradient accumulation. "
                             "Received: gradient_accumulation_steps="
                             f"{optimizer.gradient_accumulation_steps}")
        strategy = self.strategy
        # Keras scaled the loss by 1/N for a SUM all-reduce that does not happen here.
        grads = [stages.scale(g, strategy.num_replicas_in_sync) for g in grads]
        result = apply_fn(optimizer, grads, variables)
        context = tf.distribute.get_replica_context()
        context.merge_call(lambda _: strategy.averaging_state_for(optimizer, list(variables))
                           and None)
        state = strategy.averaging_state(optimizer)
        if not self.in_step:
            return result  # after the step (after_step)
        plain_vars = strategy.plain_variables(state)
        plain = [tf.identity(tf_variable(v)) for v in plain_vars]
        context.merge_call(functools.partial(self._merge_step, state, plain_vars),
                           args=(stages.local_deltas(state), plain))
        return result

    def _merge_step(self, state, plain_vars, distribution, deltas, plain) -> None:
        """Cross-replica: each fragment whose step the optimizer's counter is starts
        and is applied (the plain values go with every fragment's average)."""
        averager = self.strategy.averager
        step = tf.cast(tf_variable(state.optimizer.iterations), tf.int64) + 1
        for fragment in state.fragments:
            def average(fragment=fragment):
                stages.average_now(averager, distribution, state,
                                   [deltas[i] for i in fragment.indices], plain_vars, plain,
                                   outer=True, fragment=fragment, mix=self.mix)
                return tf.constant(True)

            tf.cond(averager.should_average(step, fragment.index), average,
                    lambda: tf.constant(False))

    # ---- between train steps -------------------------------------------------------------

    def after_step(self, state, plain_vars) -> None:
        """After a train-function call: apply a due exchange, start a scheduled one."""
        if self.in_step:
            return  # done inside the step
        record = self._record(state, plain_vars)
        step = int(state.optimizer.iterations.numpy())
        if step == record.last_step:
            return
        record.last_step = step
        flying = state.in_flight()
        if flying is not None and step >= flying.pending.apply_at:
            self._complete(state, flying, step)
        for fragment in state.fragments:
            if self.strategy.is_average_step(step, fragment.index):
                flying = state.in_flight()
                if flying is not None:  # not due yet (the step counter moved)
                    self._complete(state, flying, step)
                self._start(state, fragment, step)
                if self.sync_delay == 0:
                    self._complete(state, fragment, step)

    def finish(self, state, apply=True) -> bool:
        """Joins the exchange in flight, if any, and applies it now (or drops it: the
        weights are about to be loaded). Returns whether there was one."""
        flying = None if state is None else state.in_flight()
        if flying is None:
            return False
        self._complete(state, flying, int(state.optimizer.iterations.numpy()), apply)
        return True

    def agreed_variables(self, state) -> list:
        """The variables of the fragments applied after the step just run (every row of
        them in one), when every worker holds them equal (``mix=1``); else none."""
        if self.mix != 1:
            return []
        step = int(state.optimizer.iterations.numpy())
        if self.in_step:
            applied = [f for f in state.fragments
                       if self.strategy.is_average_step(step, f.index)]
        else:
            record = state.exchange
            if record is None or record.applied_at is None or record.applied_at[0] != step:
                return []
            applied = [state.fragments[record.applied_at[1]]]
        return agreed_variables(state.pieces, state.variables,
                                [i for f in applied for i in f.indices])

    # ---- internals -----------------------------------------------------------------------

    def _record(self, state, plain_vars) -> Exchanges:
        record = state.exchange
        if record is None or [id(v) for v in record.plain_vars] != [id(v) for v in plain_vars]:
            if record is not None and state.in_flight() is not None:
                self._complete(state, state.in_flight(), record.last_step)
            with self.strategy.scope():
                record = Exchanges(state, plain_vars)
            state.exchange = record
        return record

    def _start(self, state, fragment, step) -> None:
        snapshot, exchange, _ = self._functions(state, fragment)
        snapshot()
        errors = []

        def run():
            try:
                exchange()
            except BaseException as error:  # re-raised on the main thread at the apply
                errors.append(error)

        thread = threading.Thread(target=run, name=f"tfdist-exchange-{fragment.index}",
                                  daemon=True)
        thread.start()
        fragment.pending = Pending(step + self.sync_delay, thread, errors)

    def _complete(self, state, fragment, step, apply=True) -> None:
        pending, fragment.pending = fragment.pending, None
        pending.thread.join()
        if pending.errors:
            raise pending.errors[0]
        if apply:
            self._functions(state, fragment)[2]()
            state.exchange.applied_at = (step, fragment.index)

    def _functions(self, state, fragment):
        """The fragment's snapshot, exchange (traced here, run on a thread) and apply."""
        record = state.exchange
        if fragment.index not in record.functions:
            with self.strategy.scope():
                exchange = tf.function(self._exchange_fn(state, record, fragment))
                record.functions[fragment.index] = (
                    tf.function(self._snapshot_fn(state, record, fragment)),
                    exchange.get_concrete_function(),
                    tf.function(self._apply_fn(state, record, fragment)))
        return record.functions[fragment.index]

    def _snapshot_fn(self, state, record, fragment):
        extended = self.strategy.extended

        def snapshot():
            for out, piece, anchor in zip(fragment.outgoing, fragment.pieces,
                                          fragment.anchors):
                extended.update(tf_variable(out),
                                lambda o, a, w, piece=piece: o.assign(a - piece_of(w, piece)),
                                args=(tf_variable(anchor),
                                      tf_variable(state.variables[piece.variable])),
                                group=False)
            for out, variable in zip(record.plain_out, record.plain_vars):
                extended.update(out, lambda o, v: o.assign(v), args=(tf_variable(variable),),
                                group=False)

        return snapshot

    def _exchange_fn(self, state, record, fragment):
        strategy = self.strategy

        def merge(distribution, deltas, plain):
            means = stages.exchange(strategy.averager, distribution, state, deltas, plain,
                                    record.plain_in, fragment)
            for received, mean in zip(record.plain_in, means):
                distribution.extended.update(
                    received, lambda r, m: r.assign(tf.cast(m, r.dtype)), args=(mean,),
                    group=False)

        def replica_fn():
            deltas = [tf.identity(tf_variable(o)) for o in fragment.outgoing]
            plain = [tf.identity(v) for v in record.plain_out]
            tf.distribute.get_replica_context().merge_call(merge, args=(deltas, plain))

        def exchange():
            strategy.run(replica_fn)

        return exchange

    def _apply_fn(self, state, record, fragment):
        extended, mix = self.strategy.extended, self.mix

        def apply():
            stages.apply(extended, state, fragment, record.plain_vars, record.plain_in, mix)

        return apply
