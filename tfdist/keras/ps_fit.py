"""Keras 3 ``fit``/``evaluate``/``predict`` for `tfdist.ParameterServerStrategy`.

Keras 3 dropped parameter-server support (keras-team/keras#18624). For a model built
under a `tfdist.ParameterServerStrategy`, ``model.fit`` and friends are routed here (see
`tfdist.keras.handoff.KerasHandoff.keras_fit_driver`) and run on the chief.

The loops of ``fit``/``evaluate``/``predict`` live here; what the workers read is
`tfdist.keras.ps_input`, and the remote step functions and their dispatch are
`tfdist.keras.ps_steps`:

* ``fit`` runs the model's own ``train_step`` on the workers, ``steps_per_dispatch``
  steps at a time; callbacks, History and the progress bar get values fetched from the
  workers after each dispatch, and the epoch's metrics read from the ps at its end;
* ``evaluate`` and ``predict`` send each batch to a free worker, so every batch is seen
  exactly once.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import tensorflow as tf

from tfdist._hooks import keras_trainer
from tfdist._hooks.coordinator import create_per_worker_iterators
from tfdist.keras.ps_input import TrainInput, _cardinality, _chief_dataset, _is_dataset, \
    _is_dataset_fn
from tfdist.keras.ps_steps import _driver, _fetch, _is_worker_lost, _join, _to_python

_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


class ParameterServerUnavailableError(RuntimeError):
    """A parameter server failed: its variables are gone, training cannot go on.

    Restart the job (``tfdist launch --max-restarts N``) and resume from the chief's
    checkpoint (for example with `keras.callbacks.BackupAndRestore`).
    """


@contextlib.contextmanager
def _clear_ps_errors(strategy):
    """Turns the coordinator's "ps unavailable" errors into one clear error."""
    try:
        yield
    except tf.errors.UnavailableError as error:
        tasks = sorted({f"ps-{t}" for t in _PS_TASK.findall(str(error))})
        if not tasks and _is_worker_lost(error):
            raise  # a worker's, which TF did not handle: not a ps failure
        which = ", ".join(tasks) if tasks else "a parameter server (or the connection to it)"
        raise ParameterServerUnavailableError(
            f"{which} became unavailable during training; the variables it held are lost. "
            "Restart the job (e.g. `tfdist launch --max-restarts 1 ...`) and resume from the "
            "chief's checkpoint (keras.callbacks.BackupAndRestore or tf.train.Checkpoint). "
            f"Cause: {type(error).__name__}: {str(error).splitlines()[0][:300]}") from error


def _callback_list(model, callbacks, verbose, epochs, steps, history):
    import keras

    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks, add_history=history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model)


def _dispatch_size(model, strategy, default):
    if strategy.steps_per_dispatch is not None:
        return strategy.steps_per_dispatch
    spe = getattr(model, "steps_per_execution", 1) or 1
    return spe if spe > 1 else default



