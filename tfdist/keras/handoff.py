"""The Keras hand-off: the contract between a tfdist strategy and Keras.

Keras 3 has no strategy callbacks: it all-reduces gradients itself, has no place to act
around ``fit`` or before a save, and dropped parameter-server ``fit``. tfdist patches
Keras once (`install_keras_hooks`; the private patching lives in `tfdist._hooks.keras`),
and each patch asks the strategy running the code for its hand-off. A strategy takes part
by inheriting `KerasHandoff` and overriding what it changes; every default is Keras' own
behaviour, and for a strategy that is not a `KerasHandoff` Keras runs as it is.

What Keras then does, per member of `KerasHandoff`:

- ``keras_local_update()``: the optimizer step runs the strategy's function; Keras'
  gradient all-reduce is skipped (model averaging, gradient accumulation).
- ``keras_reduce_gradients(grads_and_vars, reduce)``: replaces Keras' gradient
  all-reduce in replica context (synchronous strategies: their communicator).
- ``keras_check_call(model, method, arguments)``: may refuse ``fit``/``evaluate``/
  ``predict`` (`FIT_DRIVER_METHODS`) before anything runs.
- ``keras_fit_context(model, arguments)``: the context ``fit`` runs in.
- ``keras_fit_initial_epoch(model)``: None, or the ``initial_epoch`` fit starts at.
- ``keras_model_event(model, method, when)``: told ``"before"`` and ``"after"`` fit,
  and ``"before"`` the other `MODEL_EVENTS`.
- ``keras_fit_driver``: a module whose ``fit``/``evaluate``/``predict`` replace Keras'
  own (parameter servers).
- ``keras_local_step_outputs``: the train step's loss and metrics stay on this worker
  (per-step logs are local; Keras' on-read metric variables still give global epoch
  logs): a non-averaging step of model averaging sends nothing.
- ``keras_after_train_step(model)``: called after each call of such a strategy's train
  function (one step unless ``steps_per_execution`` > 1): delayed model averages.
- ``keras_agreed_variables(model)``: None when every step is synchronous; else the
  variables every worker holds equal after the step just run (those a model average
  just averaged), for callbacks that must decide the same on every worker (`StopOnNaN`).
- ``keras_safe_saves``, ``keras_global_finite_check``, ``keras_atomic_updates``: atomic
  saves that refuse NaN weights; one loss-scale decision for all replicas; atomic
  ``assign_add``/``assign_sub``.

This module imports neither Keras nor TensorFlow.
"""

from __future__ import annotations

import contextlib
import importlib

# Model methods around which (fit) or before which (the others) the strategy is told.
MODEL_EVENTS = {"fit": "around", "evaluate": "before", "predict": "before",
                "test_on_batch": "before", "predict_on_batch": "before",
                "save": "before", "save_weights": "before", "export": "before",
                "load_weights": "around"}
# Model methods a fit driver (parameter servers) replaces.
FIT_DRIVER_METHODS = ("fit", "evaluate", "predict")


class KerasHandoff:
    """What a tfdist strategy changes in Keras: the one interface behind every patch.

    A strategy class inherits it and overrides what it changes; every default is Keras'
    own behaviour. `install_keras_hooks` patches Keras once, and each patch asks the
    strategy running the code (`handoff_of`); for any other strategy Keras runs as it is.
    """

    #: Module whose fit/evaluate/predict replace Keras' own (parameter servers).
    keras_fit_driver: str | None = None
    #: Keras variables' assign_add/assign_sub are atomic (asynchronous ps updates).
    keras_atomic_updates = False
    #: model.save/save_weights write atomically and refuse NaN/inf weights.
    keras_safe_saves = False
    #: Train steps keep their loss/metric outputs on this worker (no per-step reduce
    #: across workers); the epoch's logs are still reduced over every worker, once.
    keras_local_step_outputs = False
    #: A LossScaleOptimizer skips or applies each step on every replica together.
    keras_global_finite_check = False
    #: Whether Keras clips the all-reduced gradient (as one device does) rather than each
    #: replica's (stock Keras 3); for the synchronous strategies.
    keras_clip_after_reduce = False

    def keras_local_update(self):
        """None, or ``f(optimizer, apply_fn, grads, variables)`` that replaces Keras'
        optimizer step in replica context; Keras' gradient all-reduce is then skipped."""
        return None

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        """Keras' gradient all-reduce in replica context; ``reduce`` is Keras' own."""
        return reduce(grads_and_vars)

    def keras_check_call(self, model, method, arguments):
        """Raises to refuse ``fit``/``evaluate``/``predict`` before anything runs.

        ``arguments``: the call's bound arguments. Not called for a `keras_fit_driver`.
        """
        del model, method, arguments

    def keras_fit_context(self, model, arguments):
        """The context manager ``fit`` runs in (``arguments``: fit's bound arguments)."""
        del model, arguments
        return contextlib.nullcontext()

    def keras_fit_initial_epoch(self, model):
        """None, or the ``initial_epoch`` that replaces fit's own (asked inside
        `keras_fit_context`: a worker joining a running elastic job)."""
        del model
        return None

    def keras_model_event(self, model, method, when):
        """Told ``"before"`` and ``"after"`` fit, and ``"before"`` the other `MODEL_EVENTS`."""

    def keras_after_train_step(self, model):
        """Called after each call of the train function of a `keras_local_step_outputs`
        strategy (on the calling thread, before the batch's callbacks)."""
        del model

    def keras_agreed_variables(self, model):
        """None: every train step is synchronous, so its logs agree on every worker.

        A strategy with local steps returns the variables of ``model`` that every worker
        holds equal after the step just run (empty between averages).
        """
        del model
        return None


def handoff_of(strategy) -> KerasHandoff | None:
    """``strategy`` if it declares a Keras hand-off, else None."""
    return strategy if isinstance(strategy, KerasHandoff) else None


def fit_driver(handoff: KerasHandoff, method: str):
    """The function of ``handoff``'s fit driver that replaces ``keras.Model.<method>``."""
    return getattr(importlib.import_module(handoff.keras_fit_driver), method)


def install_keras_hooks() -> None:
    """Patches Keras once so that every `KerasHandoff` is asked. Idempotent.

    Each strategy that declares a hand-off calls this when it is created.
    """
    from tfdist._hooks.keras import install_keras_hooks as install
    from tfdist._hooks.keras_steps import install_local_step_outputs

    install(handoff_of=handoff_of, model_events=MODEL_EVENTS,
            fit_driver_methods=FIT_DRIVER_METHODS, fit_driver=fit_driver)
    install_local_step_outputs(handoff_of)
