"""Saving and restoring models with sharded variables under tfdist.ParameterServerStrategy.

One job (chief + 2 workers + 2 ps, an embedding partitioned in 2, Adam, sync mode so
the result is deterministic) has ps-0 killed mid-fit; `tfdist launch --max-restarts 1`
restarts it and the chief resumes from its BackupAndRestore backup. The restarted chief
also trains the same model uninterrupted (with Keras' own BackupAndRestore and
ModelCheckpoint), and saves the resumed model every way Keras and TF can. Then a plain
process (no strategy, no TF_CONFIG) loads those files, and a job with one ps restores
the 2-ps backups and checkpoint (resharding), side by side. Last, the chief checks that
its saves are atomic and refuse NaN (a save failing midway, a NaN in one shard).
"""

import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, TESTS_DIR, assert_weights_close, run_cluster, serve_ps_from_a_child

pytestmark = pytest.mark.timeout(300)

VOCAB, DIM, N, BATCH, EPOCHS = 100, 8, 128, 16, 4
KILL_EPOCH = 2  # ps-0 dies in the middle of this epoch (0-based), after 2 backups


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(N, 4)).astype("int32")
    y = rng.normal(size=(VOCAB,)).astype("float32")[ids].sum(1, keepdims=True)
    return ids, y


def _model(seed=2):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, DIM), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def _strategy():
    import tensorflow as tf

    import tfdist

    # As in TF's tutorial: as many shards as ps tasks (with 1 ps, one shard).
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256, max_shards=len(tfdist.ClusterSpec.from_env().ps))
    return tfdist.ParameterServerStrategy(variable_partitioner=partitioner, mode="sync")


def _fit(model, callbacks):
    ids, y = _data()
    return model.fit(ids, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     callbacks=callbacks)


def _state(model):
    """Weights and optimizer variables as numpy arrays."""
    return {"weights": [np.asarray(w) for w in model.get_weights()],
            "optimizer": [np.asarray(v) for v in model.optimizer.variables]}


def _shards(model):
    embeddings = model.layers[0].embeddings
    return [v.device for v in getattr(embeddings.value, "variables", [embeddings.value])]


def _zero(model):
    for v in model.weights + model.optimizer.variables:
        v.assign(np.zeros(v.shape, v.dtype))


def _paths(work_dir):
    names = ("backup", "keras_backup", "checkpoints", "model.keras", "model.weights.h5",
             "ckpt")
    return {name: os.path.join(work_dir, name) for name in names}


# ---- the 2-ps job: killed, resumed, compared with an uninterrupted run, saved -------------

