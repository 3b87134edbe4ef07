"""Reference tests of option pairs no other test combined (cited by
`tfdist.strategies.options.pairs`; tests/test_option_pairs.py checks that they exist).

In-process ones run on 2 logical CPUs; the elastic one launches 3 workers.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import assert_weights_close

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)


# ---- the synchronous features ---------------------------------------------------------

def test_sharded_state_with_compression_equals_unsharded(logical_cpus):
    """fp16 on the wire: the sharded step (reduce-scatter) gives the unsharded one's
    weights."""
    import tfdist

    from zero_jobs import train

    for optimizer in ("adam", "sgd"):
        got, _ = train(tfdist.MirroredStrategy(shard_optimizer_state=True, compression="fp16"),
                       optimizer)
        want, _ = train(tfdist.MirroredStrategy(compression="fp16"), optimizer)
        assert_weights_close(got, want)


def _resumes(tmp_path, options, batch):
    """Interrupted after epoch 1 and fitted again by a new model with the same
    ``BackupAndRestore`` (what a restart does): = 2 epochs uninterrupted."""
    import keras

    import tfdist
    from helpers import classification_data

    from zero_jobs import _compiled, train

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    x, y = classification_data(n=64)
    strategy = tfdist.MirroredStrategy(**options)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _compiled(strategy, "adam").fit(
            x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    again = _compiled(strategy, "adam", seed=7)
    again.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert int(again.optimizer.iterations.numpy()) == 2 * 64 // batch // options.get(
        "accumulate_steps", 1)
    straight, _ = train(tfdist.MirroredStrategy(**options), "adam", epochs=2,
                        batch_size=batch)
    assert_weights_close([np.asarray(w) for w in again.get_weights()], straight)


def test_accumulated_training_resumes_from_a_save(logical_cpus, tmp_path):
    """accumulate_steps=2, micro-batch 8: 8 micro-steps an epoch, so a save at an
    epoch's end holds no partial sum."""
    _resumes(tmp_path, {"accumulate_steps": 2}, 8)


def test_a_save_inside_an_accumulation_is_refused(logical_cpus, tmp_path):
    """accumulate_steps=2: a save after micro-step 1 names the partial sums it would
    lose; after micro-step 2 (a boundary) it is taken. A callback saving every 3
    batches is refused before the first step."""
    import keras

    import tfdist
    from helpers import classification_data

    from zero_jobs import _compiled

    x, y = classification_data(n=64)
    strategy = tfdist.MirroredStrategy(accumulate_steps=2)
    saved, refused = [], []

    class SaveEachBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            path = str(tmp_path / f"after-{batch}.weights.h5")
            try:
                self.model.save_weights(path)
                saved.append(batch)
            except ValueError as error:
                refused.append((batch, str(error)))

    model = _compiled(strategy, "adam")
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=4, shuffle=False, verbose=0,
              callbacks=[SaveEachBatch()])
    assert saved == [1, 3]
    assert [b for b, _ in refused] == [0, 2]
    assert "accumulate_steps=2" in refused[0][1] and "Received: a save after micro-step 1" \
        in refused[0][1], refused[0][1]
    again = _compiled(strategy, "adam")
    with pytest.raises(ValueError, match=r"Received: save_freq=3$"):
        again.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"),
                                            save_weights_only=True, save_freq=3)])
    assert int(again.optimizer.iterations.numpy()) == 0


