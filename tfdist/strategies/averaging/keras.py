"""Model averaging's side of the Keras hand-off (`tfdist.keras.handoff.KerasHandoff`).

`AverageHandoffMixin` is what `tfdist.ModelAverageStrategy` tells Keras: every optimizer
step is local (`tfdist.strategies.averaging.runner.Runner.local_update`), per-step logs
stay on the worker, ``fit`` is checked before it runs, exchanges placed between steps run
after each train step, the model is averaged around ``fit`` and before
``evaluate``/``predict``/``save``, and the outer optimizer is attached for saves and
loads. It uses the strategy's public API only (``runner``, ``averaging_state``,
``averaging_state_for``, ``set_model_state``, ``has_outer_optimizer``, ``average``).
"""

from __future__ import annotations

from tfdist.comm.fragments import split_fragments
from tfdist.keras.handoff import KerasHandoff
from tfdist.keras.optimizer import inner_optimizer
from tfdist.strategies.averaging import outer as outer_optimizer
from tfdist.strategies.averaging.fragment import is_replicated_float, piece_of, tf_variable
from tfdist.strategies.averaging.runner import check_steps_per_execution


class AverageHandoffMixin(KerasHandoff):
    """The Keras hand-off of `tfdist.ModelAverageStrategy` (public API only; its own
    record: the optimizer step at each ``fit``'s start)."""

    keras_local_step_outputs = True  # per-step logs local: no per-step collective

    def keras_local_update(self):
        """Every optimizer step is local (see `tfdist.strategies.model_average`)."""
        return self.runner.local_update

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
        if method == "fit" and not self.runner.in_step:
            check_steps_per_execution(model, self.sync_delay, self.mix)

    def keras_after_train_step(self, model):
        """Delayed syncs: applies a due exchange and starts a scheduled one."""
        optimizer = inner_optimizer(getattr(model, "optimizer", None))
        state = self.averaging_state(optimizer)
        if state is not None:
            self.runner.after_step(state, self.plain_variables(state))

    def keras_model_event(self, model, method, when):
        """``keras.Model`` calls this around fit and load_weights, and before
        evaluate/predict/save."""
        optimizer = inner_optimizer(getattr(model, "optimizer", None))
        if method == "load_weights":
            if when == "before":  # the load replaces an exchange in flight
                self.runner.finish(self.averaging_state(optimizer), apply=False)
            self._outer_around_load(model, optimizer, when)
            return
        if method == "fit" and when == "before":
            self._fit_starts()[id(model)] = (
                None if optimizer is None else int(optimizer.iterations.numpy()))
            if optimizer is not None:  # averaged with the weights (BatchNorm statistics)
                self.set_model_state(optimizer, [
                    v for v in model.non_trainable_weights if is_replicated_float(v)])
            return
        if method == "fit":
            start = self._fit_starts().pop(id(model), None)
            if (optimizer is not None and self.averaging_state(optimizer) is None
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
        state = self.averaging_state(optimizer)
        return [] if state is None else self.runner.agreed_variables(state)

    def _fit_starts(self) -> dict:
        """``id(model) -> optimizer step`` at each running ``fit``'s start (this mixin's
        own record)."""
        return self.__dict__.setdefault("_average_fit_starts", {})

    def _attach_outer(self, model, optimizer) -> None:
        """Makes the outer optimizer an attribute of ``model``, so Keras saves (and
        loads) its state (SlowMo's momentum, its step) with the model's."""
        state = self.averaging_state(optimizer)
        for index, outer in enumerate(state.outers if state is not None else ()):
            outer_optimizer.attach(model, outer, index)

    def _outer_around_load(self, model, optimizer, when) -> None:
        """Before ``load_weights``: the outer optimizer exists, for Keras to restore it.
        After: the anchors are the loaded weights (a save averaged them first)."""
        if not self.has_outer_optimizer or optimizer is None:
            return
        if when == "before":
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            self.averaging_state_for(optimizer, list(model.trainable_variables))
            self._attach_outer(model, optimizer)
            return
        state = self.averaging_state(optimizer)
        for anchor, piece in zip(state.anchors, state.pieces):
            anchor.assign(piece_of(tf_variable(state.variables[piece.variable]).read_value(),
                                   piece))
