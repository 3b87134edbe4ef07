"""Hooks into Keras' optimizer: the private members of its step that tfdist calls or reads.

The step applied by hand in cross-replica context (gradient accumulation, the outer step
of model averaging), the gradients of a step taken instead of applied (parameter-server
steps), the learning-rate variable, gradient clipping and the raw step counter.
``tests/test_hooks.py`` fails loudly when a Keras upgrade removes what they touch.
"""

from __future__ import annotations

import contextlib

def overrides_backend_update_step(optimizer) -> bool:
    """Whether a Keras optimizer class does work outside ``update_step``.

    Why: the outer optimizer of model averaging is stepped in cross-replica context,
    where Keras' ``apply`` cannot run (it needs a replica context); tfdist calls
    ``update_step`` per variable, as ``TFOptimizer._distributed_tf_update_step`` does.
    Optimizers overriding ``_backend_update_step`` (Nadam) would lose that work.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return type(optimizer)._backend_update_step is not TFOptimizer._backend_update_step


def keras_distributed_update(optimizer, distribution, grads, variables) -> None:
    """Applies already-reduced ``grads`` with the Keras optimizer in cross-replica context.

    Why: tfdist's gradient accumulation all-reduces once per k micro-batches inside a
    cross-replica ``cond`` and then needs Keras' per-variable update without its
    all-reduce. That is ``TFOptimizer._distributed_tf_update_step``, a private method.
    """
    optimizer._distributed_tf_update_step(distribution, list(zip(grads, variables)),
                                          optimizer.learning_rate)


@contextlib.contextmanager
def apply_replaced(optimizer, apply):
    """While inside, ``optimizer.apply`` is ``apply`` (for this optimizer only).

    Why: Keras' ``train_step`` hands its gradients straight to ``optimizer.apply``
    (through ``apply_gradients``), with no public point between; a parameter-server
    step needs them without the update (it applies them once, on the ps). Set in the
    instance's ``__dict__``: Keras' attribute tracking (``__setattr__``) would track
    the function.
    """
    optimizer.__dict__["apply"] = apply
    try:
        yield
    finally:
        optimizer.__dict__.pop("apply", None)


def learning_rate_variable(optimizer):
    """The variable (or schedule, or callable) the optimizer keeps its learning rate in.

    Why: the public ``learning_rate`` is the current value (a schedule evaluated now),
    not the object among ``optimizer.variables``; model averaging leaves that variable
    out of the optimizer state it averages. Keras keeps it in ``_learning_rate``.
    """
    return getattr(optimizer, "_learning_rate", None)


def clip_gradients(optimizer, grads):
    """``grads`` clipped as the optimizer's ``clipnorm``/``clipvalue`` say.

    Why: Keras clips inside ``apply`` (private ``_clip_gradients``); gradient
    accumulation applies the summed gradients without ``apply`` and must clip alike.
    """
    return optimizer._clip_gradients(grads)


def undo_step_count(optimizer) -> None:
    """Takes one off the optimizer's raw step counter (``_iterations``).

    Why: Keras' ``apply`` adds 1 to ``_iterations`` after every step; a micro-batch of
    gradient accumulation that applies nothing must not count. The public
    ``iterations`` is derived (divided under Keras' own accumulation), not the variable.
    """
    optimizer._iterations.assign_sub(1)
