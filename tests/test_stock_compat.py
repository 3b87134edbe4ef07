"""Code written for stock tf.distribute and Keras runs with only the strategy changed.

- No TF_CONFIG: a multi-worker strategy is one worker, as in TF.
- Mixed precision (``mixed_float16``/``mixed_bfloat16`` policies, explicit
  ``LossScaleOptimizer``) under every strategy; a step that overflows on one worker
  only is skipped by all of them (stock Keras decides per worker and hangs).
- Keras' own ``BackupAndRestore``, ``ModelCheckpoint``, ``CSVLogger`` and ``TensorBoard``
  on several workers: the chief writes the real paths, the others temporary ones.
- A global batch that does not split over the replicas fails before the first step
  (fit's training and validation data, evaluate).
"""

import logging
import os
import signal

import numpy as np
import pytest

from helpers import (assert_weights_close, classification_data, mlp, require_horovod,
                     run_cluster, run_horovod)

GLOBAL_BATCH = 16
LR = 0.1
POLICIES = ("mixed_float16", "explicit_loss_scale", "mixed_bfloat16")


def _compile(model, wrap_loss_scale=False):
    import keras

    optimizer = keras.optimizers.SGD(LR)
    if wrap_loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _fit(model, x, y, epochs=2, **kwargs):
    return model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
                     **kwargs)


def _fit_with_policy(strategy, policy, x, y):
    """Fits the test MLP under ``policy`` (or an explicit LossScaleOptimizer)."""
    import keras

    keras.mixed_precision.set_global_policy(
        "float32" if policy == "explicit_loss_scale" else policy)
    try:
        with strategy.scope():
            model = _compile(mlp(), wrap_loss_scale=policy == "explicit_loss_scale")
        history = _fit(model, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, history


def _fit_overflowing_on_one_worker(strategy):
    """mixed_float16 where only the second half of the first global batch (worker-1's
    share) overflows: every worker must skip that step together, not hang."""
    x, y = classification_data(n=64)
    x[8:16] *= 3e4
    model, history = _fit_with_policy(strategy, "mixed_float16", x, y)
    return {"weights": model.get_weights(), "loss": history.history["loss"],
            "iterations": int(model.optimizer.iterations.numpy()),
            "scale": float(model.optimizer.dynamic_scale.numpy())}


def _assert_overflow_skipped_together(results):
    first, second = results
    assert first["iterations"] == second["iterations"] == 2 * (64 // GLOBAL_BATCH - 1)
    assert first["scale"] == second["scale"]
    assert_weights_close(first["weights"], second["weights"], atol=0)


def _replica_copies(variable):
    import tensorflow as tf

    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return [np.asarray(v) for v in value.values]
    return [np.asarray(value)]


def _assert_replicas_equal(model):
    for variable in model.weights:
        copies = _replica_copies(variable)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)


def _reference_weights(x, y, epochs):
    return _fit(_compile(mlp()), x, y, epochs=epochs).model.get_weights()


# ---- 1: no TF_CONFIG -------------------------------------------------------------------


def test_no_tf_config_is_one_worker(logical_cpus, monkeypatch, caplog):
    import tfdist

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with caplog.at_level(logging.INFO, logger="tfdist"):
        strategy = tfdist.MultiWorkerMirroredStrategy()
    assert "TF_CONFIG is not set" in caplog.text
    assert (strategy.num_workers, strategy.is_chief, strategy.task_name) == (1, True, "worker-0")
    assert strategy.num_replicas_in_sync == 1
    assert not strategy.extended._in_multi_worker_mode()
    x, y = classification_data(n=64)
    with strategy.scope():
        model = _compile(mlp())
    _fit(model, x, y)
    assert_weights_close(model.get_weights(), _reference_weights(x, y, epochs=2))


def test_explicit_env_still_requires_tf_config(monkeypatch):
    import tfdist

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        tfdist.MultiWorkerMirroredStrategy(cluster_resolver="env")


# ---- 2: mixed precision ------------------------------------------------------------------


def _make_strategy(name):
    import tfdist

    if name == "horovod":
        require_horovod()
        return tfdist.HorovodStrategy()
    if name == "multi_worker":
        os.environ.pop("TF_CONFIG", None)
        return tfdist.MultiWorkerMirroredStrategy()
    return {"mirrored": tfdist.MirroredStrategy,
            "model_average": lambda: tfdist.ModelAverageStrategy(period=3)}[name]()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["mirrored", "multi_worker", "model_average", "horovod"])
def test_mixed_precision_fits(logical_cpus, name, policy):
    strategy = _make_strategy(name)
    x, y = classification_data(n=64)
    model, history = _fit_with_policy(strategy, policy, x, y)
    assert np.isfinite(history.history["loss"]).all()
    if policy != "mixed_bfloat16":
        assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    assert int(model.optimizer.iterations.numpy()) == 2 * 64 // GLOBAL_BATCH
    _assert_replicas_equal(model)