def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`keras.Model.fit` on a parameter-server cluster (same arguments)."""
    strategy = model.distribute_strategy
    if not model.compiled:
        raise ValueError("You must call `compile()` before calling `fit()`.")
    if validation_split:
        raise ValueError("validation_split is not supported with ParameterServerStrategy; "
                         f"pass validation_data. Received: validation_split={validation_split}")
    if class_weight is not None:
        raise ValueError("class_weight is not supported with ParameterServerStrategy; use "
                         "sample weights in the dataset. Received: class_weight="
                         f"{class_weight!r}")
    data = TrainInput(strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
    driver = _driver(model)
    driver.ensure_built(data.element_spec)
    steps = data.steps_per_epoch
    default_dispatch = 4 * strategy.num_workers if strategy.mode == "async" else 1
    dispatch = _dispatch_size(model, strategy, default_dispatch)
    callbacks = _callback_list(model, callbacks, verbose, epochs, steps, history=True)

    with _clear_ps_errors(strategy):
        iterator = create_per_worker_iterators(driver.coordinator, data.dataset_fns)
        model.stop_training = False
        callbacks.on_train_begin()
        initial_epoch = keras_trainer.keras_initial_epoch(model, initial_epoch)
        logs, training_logs = {}, None
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            # The next dispatch is queued before the last one's logs are fetched, so the
            # workers never wait for the chief.
            step, pending = 0, None
            while step < steps:
                count = min(dispatch, steps - step)
                if pending is None:
                    callbacks.on_train_batch_begin(step)
                handle = driver.start_train_steps(iterator, count)
                if pending is not None:
                    logs = driver.finish_train_steps(pending[1])
                    callbacks.on_train_batch_end(pending[0], logs)
                    if model.stop_training:
                        pending = None
                        break
                    callbacks.on_train_batch_begin(step)
                pending = (step + count - 1, handle)
                step += count
            if pending is not None:
                logs = driver.finish_train_steps(pending[1])
                callbacks.on_train_batch_end(pending[0], logs)
            _join(strategy)
            epoch_logs = _to_python(keras_trainer.keras_metrics_or_logs(model, logs))
            if validation_data is not None and _should_eval(epoch, validation_freq):
                val_x, val_y, val_sw = _unpack(validation_data)
                val_logs = evaluate(model, val_x, val_y, sample_weight=val_sw,
                                    batch_size=validation_batch_size or batch_size,
                                    steps=validation_steps, callbacks=callbacks,
                                    return_dict=True)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            if model.stop_training:
                break
        if epochs > 0 and model.optimizer is not None:
            model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=training_logs)
    return model.history


def _unpack(validation_data):
    if _is_dataset(validation_data) or _is_dataset_fn(validation_data):
        return validation_data, None, None
    if isinstance(validation_data, (list, tuple)) and len(validation_data) in (2, 3):
        parts = tuple(validation_data) + (None,) * (3 - len(validation_data))
        return parts
    raise ValueError("validation_data must be a dataset, a dataset function, or a tuple "
                     f"(x, y) or (x, y, sample_weight). Received: {type(validation_data)}")


def _should_eval(epoch, validation_freq):
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return (epoch + 1) in validation_freq


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """`keras.Model.evaluate` on a parameter-server cluster: each batch runs once, on a
    free worker."""
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    strategy = model.distribute_strategy
    if not model.compiled:
        raise ValueError("You must call `compile()` before calling `evaluate()`.")
    dataset = _chief_dataset(strategy, x, y, sample_weight, batch_size, steps)
    driver = _driver(model)
    driver.ensure_built(dataset.element_spec)
    num_batches = _cardinality(dataset)
    callbacks = _callback_list(model, callbacks, verbose, 1,
                               num_batches if num_batches > 0 else None, history=False)
    test_fn = driver.test_function()
    window = 4 * strategy.num_workers
    logs = {}
    with _clear_ps_errors(strategy):
        model.reset_metrics()
        callbacks.on_test_begin()
        pending = []
        for step, batch in enumerate(dataset):
            if not pending:
                callbacks.on_test_batch_begin(step)
            pending.append(driver.coordinator.schedule(test_fn, args=(batch,)))
            if len(pending) == window:
                logs = _to_python(_fetch(strategy, pending[-1])) or logs
                callbacks.on_test_batch_end(step, logs)
                pending = []
        if pending:
            logs = _to_python(_fetch(strategy, pending[-1])) or logs
            callbacks.on_test_batch_end(step, logs)
        _join(strategy)
        logs = _to_python(keras_trainer.keras_metrics_or_logs(model, logs))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return keras_trainer.keras_flatten_metrics(model, logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`keras.Model.predict` on a parameter-server cluster; outputs keep the input order."""
    strategy = model.distribute_strategy
    dataset = _chief_dataset(strategy, x, None, None, batch_size, steps)
    driver = _driver(model)
    if not model.built:
        with strategy.scope():
            keras_trainer.build_keras_state(model, dataset.element_spec)
    num_batches = _cardinality(dataset)
    callbacks = _callback_list(model, callbacks, verbose, 1,
                               num_batches if num_batches > 0 else None, history=False)
    predict_fn = driver.predict_function()
    outputs = []
    with _clear_ps_errors(strategy):
        callbacks.on_predict_begin()
        remote = []
        for step, batch in enumerate(dataset):
            callbacks.on_predict_batch_begin(step)
            remote.append((step, batch, driver.coordinator.schedule(predict_fn, args=(batch,))))
        for step, batch, value in remote:
            def retry(batch=batch):
                return driver.coordinator.schedule(predict_fn, args=(batch,))

            batch_outputs = tf.nest.map_structure(np.asarray, _fetch(strategy, value, retry))
            callbacks.on_predict_batch_end(step, {"outputs": batch_outputs})
            outputs.append(batch_outputs)
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("predict got no data: the input is empty.")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)
