"""Checkpoints under tfdist strategies: atomic, never of NaN weights, never a corrupt backup.

- A task killed while saving leaves the previous ``.keras``/``.weights.h5`` readable.
- Weights holding NaN or infinity are refused before anything is written, and
  `StopOnNaN` stops training when a step breaks the weights with a finite loss.
- A truncated or empty backup is named, set aside, and the previous one is used.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import TESTS_DIR, assert_weights_close, classification_data, mlp


def _model(strategy):
    import keras

    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


_SAVE_LOOP = textwrap.dedent("""
    import sys, numpy as np, keras, tfdist
    sys.path.insert(0, {tests!r})
    from helpers import mlp
    strategy = tfdist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(2048),
                                  keras.layers.Dense(2048)])
    path, ready = sys.argv[1], sys.argv[2]
    model.save(path)
    model.save_weights(path.replace(".keras", ".weights.h5"))
    open(ready, "w").close()
    while True:
        model.save(path)
        model.save_weights(path.replace(".keras", ".weights.h5"))
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_kill_mid_save_leaves_the_previous_file_readable(logical_cpus, tmp_path):
    import keras

    path, ready = str(tmp_path / "model.keras"), str(tmp_path / "ready")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for attempt in range(3):  # kill at three different moments of the save loop
        proc = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP.format(tests=TESTS_DIR),
                                 path, ready], env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(ready) and proc.poll() is None:
                assert time.monotonic() < deadline, "the save loop never got ready"
                time.sleep(0.1)
            assert proc.poll() is None, "the save loop exited"
            time.sleep(0.3 + 0.4 * attempt)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.remove(ready)
        loaded = keras.models.load_model(path)  # whole, not truncated
        assert loaded.count_params() == 256 * 2048 + 2048 + 2048 * 2048 + 2048
        loaded.load_weights(path.replace(".keras", ".weights.h5"))


def test_non_finite_weights_are_never_saved(logical_cpus, tmp_path):
    import tfdist

    model = _model(tfdist.MirroredStrategy())
    path = tmp_path / "model.keras"
    model.save(path)
    good = [w.copy() for w in model.get_weights()]
    broken = [w.copy() for w in good]
    broken[0][0, 0] = np.nan
    model.set_weights(broken)
    for save in (lambda: model.save(path), lambda: model.save_weights(tmp_path / "w.weights.h5")):
        with pytest.raises(FloatingPointError, match="hold NaN or infinity") as info:
            save()
        # Issue 39: the previous file is said to be kept only when there is one.
        assert ("The previous file is kept." in str(info.value)) == (
            "model.keras" in str(info.value)), info.value
    import keras

    assert_weights_close(keras.models.load_model(path).get_weights(), good, atol=0)
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]  # no temporary file left


def _save_size_models():
    """Small models of every shape of bookkeeping: configs/horovod.toml's (the digits'
    64 features, Dense 64, 10 logits, Adam: the issue's 79 KB backup), a BatchNormalization
    stack, 24 one-variable layers without an optimizer, and an Embedding with SGD."""
    import keras

    def compiled(model, optimizer):
        model.compile(optimizer, "mse")
        model.optimizer.build(model.trainable_variables)
        return model

    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    yield compiled(keras.Model(inputs, keras.layers.Dense(10)(
        keras.layers.Dense(64, activation="relu")(inputs))), "adam")
    h = inputs = keras.Input((8,))
    for _ in range(8):
        h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(h))
    yield compiled(keras.Model(inputs, h), "adam")
    h = inputs = keras.Input((8,))
    for _ in range(24):
        h = keras.layers.Dense(4, use_bias=False)(h)
    yield keras.Model(inputs, h)
    inputs = keras.Input((4,), dtype="int32")
    yield compiled(keras.Model(inputs, keras.layers.Flatten()(
        keras.layers.Embedding(500, 16)(inputs))), "sgd")


