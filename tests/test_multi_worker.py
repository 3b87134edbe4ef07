"""tfdist.MultiWorkerMirroredStrategy: 2 workers on localhost, started by tfdist.launch.

Each launched job checks several things at once (starting a cluster costs ~10 s here):
- training: weights equal on both workers and to one process with the same global
  batch; loss/metrics equal on both workers; evaluate/predict equal to the reference;
- input: every sample id exactly once per epoch (numpy and tf.data), no auto-shard spam;
- faults: missing, frozen and killed peers end the job with the right error;
- resume: a worker killed in epoch 2 and a relaunch end at the uninterrupted weights,
  and the chief-aware callbacks write only the chief's paths.
"""

import io
import json
import os
import re
import signal
import time

import numpy as np
import pytest

from helpers import (RESULT_DIR_MARK, assert_no_leftover_processes, assert_weights_close,
                     classification_data, kill_worker_1, mlp, run_cluster)

GLOBAL_BATCH = 16
N_IDS = 48


# ---- code run inside the tasks (module level, so the tasks import it) ---------------------


def _compile(model, optimizer):
    import keras

    opt = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
           "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer]()
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def _fit(strategy, x, y, optimizer, use_dataset, epochs=2):
    """Trains the test MLP; strategy None is the single-process reference."""
    import tensorflow as tf

    if strategy is not None:
        with strategy.scope():
            model = mlp()
            _compile(model, optimizer)
    else:
        model = mlp()
        _compile(model, optimizer)
    if use_dataset:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        history = model.fit(data, epochs=epochs, verbose=0)
        ev = model.evaluate(data, verbose=0)
    else:
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False,
                            verbose=0)
        ev = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    pred = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    return {"weights": model.get_weights(), "history": history.history, "eval": ev,
            "pred": pred}