def _two_ps_task(work_dir):
    task = os.environ["TFDIST_TASK"]
    attempt = int(os.environ["TFDIST_RESTART"])
    if task == "ps-0" and attempt == 0:
        # Its TF server runs in a child process that the chief kills.
        serve_ps_from_a_child(os.path.join(work_dir, "ps-0.pid"))
        return None

    import keras
    import tensorflow as tf

    from tfdist.keras.callbacks import BackupAndRestore, ModelCheckpoint

    strategy = _strategy()
    paths = _paths(work_dir)

    class KillPs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if attempt == 0 and self._epoch == KILL_EPOCH and batch == 1:
                with open(os.path.join(work_dir, "ps-0.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

    with strategy.scope():
        model = _model()
    backup = BackupAndRestore(paths["backup"], delete_checkpoint=False)
    history = _fit(model, [backup, KillPs()])  # attempt 0 raises when ps-0 dies
    out = {"attempt": attempt, "epochs": history.epoch, "shards": _shards(model),
           "iterations": int(model.optimizer.iterations.numpy()), "resumed": _state(model)}

    # The same training uninterrupted, with Keras' own callbacks and tfdist's checkpoint.
    with strategy.scope():
        reference = _model()
    out["initial"] = [np.asarray(w) for w in reference.get_weights()]
    _fit(reference, [
        keras.callbacks.BackupAndRestore(paths["keras_backup"], delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(os.path.join(paths["checkpoints"], "m-{epoch}.keras")),
        ModelCheckpoint(os.path.join(paths["checkpoints"], "w-{epoch}.weights.h5"),
                        save_weights_only=True)])
    out["reference"] = _state(reference)

    # Every way to save; then each read back into this cluster (after zeroing).
    model.save(paths["model.keras"])
    model.save_weights(paths["model.weights.h5"])
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.write(paths["ckpt"])
    _zero(model)
    model.load_weights(paths["model.weights.h5"])
    out["load_weights"] = _state(model)
    _zero(model)
    checkpoint.read(paths["ckpt"]).assert_consumed()
    out["checkpoint"] = _state(model)
    out["safety"] = _save_safely(model, os.path.join(work_dir, "safety"))
    return out


def _save_safely(model, directory):
    """Saves that fail midway, then saves of NaN weights; the first files must stay."""
    import keras

    os.makedirs(directory)
    paths = [os.path.join(directory, name) for name in ("m.keras", "m.weights.h5")]
    saves = (model.save, model.save_weights)
    for save, path in zip(saves, paths):
        save(path)
    out = {"pid": os.getpid(), "good": [np.asarray(w) for w in model.get_weights()],
           "mid_save": [], "failed": [], "refused": []}
    for v in model.weights:  # written in place, a save failing midway would keep these
        v.assign(np.asarray(v) + 1.0)

    def fail(layer, store):  # the Embedding is written before the Dense layer
        out["mid_save"].append(sorted(os.listdir(directory)))
        raise OSError("disk full")

    original = keras.layers.Dense.save_own_variables
    keras.layers.Dense.save_own_variables = fail
    try:
        for save, path in zip(saves, paths):
            try:
                save(path)
            except OSError as error:
                out["failed"].append(str(error))
    finally:
        keras.layers.Dense.save_own_variables = original
    embeddings = model.layers[0].embeddings
    broken = np.asarray(embeddings)
    broken[-1, 0] = np.nan  # the last row: in the last shard
    embeddings.assign(broken)
    for save, path in zip(saves, paths):
        try:
            save(path)
        except FloatingPointError as error:
            out["refused"].append(str(error))
    out["listing"] = sorted(os.listdir(directory))
    return out


# ---- the 1-ps job: the 2-ps backups and checkpoint restore into one shard -----------------

def _one_ps_task(work_dir):
    import keras
    import tensorflow as tf

    from tfdist.keras.callbacks import BackupAndRestore

    strategy = _strategy()
    paths = _paths(work_dir)
    out = {}
    for name, callback in (
            ("backup", BackupAndRestore(paths["backup"], delete_checkpoint=False)),
            ("keras_backup", keras.callbacks.BackupAndRestore(paths["keras_backup"],
                                                               delete_checkpoint=False))):
        with strategy.scope():
            model = _model(seed=5)  # other initial weights: restoring must change them
        history = _fit(model, [callback])  # the backup is complete: nothing to train
        out[name] = {**_state(model), "epochs": history.epoch, "shards": _shards(model)}
    with strategy.scope():
        model = _model(seed=6)
        model.optimizer.build(model.trainable_variables)  # its variables, on the ps too
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
        paths["ckpt"]).assert_consumed()
    out["checkpoint"] = _state(model)
    return out


# ---- a plain process: no strategy, no TF_CONFIG -------------------------------------------

def _plain_task(work_dir):
    import keras
    import tensorflow as tf

    assert "TF_CONFIG" not in os.environ
    paths = _paths(work_dir)
    out = {}
    loaded = keras.models.load_model(paths["model.keras"])
    out["model.keras"] = _state(loaded)
    out["variable_types"] = sorted({type(v.value).__name__ for v in loaded.weights})
    for name in ("model.weights.h5", "ckpt"):
        model = _model(seed=7)
        model.optimizer.build(model.trainable_variables)
        if name == "ckpt":
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
                paths[name]).assert_consumed()
        else:
            model.load_weights(paths[name])
        out[name] = _state(model)
    out["m-4.keras"] = _state(keras.models.load_model(
        os.path.join(paths["checkpoints"], f"m-{EPOCHS}.keras")))
    model = _model(seed=7)
    model.load_weights(os.path.join(paths["checkpoints"], f"w-{EPOCHS}.weights.h5"))
    out["w-4.weights.h5"] = _state(model)
    safety = os.path.join(work_dir, "safety")
    out["safety/m.keras"] = keras.models.load_model(
        os.path.join(safety, "m.keras")).get_weights()
    model = _model(seed=7)
    model.load_weights(os.path.join(safety, "m.weights.h5"))
    out["safety/m.weights.h5"] = model.get_weights()
    with open(os.path.join(work_dir, "plain.pkl"), "wb") as f:
        pickle.dump(out, f)


def _start_plain_process(work_dir):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", f"import test_ps_save; test_ps_save._plain_task({work_dir!r})"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _assert_same(actual, expected, what):
    for key in ("weights", "optimizer"):
        assert len(actual[key]) == len(expected[key]), (what, key)
        for i, (a, b) in enumerate(zip(actual[key], expected[key])):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"{what} {key} {i}")


