"""Hooks into Keras' trainer: the private members of ``keras.Model`` that tfdist calls.

Building a model's state from a batch spec, the epoch ``fit`` starts from (resuming from
a backup), the epoch logs and ``evaluate``'s result order (the parameter-server fit
driver), the compiled loss, and whether Keras reduces a strategy's step outputs across
processes. ``tests/test_hooks.py`` fails loudly when a Keras upgrade removes what
they touch.
"""

from __future__ import annotations

def build_keras_state(model, data_spec) -> None:
    """Creates the model's, metrics' and optimizer's variables from a batch's spec.

    Why: steps traced for remote workers must not create variables, so everything has
    to exist on the ps tasks first. Keras' own fit does this with the private
    ``Trainer._symbolic_build(data_batch=...)``, which only needs ``.shape`` and
    ``.dtype`` of each element: a dataset's ``element_spec`` works.
    """
    model._symbolic_build(data_batch=data_spec)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def keras_initial_epoch(model, initial_epoch: int) -> int:
    """The epoch to start from: `BackupAndRestore` stores it in ``model._initial_epoch``.

    Why: Keras' fit reads this private attribute after ``on_train_begin``; a fit driver
    has to do the same for `keras.callbacks.BackupAndRestore` to resume.
    """
    return getattr(model, "_initial_epoch", None) or initial_epoch


def set_initial_epoch(model, epoch: int) -> None:
    """Makes the running ``fit`` start at ``epoch`` (used to resume from a backup).

    Why: Keras 3 has no public way for a callback to move ``fit``'s first epoch; its own
    ``BackupAndRestore`` sets the private ``model._initial_epoch`` in
    ``on_train_begin``, which the TF trainer reads right after
    (``initial_epoch = self._initial_epoch or initial_epoch``).
    """
    model._initial_epoch = int(epoch)


def keras_metrics_or_logs(model, logs):
    """The model's metrics read now, or ``logs`` when a custom step returned other keys.

    Why: Keras' fit uses the private ``Trainer._get_metrics_result_or_logs`` for the
    epoch logs (written for asynchronous steps, where the last step's logs are stale).
    """
    return model._get_metrics_result_or_logs(logs)


def keras_flatten_metrics(model, logs):
    """``evaluate``'s list result in Keras' order.

    Why: the fit driver's ``evaluate`` returns what Keras' own returns; Keras orders it
    with the private ``Trainer._flatten_metrics_in_order``.
    """
    return model._flatten_metrics_in_order(logs)


def keras_uses_multi_worker_path(strategy) -> bool:
    """True if Keras 3 reduces ``strategy``'s step outputs across processes.

    Why: Keras' private ``reduce_per_replica`` averages loss/metrics with
    ``strategy.reduce`` and gathers ``predict`` outputs with ``strategy.gather`` only
    for ``tf.distribute.MultiWorkerMirroredStrategy`` instances whose
    ``extended._in_multi_worker_mode()`` is True; for any other strategy it keeps this
    process's values. `tfdist.HorovodStrategy` subclasses that class for this reason.
    """
    from keras.src.backend.tensorflow import trainer

    return bool(trainer._collective_all_reduce_multi_worker(strategy))


def compiled_loss(model):
    """The loss object of the model's last ``compile`` (None before the first).

    Why: the parameter-server driver is built per compiled model and must be rebuilt
    when the model is compiled again; Keras keeps the compiled loss in the private
    ``_compile_loss``, a new object on each ``compile``.
    """
    return getattr(model, "_compile_loss", None)