def test_compressed_training_resumes_from_a_save(logical_cpus, tmp_path):
    _resumes(tmp_path, {"compression": "fp16"}, 16)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_lost_worker_in_a_compressed_elastic_job(tmp_path):
    """tests/elastic_job.py with compression='fp16': worker-2 killed in epoch 1; the two
    survivors finish in the same processes, equal, near the single-process reference."""
    import elastic_job
    from helpers import require_horovod
    from test_elastic import EPOCHS

    require_horovod()
    env = dict(os.environ, JOB_HEARTBEAT="5", PYTHONPATH=os.pathsep.join(
        [ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "3", "--min-workers",
         "2", "--timeout", "200", os.path.join(TESTS_DIR, "pair_jobs.py"), "compressed",
         str(tmp_path), str(EPOCHS), "worker-2:1:4"],
        env=env, capture_output=True, text=True, timeout=260)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the elastic job carries on with 2 worker(s)" in done.stderr
    results = {name: json.load(open(tmp_path / f"{name}.json"))
               for name in ("worker-0", "worker-1")}
    assert not (tmp_path / "worker-2.json").exists()
    net = elastic_job.model()  # one process, the same global batch, no compression
    elastic_job.fit(net, EPOCHS)
    for result in results.values():
        assert result["size"] == 2 and result["recoveries"] == 1
        assert result["compression"] == "fp16"
        assert_weights_close([np.array(w) for w in result["weights"]], net.get_weights(),
                             atol=1e-2)
    assert_weights_close([np.array(w) for w in results["worker-0"]["weights"]],
                         [np.array(w) for w in results["worker-1"]["weights"]], atol=0)


# ---- model averaging ------------------------------------------------------------------

def _average_options(*names):
    """Model-averaging options with each named one set (period 4)."""
    import keras

    values = {"warmup_steps": 2, "average_optimizer_state": True, "fragments": 2,
              "sync_delay": 1, "mix": 0.5, "outer_compression": "int8", "compression": "fp16",
              "outer_optimizer": lambda: keras.optimizers.SGD(0.7, momentum=0.9,
                                                              nesterov=True)}
    return dict({name: values[name] for name in names}, period=4)


@pytest.mark.parametrize("a,b", [
    ("warmup_steps", "outer_optimizer"), ("warmup_steps", "average_optimizer_state"),
    ("warmup_steps", "fragments"), ("warmup_steps", "outer_compression"),
    ("warmup_steps", "compression"), ("outer_optimizer", "average_optimizer_state"),
    ("outer_optimizer", "compression"), ("average_optimizer_state", "outer_compression"),
    ("average_optimizer_state", "compression"), ("fragments", "compression"),
    ("sync_delay", "compression"), ("mix", "compression")])
def test_model_average_pair_trains_and_agrees(logical_cpus, a, b):
    """The pair trains (the loss falls), and after ``evaluate`` (which averages first)
    both replicas hold the same weights."""
    import tfdist

    from test_model_average import GLOBAL_BATCH, fit_linear, linear_data, replica_values

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(**_average_options(a, b))
    _, model = fit_linear(strategy, x, y, epochs=3)
    losses = model.history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    for variable in model.trainable_weights:
        copies = replica_values(variable)
        np.testing.assert_allclose(copies[0], copies[1], atol=1e-6)


@pytest.mark.parametrize("option", ["warmup_steps", "average_optimizer_state", "compression"])
def test_model_average_resumes_from_a_save(logical_cpus, tmp_path, option):
    """Fit, ``model.save``, load into a new strategy, fit: the weights and optimizer of
    two fits on one model (5 steps an epoch, period 4: a save mid-period)."""
    import keras

    import tfdist

    from test_model_average import GLOBAL_BATCH, LR, fit_linear, linear_data

    x, y = linear_data(n=80)

    def optimizer():
        return keras.optimizers.SGD(LR, momentum=0.9)

    _, straight = fit_linear(tfdist.ModelAverageStrategy(**_average_options(option)), x, y,
                             epochs=1, optimizer=optimizer)
    straight.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    _, model = fit_linear(tfdist.ModelAverageStrategy(**_average_options(option)), x, y,
                          epochs=1, optimizer=optimizer)
    path = str(tmp_path / "mid_period.keras")
    model.save(path)
    with tfdist.ModelAverageStrategy(**_average_options(option)).scope():
        restored = keras.models.load_model(path)
    restored.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(restored.optimizer.iterations.numpy()) == 10
    assert_weights_close(restored.get_weights(), straight.get_weights(), atol=1e-6)