@pytest.mark.multiprocess
def test_sharded_model_saves_resumes_after_a_ps_kill_loads_plain_and_reshards(tmp_path):
    work_dir = str(tmp_path)
    two = run_cluster(_two_ps_task, work_dir, workers=2, chief=True, ps=2, max_restarts=1,
                      timeout=240)[0]
    plain = _start_plain_process(work_dir)  # runs beside the 1-ps job
    try:
        one = run_cluster(_one_ps_task, work_dir, workers=1, chief=True, ps=1, timeout=180)[0]
        output, _ = plain.communicate(timeout=180)
    finally:
        plain.kill()
    assert plain.returncode == 0, output[-3000:]
    with open(os.path.join(work_dir, "plain.pkl"), "rb") as f:
        loaded = pickle.load(f)

    # Sharded over both ps; the restarted chief resumed after the two epochs backed up.
    assert sorted(two["shards"]) == ["/job:ps/replica:0/task:0/device:CPU:0",
                                     "/job:ps/replica:0/task:1/device:CPU:0"]
    assert two["attempt"] == 1 and two["epochs"] == [KILL_EPOCH, EPOCHS - 1]
    assert two["iterations"] == EPOCHS * N // BATCH // 2  # sync: 2 batches a step
    resumed, reference = two["resumed"], two["reference"]
    # Killed and resumed (weights and Adam's state from the backup) == uninterrupted.
    _assert_same(resumed, reference, "resumed vs uninterrupted")
    moved = max(np.abs(a - b).max() for a, b in zip(reference["weights"], two["initial"]))
    assert moved > 1e-2  # it really trained
    _assert_same(two["load_weights"], resumed, "load_weights on the cluster")
    _assert_same(two["checkpoint"], resumed, "tf.train.Checkpoint on the cluster")

    # A plain process loads every file as an ordinary model: full tables, optimizer too.
    assert loaded["variable_types"] == ["ResourceVariable"]
    for name in ("model.keras", "model.weights.h5", "ckpt"):
        _assert_same(loaded[name], resumed, f"{name} in a plain process")
    _assert_same(loaded["m-4.keras"], reference, "Keras ModelCheckpoint .keras")
    assert_weights_close(loaded["w-4.weights.h5"]["weights"], reference["weights"])

    # One ps: the 2-ps backups and checkpoint restore into one shard.
    for name, expected in (("backup", resumed), ("keras_backup", reference)):
        assert one[name]["epochs"] == [], name
        assert one[name]["shards"] == ["/job:ps/replica:0/task:0/device:CPU:0"], name
        _assert_same(one[name], expected, f"{name} restored with 1 ps")
    _assert_same(one["checkpoint"], resumed, "tf.train.Checkpoint restored with 1 ps")

    # Saves under the ps strategy are atomic and never hold NaN: a save failing midway
    # wrote a temporary sibling, and neither it nor a refused NaN save (NaN in the
    # second shard) touched the first files.
    safety = two["safety"]
    assert safety["failed"] == ["disk full"] * 2
    assert safety["mid_save"] == [[f".tmp-{safety['pid']}-{name}", "m.keras", "m.weights.h5"]
                                  for name in ("m.keras", "m.weights.h5")]
    assert len(safety["refused"]) == 2, safety["refused"]
    for message in safety["refused"]:
        assert "hold NaN or infinity" in message and "embeddings" in message, message
        assert "The previous file is kept" in message
    assert safety["listing"] == ["m.keras", "m.weights.h5"]
    for name in ("safety/m.keras", "safety/m.weights.h5"):
        assert_weights_close(loaded[name], safety["good"], atol=0)