def test_model_average_loss_scale_equals_its_inner_optimizer(logical_cpus):
    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=3)
    x, y = classification_data(n=64)
    plain, _ = _fit_with_policy(strategy, "float32", x, y)
    scaled, _ = _fit_with_policy(strategy, "explicit_loss_scale", x, y)
    # 8 steps: averages at 3 and 6, and the forced one as fit returns.
    assert strategy.average(scaled) is False  # fit already averaged
    _assert_replicas_equal(scaled)
    assert_weights_close(scaled.get_weights(), plain.get_weights(), atol=1e-5)


# ---- 4: a global batch that does not split -------------------------------------------------


UNEVEN_SOURCES = ("arrays", "dataset", "validation", "validation_dataset", "evaluate",
                  "evaluate_dataset")


@pytest.mark.parametrize("source", UNEVEN_SOURCES)
def test_uneven_global_batch_fails_before_the_first_step(logical_cpus, source):
    import keras
    import tensorflow as tf

    import tfdist

    strategy = tfdist.MirroredStrategy()
    x, y = classification_data(n=64)
    with strategy.scope():
        model = _compile(mlp())
    steps = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps.append(("train", batch))

        def on_test_batch_begin(self, batch, logs=None):
            steps.append(("test", batch))

    kwargs = {"verbose": 0, "callbacks": [Steps()]}
    by_15 = tf.data.Dataset.from_tensor_slices((x, y)).batch(15)
    calls = {
        "arrays": lambda: model.fit(x, y, batch_size=15, **kwargs),
        "dataset": lambda: model.fit(by_15, **kwargs),
        "validation": lambda: model.fit(x, y, batch_size=16, validation_data=(x, y),
                                        validation_batch_size=7, **kwargs),
        "validation_dataset": lambda: model.fit(x, y, batch_size=16, validation_data=by_15,
                                                **kwargs),
        "evaluate": lambda: model.evaluate(x, y, batch_size=15, **kwargs),
        "evaluate_dataset": lambda: model.evaluate(by_15, **kwargs)}
    name = {"validation": "validation_batch_size=7",
            "validation_dataset": "validation_batch_size=15"}.get(source, "batch_size=15")
    with pytest.raises(ValueError, match=f"Received: {name} for 2 replicas"):
        calls[source]()
    assert steps == []  # not one training or evaluation step ran
    assert int(model.optimizer.iterations.numpy()) == 0
    # A partial last batch is fine (as in TF): 70 = 4 x 16 + 6.
    x, y = classification_data(n=70)
    model.fit(x, y, batch_size=16, validation_data=(x, y), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 5
    model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0)


def test_batch_size_of_a_dataset():
    import tensorflow as tf

    from tfdist._hooks.tf import dataset_batch_size

    data = tf.data.Dataset.range(10)
    assert dataset_batch_size(data.batch(4).prefetch(1)) == 4
    assert dataset_batch_size(data) is None


# ---- 3: Keras' own callbacks on several workers ------------------------------------------


def _keras_callbacks(out_dir):
    import keras

    return [keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
            keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "model-{epoch}.keras")),
            keras.callbacks.CSVLogger(os.path.join(out_dir, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(out_dir, "tensorboard"))]


