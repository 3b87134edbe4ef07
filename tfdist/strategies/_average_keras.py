"""Model averaging's side of the Keras hand-off (`tfdist.keras.handoff.KerasHandoff`).

`AverageHandoffMixin` is what `tfdist.ModelAverageStrategy` tells Keras: every optimizer
step is local (`tfdist.strategies._average_steps.local_apply`), per-step logs stay on the
worker, ``fit`` is checked before it runs, delayed syncs run after each train step, the
model is averaged around ``fit`` and before ``evaluate``/``predict``/``save``, and the outer
optimizer is attached for saves and loads.
"""

from __future__ import annotations

import functools

from tfdist.comm.fragments import split_fragments
from tfdist.keras.handoff import KerasHandoff
from tfdist.keras.optimizer import inner_optimizer
from tfdist.strategies import _average_steps, _delayed, _outer
from tfdist.strategies._average_state import (agreed_variables, is_replicated_float,
                                              piece_of, tf_variable)


class AverageHandoffMixin(KerasHandoff):
    """The Keras hand-off of `tfdist.ModelAverageStrategy` (it holds the state read here:
    ``_states``, ``_delayed``, ``_model_state``, ``_fit_start``, ``_outer_template``)."""

    keras_local_step_outputs = True  # per-step logs local: no per-step collective

    def keras_local_update(self):
        """Every optimizer step is local (see `tfdist.strategies.model_average`)."""
        return functools.partial(_average_steps.local_apply, self)

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        """Keras' own all-reduce: this strategy has no gradient communicator. Not
        reached while `keras_local_update` routes every step (fit checks that)."""
        return reduce(grads_and_vars)

    def keras_check_call(self, model, method, arguments):
        """The base class's checks, and refuses ``fit`` before it runs when
        ``fragments`` exceeds the trainable variables."""
        super().keras_check_call(model, method, arguments)
        if method == "fit" and model.built and self.fragments > 1:
            split_fragments([0] * len(model.trainable_variables), self.fragments)
        if method == "fit" and self._delayed is not None:
            _delayed.check_steps_per_execution(model, self.sync_delay, self.mix)

    def keras_after_train_step(self, model):
        """Delayed syncs: applies a due exchange and starts a scheduled one."""
        optimizer = inner_optimizer(getattr(model, "optimizer", None))
        state = self._states.get(id(optimizer))
        if self._delayed is not None and state is not None:
            self._delayed.after_step(state, self._model_state.get(id(optimizer), []))

    def keras_model_event(self, model, method, when):
        """``keras.Model`` calls this around fit and load_weights, and before
        evaluate/predict/save."""
        optimizer = inner_optimizer(getattr(model, "optimizer", None))
        if method == "load_weights":
            if self._delayed is not None and when == "before":  # the load replaces it
                self._delayed.finish(self._states.get(id(optimizer)), apply=False)
            self._outer_around_load(model, optimizer, when)
            return
        if method == "fit" and when == "before":
            self._fit_start[id(model)] = (
                None if optimizer is None else int(optimizer.iterations.numpy()))
            if optimizer is not None:  # averaged with the weights (BatchNorm statistics)
                self._model_state[id(optimizer)] = [
                    v for v in model.non_trainable_weights if is_replicated_float(v)]
            return
        if method == "fit":
            start = self._fit_start.pop(id(model), None)
            if (optimizer is not None and id(optimizer) not in self._states
                    and start is not None and int(optimizer.iterations.numpy()) > start):
                raise RuntimeError(
                    "ModelAverageStrategy: fit ran optimizer steps that did not go "
                    "through tfdist's local update, so they may have been synchronous. "
                    f"Optimizer: {type(optimizer).__name__}. Check tests/test_hooks.py "
                    "against this Keras version.")
        # evaluate/predict need the weights only; fit's end and saves need everything.
        self.average(model, full=method in ("fit", "save", "save_weights", "export"))
        if method in ("save", "save_weights"):
            self._attach_outer(model, optimizer)

    def keras_agreed_variables(self, model):
        """The trainable variables averaged (every row of them) after the step just run
        (empty between averages): every worker holds them equal, so a check on them
        decides the same everywhere (`tfdist.keras.guards.StopOnNaN`)."""
        optimizer = inner_optimizer(getattr(model, "optimizer", None))
        state = self._states.get(id(optimizer))
        if state is None:
            return []
        step = int(optimizer.iterations.numpy())
        if self._delayed is not None:
            return self._delayed.agreed_variables(state)
        return agreed_variables(state, [i for fragment, indices in enumerate(state.fragments)
                                        if self.is_average_step(step, fragment)
                                        for i in indices])

    def _attach_outer(self, model, optimizer) -> None:
        """Makes the outer optimizer an attribute of ``model``, so Keras saves (and
        loads) its state (SlowMo's momentum, its step) with the model's."""
        state = self._states.get(id(optimizer))
        for index, outer in enumerate(state.outers if state is not None else ()):
            _outer.attach(model, outer, index)

    def _outer_around_load(self, model, optimizer, when) -> None:
        """Before ``load_weights``: the outer optimizer exists, for Keras to restore it.
        After: the anchors are the loaded weights (a save averaged them first)."""
        if self._outer_template is None or optimizer is None:
            return
        if when == "before":
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            _average_steps.ensure_state(self, optimizer, list(model.trainable_variables))
            self._attach_outer(model, optimizer)
            return
        state = self._states[id(optimizer)]
        for anchor, piece in zip(state.anchors, state.pieces):
            anchor.assign(piece_of(tf_variable(state.variables[piece.variable]).read_value(),
                                   piece))
