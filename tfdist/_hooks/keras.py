"""Hooks into Keras that install the Keras hand-off: the patches Keras runs through.

`install_keras_hooks` patches Keras' optimizer step, ``keras.Model``'s methods, the
loss-scale check and variable updates once; each patch asks the strategy running the code
for its hand-off (`tfdist.keras.handoff.KerasHandoff`, the public contract, which passes
itself in: hooks never import up). For any other strategy Keras runs as it is.
``tests/test_hooks.py`` fails loudly when a Keras upgrade removes what they touch.
"""

from __future__ import annotations

import contextlib
import functools

from tfdist._hooks.saves import SAVE_METHODS, save_safely


def _replica_handoff(handoff_of):
    """The hand-off of the strategy running this replica function, if any."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    return handoff_of(context.strategy) if context else None


def install_keras_hooks(*, handoff_of, model_events, fit_driver_methods, fit_driver) -> None:
    """Patches Keras once so that strategies can declare a `KerasHandoff`. Idempotent.

    Why each patch (all private or internal Keras behaviour, tested in
    tests/test_hooks.py):

    - ``TFOptimizer._backend_apply_gradients`` and ``_all_reduce_sum_gradients``: Keras
      3 always SUM-all-reduces gradients before ``extended.update``, with no place to
      compress or count them, and model averaging and tfdist's gradient accumulation
      must apply local gradients (`KerasHandoff.keras_local_update`,
      `KerasHandoff.keras_reduce_gradients`).
    - ``keras.Model`` methods: Keras has no strategy callback around ``fit`` nor before
      evaluate/predict/save (model averaging must average first, non-chief workers must
      write elsewhere), and Keras 3 dropped parameter-server ``fit``
      (keras-team/keras#18624; `KerasHandoff.keras_fit_driver`).
    - ``LossScaleOptimizer.check_finite``: decided per replica from local gradients, so
      workers could take different branches around the all-reduce and hang.
    - ``Variable.assign_add``/``assign_sub``: Keras reads then writes, so asynchronous
      parameter-server updates lose increments.

    Args:
        handoff_of: ``f(strategy)``: its `KerasHandoff`, or None.
        model_events: ``{model method: "around" or "before"}``: when the strategy is told.
        fit_driver_methods: The methods a hand-off's ``keras_fit_driver`` replaces, and
            whose calls it may refuse (``keras_check_call``).
        fit_driver: ``f(handoff, method)``: the fit driver's function for ``method``.
    """
    import keras
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    if getattr(keras.Model, "_tfdist_keras_hooks", False):
        return
    _patch_optimizer(TFOptimizer, handoff_of)
    for name, when in model_events.items():
        original = getattr(keras.Model, name)
        setattr(keras.Model, name, _model_method(name, when, original, handoff_of,
                                                 fit_driver_methods, fit_driver))
    _patch_loss_scale_check(handoff_of)
    _patch_atomic_updates(handoff_of)
    keras.Model._tfdist_keras_hooks = True


def _patch_optimizer(TFOptimizer, handoff_of) -> None:
    original_apply = TFOptimizer._backend_apply_gradients
    original_reduce = TFOptimizer._all_reduce_sum_gradients

    reduced_already = set()  # optimizers inside an apply whose gradients are reduced

    def _backend_apply_gradients(self, grads, trainable_variables):
        handoff = _replica_handoff(handoff_of)
        update = handoff.keras_local_update() if handoff else None
        if update is not None:
            return update(self, original_apply, grads, trainable_variables)
        if handoff is None or not handoff.keras_clip_after_reduce:
            return original_apply(self, grads, trainable_variables)
        # Why: Keras 3 clips (``_clip_gradients``) each replica's gradient here, before
        # ``_backend_update_step`` all-reduces; tfdist reduces first so that clipping sees
        # the global-batch gradient, as on one device (and as Keras 2 did).
        variables = list(trainable_variables)
        reduced = handoff.keras_reduce_gradients(list(zip(grads, variables)),
                                                 functools.partial(original_reduce, self))
        reduced_already.add(id(self))
        try:
            return original_apply(self, [g for g, _ in reduced], variables)
        finally:
            reduced_already.discard(id(self))

    def _all_reduce_sum_gradients(self, grads_and_vars):
        handoff = _replica_handoff(handoff_of)
        if handoff is None:
            return original_reduce(self, grads_and_vars)
        if handoff.keras_local_update() is not None or id(self) in reduced_already:
            return list(grads_and_vars)  # applied locally, or reduced before clipping
        return handoff.keras_reduce_gradients(list(grads_and_vars),
                                              functools.partial(original_reduce, self))

    TFOptimizer._backend_apply_gradients = _backend_apply_gradients
    TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients


def _model_method(name, when, original, handoff_of, fit_driver_methods, fit_driver):
    """``keras.Model.<name>`` that follows the model's strategy's hand-off."""

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        handoff = handoff_of(self.distribute_strategy)
        if handoff is None:
            return original(self, *args, **kwargs)
        if handoff.keras_fit_driver and name in fit_driver_methods:
            return fit_driver(handoff, name)(self, *args, **kwargs)
        arguments = None
        if name in fit_driver_methods:
            arguments = _bound_arguments(original, (self, *args), kwargs)
            handoff.keras_check_call(self, name, arguments)
        context = (handoff.keras_fit_context(self, arguments) if name == "fit"
                   else contextlib.nullcontext())
        with context:
            handoff.keras_model_event(self, name, "before")
            if name == "fit" and handoff.keras_fit_initial_epoch(self) is not None:
                kwargs = {**kwargs, "initial_epoch": handoff.keras_fit_initial_epoch(self)}
            if name in SAVE_METHODS and handoff.keras_safe_saves:
                result = save_safely(original, self, args, kwargs)
            else:
                result = original(self, *args, **kwargs)
            if when == "around":
                handoff.keras_model_event(self, name, "after")
        return result

    return method


def _patch_loss_scale_check(handoff_of) -> None:
    import tensorflow as tf
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    original = LossScaleOptimizer.check_finite

    def check_finite(self, grads):
        finite = original(self, grads)
        handoff = _replica_handoff(handoff_of)
        if handoff is None or not handoff.keras_global_finite_check:
            return finite
        not_finite = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(not_finite, 0.0)

    check_finite.__doc__ = original.__doc__
    LossScaleOptimizer.check_finite = check_finite


def _patch_atomic_updates(handoff_of) -> None:
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.tensorflow.core import Variable

    def wrap(name, original):
        def method(self, value):
            handoff = handoff_of(tf.distribute.get_strategy())
            if in_stateless_scope() or handoff is None or not handoff.keras_atomic_updates:
                return original(self, value)
            value = self._convert_to_tensor(value, dtype=self._dtype)
            return getattr(self._value, name)(tf.cast(value, self._value.dtype))

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    Variable.assign_add = wrap("assign_add", Variable.assign_add)
    Variable.assign_sub = wrap("assign_sub", Variable.assign_sub)


def _bound_arguments(function, args, kwargs) -> dict:
    """``{parameter: value}`` of a call, defaults left out."""
    import inspect

    try:
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)