def _ids_seen(strategy):
    """Sample ids each epoch's training steps consumed on this worker."""
    import keras
    import tensorflow as tf

    ids = np.arange(N_IDS, dtype="float32")[:, None]
    seen, per_epoch = [], []

    def record(t):
        seen.extend(int(v) for v in t.numpy().ravel())
        return 0

    class Recorder(keras.Model):
        def train_step(self, data):
            tf.py_function(record, [data[0][:, 0]], [tf.int32])
            return super().train_step(data)

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch.append(sorted(seen))
            seen.clear()

    inputs = keras.Input((1,))
    with strategy.scope():
        model = Recorder(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse")
    # numpy, shuffled by Keras with no seed set by the user.
    model.fit(ids, ids, batch_size=8, epochs=2, shuffle=True, verbose=0,
              callbacks=[Snapshot()])
    # tf.data, shuffled with a seed, reshuffled every epoch.
    data = tf.data.Dataset.from_tensor_slices((ids, ids)).shuffle(N_IDS, seed=3).batch(8)
    model.fit(data, epochs=2, verbose=0, callbacks=[Snapshot()])
    # tf.data shuffled with no seed, as in TF's multi-worker tutorial.
    data = tf.data.Dataset.from_tensor_slices((ids, ids)).shuffle(N_IDS).batch(8)
    model.fit(data, epochs=2, verbose=0, callbacks=[Snapshot()])
    return per_epoch


def _train_task(engine="auto"):
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(startup_timeout=60, collective_timeout=120,
                                                  engine=engine)
    out = {"engine": strategy.engine, "task": strategy.task_name, "chief": strategy.is_chief,
           "replicas": strategy.num_replicas_in_sync, "seed": strategy.shared_seed}
    out["ids"] = _ids_seen(strategy)  # first: no seed set yet
    x, y = classification_data(n=64)
    for name, optimizer, use_dataset in (("sgd_numpy", "sgd", False),
                                         ("adam_dataset", "adam", True)):
        out[name] = _fit(strategy, x, y, optimizer, use_dataset)
        if strategy.is_chief:
            out[name + "_ref"] = _fit(None, x, y, optimizer, use_dataset)
    return out


def _write(result_dir, name, text):
    path = os.path.join(result_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _tf_config_resolver():
    import tensorflow as tf

    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def _fault_task(result_dir, mode, victim):
    """``mode``: "missing", "stop" (SIGSTOP), "freeze" (SIGSTOP, default collective
    timeout: the heartbeat catches it) or "kill" (SIGKILL) for task ``victim``."""
    import tfdist

    me = os.environ["TFDIST_TASK"]
    _write(result_dir, f"{me}.pid", str(os.getpid()))
    if mode == "missing" and me == victim:
        return "absent"
    if mode == "kill" and me != victim:
        # Let the survivor show it stops by itself: the launcher's SIGTERM is ignored,
        # its SIGKILL after the grace period is not. A killed non-leader is noticed
        # when its heartbeats stop (heartbeat_timeout); a killed leader at once.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Each fault also exercises another cluster source.
    source = {"missing": lambda: tfdist.ClusterSpec.from_env(),
              "stop": lambda: _tf_config_resolver(),
              "freeze": lambda: None,
              "kill": lambda: tfdist.ClusterSpec.from_env().to_dict()}[mode]()
    try:
        # engine="tf": TF's coordination service and collective timeouts are what these
        # faults check (engine="horovod": tests/test_engines.py).
        strategy = tfdist.MultiWorkerMirroredStrategy(
            source, engine="tf", startup_timeout=5 if mode == "missing" else 60,
            collective_timeout={"stop": 5, "freeze": None}.get(mode, 120),
            heartbeat_timeout={"stop": 120, "kill": 3, "freeze": 5}.get(mode, 10))
        import keras

        x, y = classification_data(n=64)
        with strategy.scope():
            model = mlp()
            _compile(model, "sgd")

        class Fault(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if me == victim and self._epoch == 1 and batch == 1:
                    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)

            def on_epoch_begin(self, epoch, logs=None):
                self._epoch = epoch

        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, verbose=0, callbacks=[Fault()])
    except Exception as error:
        _write(result_dir, f"{me}.error", f"{type(error).__name__}: {error}")
        if mode == "missing":
            return "error"
        raise
    return "finished"


def _resume_task(out_dir):
    import tfdist
    from tfdist.keras import callbacks as cbs

    strategy = tfdist.MultiWorkerMirroredStrategy(startup_timeout=60, collective_timeout=120)
    me, restart = os.environ["TFDIST_TASK"], int(os.environ["TFDIST_RESTART"])
    x, y = classification_data(n=64)
    with strategy.scope():
        model = mlp()
        _compile(model, "sgd")
    written = []

    class SpyCheckpoint(cbs.ModelCheckpoint):
        def _get_file_path(self, epoch, batch, logs):
            path = super()._get_file_path(epoch, batch, logs)
            written.append(path)
            return path

    epochs_run = []

    csv_logger = cbs.MetricsLogger(os.path.join(out_dir, "metrics.csv"), append=True)
    json_logger = cbs.MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), append=True)
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0,
        callbacks=[cbs.BackupAndRestore(), kill_worker_1(epochs_run),
                   SpyCheckpoint(os.path.join(out_dir, "ckpt-{epoch}.weights.h5"),
                                 save_weights_only=True),
                   csv_logger, json_logger])
    out = {"task": me, "restart": restart, "weights": model.get_weights(),
           "epochs_run": epochs_run, "history": history.history, "written": written,
           "logger_paths": [csv_logger._path, json_logger._path]}
    if strategy.is_chief:
        reference = mlp()
        _compile(reference, "sgd")
        reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
        out["reference"] = reference.get_weights()
    return out


# ---- the tests ------------------------------------------------------------------------------


def _horovod_installed():
    from tfdist.engines.horovod import ops as horovod

    return horovod.is_available()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["tf", "auto"])