def test_save_size_estimate_is_proportionate(tmp_path):
    """Issue 39: the free space a save needs (`tfdist.files.model_save_size`) is at least
    what Keras writes, in either format, and its bookkeeping at most twice what Keras
    writes besides the values: the issue's 79 KB backup with 98 KB free is not refused
    (the old margin, 4 KiB per variable + 64 KiB, asked for 181 KB)."""
    from tfdist.files import _itemsize, model_save_size

    for index, model in enumerate(_save_size_models()):
        optimizer = getattr(model, "optimizer", None)
        variables = [*model.weights, *(optimizer.variables if optimizer else [])]
        values = sum(int(np.prod(v.shape)) * _itemsize(v) for v in variables)
        estimate = model_save_size(model)
        for name in ("m.weights.h5", "m.keras"):
            path = tmp_path / f"{index}-{name}"
            (model.save_weights if name.endswith(".h5") else model.save)(path)
            written = path.stat().st_size
            assert written <= estimate <= values + 2 * (written - values), (
                index, name, values, written, estimate)
        if index == 0:
            backup = (tmp_path / "0-m.weights.h5").stat().st_size
            assert 75_000 < backup < 85_000 and estimate < 98_000, (backup, estimate)


@pytest.mark.parametrize("name", ["tf_save", "w.weights", "missing/model.keras"])
def test_save_errors_name_the_users_path(logical_cpus, tmp_path, monkeypatch, name):
    """The atomic save writes a temporary sibling; Keras' errors about it (a bad
    extension, a missing directory) still name the path the user gave."""
    import tfdist

    model = _model(tfdist.MirroredStrategy())
    monkeypatch.chdir(tmp_path)
    save = model.save_weights if name.startswith("w.") else model.save
    with pytest.raises((ValueError, OSError)) as raised:
        save(name)
    assert name in str(raised.value) and ".tmp-" not in str(raised.value), raised.value
    assert os.listdir(tmp_path) == []  # no temporary file left


def test_stop_on_nan_catches_broken_weights_with_a_finite_loss(logical_cpus):
    import keras

    import tfdist
    from tfdist.keras.guards import StopOnNaN

    strategy = tfdist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class BreakStatistics(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # training uses batch statistics: the loss stays finite
                moving_mean = self.model.layers[1].moving_mean
                moving_mean.assign(np.full(moving_mean.shape, np.inf, "float32"))

    x, y = classification_data(n=64)
    with pytest.raises(FloatingPointError, match="moving_mean.*in epoch 1"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[BreakStatistics(), StopOnNaN()])


def _backup_run(strategy, backup_dir, epochs=3, interrupt_after=None):
    import keras

    from tfdist.keras.callbacks import BackupAndRestore

    model = _model(strategy)
    callbacks = [BackupAndRestore(str(backup_dir), delete_checkpoint=False)]

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == interrupt_after:
                raise KeyboardInterrupt

    if interrupt_after is not None:
        callbacks.append(Stop())
    x, y = classification_data(n=64)
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=callbacks)
    return model, history


@pytest.mark.parametrize("damage", ["truncated_weights", "empty_state"])
def test_corrupt_backup_is_named_and_the_previous_one_used(logical_cpus, tmp_path, damage,
                                                           caplog):
    import tfdist

    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        _backup_run(tfdist.MirroredStrategy(), backup, interrupt_after=1)  # backups 1, 2
    state = backup / "tfdist_backup.json"
    if damage == "truncated_weights":
        weights = backup / "backup-2.weights.h5"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        state.write_text("")
    with caplog.at_level("WARNING", logger="tfdist"):
        model, history = _backup_run(tfdist.MirroredStrategy(), backup)
    assert "backup" in caplog.text and "is unreadable" in caplog.text, caplog.text
    assert history.epoch == [1, 2]  # resumed from the previous backup (epoch 1 done)
    straight, _ = _backup_run(tfdist.MirroredStrategy(), tmp_path / "straight")
    assert_weights_close(model.get_weights(), straight.get_weights())


def test_unreadable_backups_are_one_error_naming_the_path(logical_cpus, tmp_path):
    import tfdist

    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        _backup_run(tfdist.MirroredStrategy(), backup, interrupt_after=1)
    for name in os.listdir(backup):
        if name.endswith(".h5"):
            (backup / name).write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match=f"no usable backup in {str(backup)!r}"):
        _backup_run(tfdist.MirroredStrategy(), backup)


def test_complete_backup_says_so(logical_cpus, tmp_path, caplog):
    import tfdist

    backup = tmp_path / "backup"
    _backup_run(tfdist.MirroredStrategy(), backup, epochs=2)
    with caplog.at_level("WARNING", logger="tfdist"):
        _, history = _backup_run(tfdist.MirroredStrategy(), backup, epochs=2)
    assert history.epoch == []
    assert "already complete" in caplog.text, caplog.text