def _multi_worker_task(out_dir):
    """Keras' callbacks as in TF's tutorial, worker-1 killed once; then mixed precision."""
    import keras

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy()
    me, restart = os.environ["TFDIST_TASK"], int(os.environ["TFDIST_RESTART"])
    x, y = classification_data(n=64)
    with strategy.scope():
        model = _compile(mlp())

    class KillWorker1(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if restart == 0 and me == "worker-1" and self.epoch == 1 and batch == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    history = _fit(model, x, y, epochs=3, callbacks=[*_keras_callbacks(out_dir), KillWorker1()])
    out = {"restart": restart, "weights": model.get_weights(), "epochs": history.epoch,
           "mixed": {}}
    for policy in POLICIES[:2]:
        mixed, mixed_history = _fit_with_policy(strategy, policy, x, y)
        out["mixed"][policy] = (mixed.get_weights(), mixed_history.history["loss"])
    out["overflow"] = _fit_overflowing_on_one_worker(strategy)
    if strategy.is_chief:
        out["reference"] = _reference_weights(x, y, epochs=3)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_keras_callbacks_on_two_workers_resume_after_a_kill(tmp_path):
    import keras

    out_dir, task_tmp = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    task_tmp.mkdir()
    chief, other = run_cluster(_multi_worker_task, str(out_dir), timeout=280, stream=None,
                               max_restarts=1, env={"TMPDIR": str(task_tmp)})
    assert chief["restart"] == other["restart"] == 1
    assert chief["epochs"] == other["epochs"] == [1, 2]  # resumed after epoch 0's backup
    assert_weights_close(chief["weights"], other["weights"], atol=0)
    assert_weights_close(chief["weights"], chief["reference"])
    for policy, (weights, losses) in chief["mixed"].items():
        assert np.isfinite(losses).all(), policy
        assert_weights_close(weights, other["mixed"][policy][0], atol=0)
    # The chief wrote the real paths, and only it; no temporary path remains.
    assert os.listdir(task_tmp) == []
    assert not (out_dir / "backup").exists()  # Keras deletes it when training ends
    assert sorted(os.listdir(out_dir)) == ["log.csv", "model-1.keras", "model-2.keras",
                                           "model-3.keras", "tensorboard"]
    assert os.listdir(out_dir / "tensorboard" / "train")
    rows = (out_dir / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,") and [r.split(",")[0] for r in rows[1:]] == ["1", "2"]
    loaded = keras.models.load_model(out_dir / "model-3.keras")
    assert_weights_close(loaded.get_weights(), chief["weights"], atol=0)
    _assert_overflow_skipped_together([chief["overflow"], other["overflow"]])


def _model_average_task(out_dir):
    """Keras' callbacks under 2-worker model averaging, and a LossScaleOptimizer."""
    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=3)
    x, y = classification_data(n=64)
    with strategy.scope():
        model = _compile(mlp())
    _fit(model, x, y, epochs=2, callbacks=_keras_callbacks(out_dir))
    plain, _ = _fit_with_policy(strategy, "float32", x, y)
    scaled, _ = _fit_with_policy(strategy, "explicit_loss_scale", x, y)
    return {"weights": model.get_weights(), "plain": plain.get_weights(),
            "scaled": scaled.get_weights(),
            "replicas": [_replica_copies(v)[0] for v in scaled.trainable_weights],
            "overflow": _fit_overflowing_on_one_worker(strategy)}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_keras_callbacks_and_loss_scale_under_model_average_on_two_workers(tmp_path):
    out_dir, task_tmp = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    task_tmp.mkdir()
    chief, other = run_cluster(_model_average_task, str(out_dir), timeout=280, stream=None,
                               env={"TMPDIR": str(task_tmp)})
    assert_weights_close(chief["weights"], other["weights"], atol=0)
    assert_weights_close(chief["scaled"], chief["plain"], atol=1e-5)
    assert_weights_close(chief["replicas"], other["replicas"], atol=0)
    _assert_overflow_skipped_together([chief["overflow"], other["overflow"]])
    assert os.listdir(task_tmp) == []
    assert sorted(os.listdir(out_dir)) == ["log.csv", "model-1.keras", "model-2.keras",
                                           "tensorboard"]


def horovod_callbacks_task(out_dir):
    """Under horovodrun: Keras' callbacks and mixed precision with HorovodStrategy."""
    import tfdist

    strategy = tfdist.HorovodStrategy()
    x, y = classification_data(n=64)
    with strategy.scope():
        model = _compile(mlp())
    _fit(model, x, y, epochs=2, callbacks=_keras_callbacks(out_dir))
    mixed, history = _fit_with_policy(strategy, "mixed_float16", x, y)
    return {"weights": model.get_weights(), "mixed": mixed.get_weights(),
            "loss": history.history["loss"]}


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_keras_callbacks_and_mixed_precision_under_horovod(tmp_path):
    require_horovod()
    out_dir, task_tmp = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    task_tmp.mkdir()
    first, second = run_horovod(horovod_callbacks_task, str(out_dir), timeout=250,
                                env={"TMPDIR": str(task_tmp)})
    assert_weights_close(first["weights"], second["weights"], atol=0)
    assert_weights_close(first["mixed"], second["mixed"], atol=0)
    assert np.isfinite(first["loss"]).all()
    assert os.listdir(task_tmp) == []
    assert sorted(os.listdir(out_dir)) == ["log.csv", "model-1.keras", "model-2.keras",
                                           "tensorboard"]


def _parameter_server_task(mode):
    """Mixed precision under one parameter-server ``mode``, in one cluster."""
    import tfdist

    strategy = tfdist.ParameterServerStrategy(mode=mode)
    x, y = classification_data(n=64)
    out = {}
    for policy in POLICIES:
        model, history = _fit_with_policy(strategy, policy, x, y)
        out[policy] = {"loss": history.history["loss"],
                       "optimizer": type(model.optimizer).__name__,
                       "iterations": int(model.optimizer.iterations.numpy())}
    if mode == "sync":
        out["overflow"] = _fit_overflowing_on_one_worker(strategy)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_mixed_precision_under_parameter_server(mode):
    # One strategy per process (its constructor blocks on workers and ps): a cluster
    # per mode. One worker, so a sync step reads one batch, like an async step.
    chief = run_cluster(_parameter_server_task, mode, workers=1, chief=True, ps=1,
                        timeout=280)[0]
    overflow = chief.pop("overflow", None)
    if mode == "sync":
        # The first batch overflows in both epochs: two skipped steps, the scale halved
        # twice from Keras' 2**15, and no update of the inner optimizer.
        assert overflow["iterations"] == 2 * (64 // GLOBAL_BATCH - 1), overflow
        assert overflow["scale"] == 2.0 ** 13, overflow
    for policy, result in chief.items():
        assert np.isfinite(result["loss"]).all(), (policy, result)
        assert result["iterations"] == 2 * 64 // GLOBAL_BATCH, (policy, result)
        if policy != "mixed_bfloat16":
            assert result["optimizer"] == "LossScaleOptimizer"