def test_fit_matches_single_process_and_shards_exactly_once(engine):
    """Either engine; "auto" is Horovod when it is installed (tests/test_engines.py)."""
    output = io.StringIO()
    chief, other = run_cluster(_train_task, engine, timeout=280, stream=output,
                               env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert chief["engine"] == other["engine"] == (engine if engine == "tf" else (
        "horovod" if _horovod_installed() else "tf"))
    assert chief["chief"] and not other["chief"]
    assert chief["replicas"] == other["replicas"] == 2
    # Numpy shuffling agrees across workers because they share the chief's seed.
    assert chief["seed"] is not None and chief["seed"] == other["seed"]
    for name in ("sgd_numpy", "adam_dataset"):
        got, ref, peer = chief[name], chief[name + "_ref"], other[name]
        assert_weights_close(got["weights"], peer["weights"], atol=0)
        assert_weights_close(got["weights"], ref["weights"])
        for key in ("loss", "accuracy"):
            assert got["history"][key] == peer["history"][key], (name, key)
            np.testing.assert_allclose(got["history"][key], ref["history"][key], atol=1e-5)
        assert got["eval"] == peer["eval"]
        np.testing.assert_allclose(got["eval"], ref["eval"], atol=1e-5)
        np.testing.assert_allclose(got["pred"], ref["pred"], atol=1e-5)
    # Exactly once: in every epoch the two workers' ids are disjoint and cover all.
    assert len(chief["ids"]) == len(other["ids"]) == 6
    for epoch, (mine, theirs) in enumerate(zip(chief["ids"], other["ids"])):
        assert len(mine) == len(theirs) == N_IDS // 2, epoch
        assert sorted(mine + theirs) == list(range(N_IDS)), epoch
    assert chief["ids"][2] != chief["ids"][3], "tf.data should reshuffle every epoch"
    spam = [line for line in output.getvalue().splitlines()
            if re.search(r"auto.?shard|sharding policy", line, re.IGNORECASE)]
    assert not spam, spam[:3]


MARK = RESULT_DIR_MARK


@pytest.mark.multiprocess
def test_assert_gone_finds_and_kills_a_marked_leftover(tmp_path):
    """The no-process-left-behind check itself can fail (and cleans up)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=dict(os.environ, **{MARK: str(tmp_path)}))
    unmarked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "worker-1.pid").write_text(str(proc.pid))
        (tmp_path / "worker-0.pid").write_text(str(unmarked.pid))
        time.sleep(0.5)  # let the children exec so /proc/<pid>/environ is theirs
        with pytest.raises(AssertionError, match="worker-1.pid"):
            assert_no_leftover_processes(tmp_path)
        assert proc.wait(10) == -signal.SIGKILL
        assert unmarked.poll() is None  # not ours to kill
    finally:
        for p in (proc, unmarked):
            p.kill()
            p.wait()


def _read(result_dir, name):
    path = os.path.join(result_dir, name)
    return open(path).read() if os.path.exists(path) else None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_missing_peer_is_named_after_startup_timeout(tmp_path):
    try:
        chief, other = run_cluster(_fault_task, str(tmp_path), "missing", "worker-1",
                                   timeout=100, stream=None, env={MARK: str(tmp_path)})
    finally:
        assert_no_leftover_processes(tmp_path)
    assert other == "absent"
    assert chief == "error"
    message = _read(tmp_path, "worker-0.error")
    assert message.startswith("DeadlineExceededError"), message
    assert "task(s) worker-1 did not join" in message, message
    assert "startup_timeout=5s" in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_frozen_peer_fails_after_collective_timeout(tmp_path):
    import tfdist

    try:
        with pytest.raises(tfdist.LaunchError) as info:
            run_cluster(_fault_task, str(tmp_path), "stop", "worker-1", timeout=100,
                        stream=None, grace_period=1, env={MARK: str(tmp_path)})
    finally:
        assert_no_leftover_processes(tmp_path)
    assert info.value.task == "worker-0", info.value
    message = _read(tmp_path, "worker-0.error")
    assert message and message.startswith("DeadlineExceededError"), message
    assert "Collective has timed out" in message, message
    assert _read(tmp_path, "worker-1.error") is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_frozen_leader_is_named_by_the_survivor(tmp_path):
    import tfdist

    try:
        with pytest.raises(tfdist.LaunchError) as info:
            run_cluster(_fault_task, str(tmp_path), "freeze", "worker-0", timeout=100,
                        stream=None, grace_period=1, env={MARK: str(tmp_path)})
    finally:
        assert_no_leftover_processes(tmp_path)
    assert info.value.task == "worker-1", info.value
    message = _read(tmp_path, "worker-1.error")
    assert message and message.startswith("DeadlineExceededError: worker-1: worker-0, the "
                                          "coordination service leader, did not answer"), message
    assert "heartbeat_timeout=5s" in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_killed_peer_makes_survivor_exit(tmp_path):
    import tfdist

    try:
        with pytest.raises(tfdist.LaunchError) as info:
            # The survivor ignores SIGTERM: it has grace_period seconds to stop itself.
            run_cluster(_fault_task, str(tmp_path), "kill", "worker-1", timeout=100,
                        stream=None, grace_period=15, env={MARK: str(tmp_path)})
    finally:
        assert_no_leftover_processes(tmp_path)
    assert info.value.task == "worker-1" and info.value.returncode == -signal.SIGKILL
    message = _read(tmp_path, "worker-0.error")
    assert message and re.match(r"(Unavailable|Aborted|Cancelled|Internal)Error", message), \
        message


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_resume_after_killed_worker_matches_uninterrupted(tmp_path):
    out_dir, backup_dir, task_tmp = tmp_path / "out", tmp_path / "backup", tmp_path / "tmp"
    out_dir.mkdir()
    task_tmp.mkdir()
    chief, other = run_cluster(_resume_task, str(out_dir), timeout=280, stream=None,
                               max_restarts=1, backup_dir=str(backup_dir),
                               env={"TMPDIR": str(task_tmp)})
    assert chief["restart"] == other["restart"] == 1
    assert chief["epochs_run"] == other["epochs_run"] == [1, 2]  # resumed at epoch 2
    assert_weights_close(chief["weights"], other["weights"], atol=0)
    assert_weights_close(chief["weights"], chief["reference"])
    assert chief["history"] == other["history"]
    # Only the chief wrote the real paths; the other worker's temp files are gone.
    assert all(p.startswith(str(out_dir)) for p in chief["written"]), chief["written"]
    assert other["written"] and all(p.startswith(str(task_tmp)) for p in other["written"])
    assert all(p.startswith(str(task_tmp)) for p in other["logger_paths"])
    assert os.listdir(task_tmp) == []
    assert sorted(os.listdir(out_dir)) == ["ckpt-1.weights.h5", "ckpt-2.weights.h5",
                                           "ckpt-3.weights.h5", "metrics.csv",
                                           "metrics.jsonl", "tfdist_training_done.json"]
    assert not backup_dir.exists()  # deleted by the chief after training
    rows = (out_dir / "metrics.csv").read_text().splitlines()
    assert rows[0] == "epoch,accuracy,loss" and [r.split(",")[0] for r in rows[1:]] == \
        ["0", "1", "2"], rows
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1, 2]
    np.testing.assert_allclose(lines[-1]["loss"], chief["history"]["loss"][-1], rtol=1e-6)


@pytest.mark.unit
def test_missing_tasks_are_read_from_tf_messages():
    """The task names in start-up errors (message texts as TF 2.21 prints them)."""
    from tfdist.cluster import ClusterSpec, TaskSpec
    from tfdist.engines.tf import missing_tasks as _missing_tasks

    cluster = ClusterSpec(worker=("h:1", "h:2", "h:3"), task=TaskSpec("worker", 1))
    barrier = ("Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0.\n"
               "# of tasks that reached the barrier: 2/3.\n"
               "The first task at the barrier: /job:worker/replica:0/task:0. Some timed out "
               "task names:\n/job:worker/replica:0/task:2\n\n\nRPC: /tensorflow.Coordination"
               "Service/RegisterTask from remote target /job:worker/replica:0/task:0")
    assert _missing_tasks(barrier, cluster) == "worker-2"
    leader_down = ("Deadline Exceeded\nAdditional GRPC error information from remote target "
                   "/job:worker/replica:0/task:0 while calling RegisterTask")
    assert _missing_tasks(leader_down, cluster) == "worker-0"
    assert _missing_tasks("Deadline Exceeded", cluster) == ""


@pytest.mark.multiprocess
def test_tfdist_keras_loads_on_first_use_only():
    import subprocess
    import sys

    code = ("import sys, tfdist; assert 'tensorflow' not in sys.modules; "
            "cbs = tfdist.keras.callbacks; assert 'tensorflow' in sys.modules; "
            "print(cbs.ModelCheckpoint.__name__, cbs.BackupAndRestore.__name__, "
            "cbs.MetricsLogger.__name__, cbs.task_info()); import os; "
            "os.environ['TF_CONFIG'] = tfdist.ClusterSpec(worker=('h:1', 'h:2'), "
            "task=tfdist.TaskSpec('worker', 1)).to_tf_config(); print(cbs.task_info())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=root, TF_CONFIG=""))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ModelCheckpoint", "BackupAndRestore", "MetricsLogger",
                                  "(True,", "'worker-0')", "(False,", "'worker-1')"]
