"""tfdist.ParameterServerStrategy: Keras 3 fit on a chief + workers + ps cluster.

Every cluster runs through `tfdist.launch` (tests.helpers.run_cluster). Each task runs
one module-level function; worker and ps tasks never get past the strategy's
constructor (it serves, then exits the process with 0 when the chief is done), so only
the chief's return value comes back.
"""

import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from helpers import (assert_weights_close, regression_data, run_cluster,
                     serve_ps_from_a_child)

from benchmarks.ps_exactly_once import crash_task  # noqa: E402  (helpers puts it on the path)

pytestmark = pytest.mark.timeout(200)


def _regressor(seed=3):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _weights_on_each_worker(strategy, model):
    """Reads the model's variables from every worker (a closure pinned to each)."""
    import tensorflow as tf

    from tfdist._hooks.coordinator import schedule_on_worker

    read = tf.function(lambda: [tf.identity(v.value) for v in model.weights])
    values = [schedule_on_worker(strategy.coordinator, i, read)
              for i in range(strategy.num_workers)]
    strategy.coordinator.join()
    return [[np.asarray(w) for w in v.fetch()] for v in values]


# ---- async: every input kind, evaluate, predict, weights seen by every task ---------------

def _async_task():
    import keras
    import tensorflow as tf

    import tfdist

    strategy = tfdist.ParameterServerStrategy()
    x, y = regression_data(n=256, features=5)
    with strategy.scope():
        model = _regressor()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    out = {"mode": strategy.mode, "workers": strategy.num_workers}
    initial = model.get_weights()

    def restart():  # each input kind trains from the same initial weights
        model.set_weights(initial)
        return model.evaluate(x, y, batch_size=64, verbose=0)[0]

    history = model.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=10, verbose=0)
    out["numpy_loss"] = history.history["loss"]
    out["numpy_iterations"] = int(model.optimizer.iterations.numpy())

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=1).batch(16)
    before = restart()
    model.fit(dataset, epochs=2, steps_per_epoch=10, verbose=0)
    out["dataset_loss"] = (before, model.evaluate(x, y, batch_size=64, verbose=0)[0])
    out["dataset_iterations"] = int(model.optimizer.iterations.numpy())

    shards = []

    def dataset_fn(input_context):
        shards.append((input_context.num_input_pipelines, input_context.input_pipeline_id))
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(16).repeat()

    before = restart()
    model.fit(dataset_fn, epochs=2, steps_per_epoch=10, verbose=0)
    out["fn_loss"] = (before, model.evaluate(x, y, batch_size=64, verbose=0)[0])
    out["fn_iterations"] = int(model.optimizer.iterations.numpy())
    out["fn_contexts"] = sorted(set(shards))

    out["evaluate"] = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    prediction = model.predict(x[:50], batch_size=16, verbose=0)
    out["predict_error"] = float(np.abs(prediction - model(x[:50]).numpy()).max())
    out["predict_shape"] = prediction.shape
    out["weights"] = [np.asarray(w) for w in model.get_weights()]
    out["worker_weights"] = _weights_on_each_worker(strategy, model)
    out["bytes"] = strategy.bytes_communicated
    return out


@pytest.mark.multiprocess
def test_async_fit_three_inputs_evaluate_predict():
    chief = run_cluster(_async_task, workers=2, chief=True, ps=1)[0]
    assert chief["mode"] == "async" and chief["workers"] == 2
    # numpy: every scheduled step applied once, the loss falls.
    assert chief["numpy_iterations"] == 30
    loss = chief["numpy_loss"]
    assert loss[-1] < 0.5 * loss[0], loss
    # dataset and dataset function inputs each train; the function saw one shard per worker.
    assert chief["dataset_iterations"] == 50
    assert chief["dataset_loss"][1] < 0.5 * chief["dataset_loss"][0]
    assert chief["fn_iterations"] == 70
    assert chief["fn_loss"][1] < 0.5 * chief["fn_loss"][0]
    assert chief["fn_contexts"] == [(2, 0), (2, 1)]
    # evaluate / predict run on the workers and agree with the chief's own forward pass.
    assert set(chief["evaluate"]) == {"loss", "mae"}
    assert np.isfinite(chief["evaluate"]["loss"])
    assert chief["predict_shape"] == (50, 1)
    assert chief["predict_error"] < 1e-5
    # Final weights are finite and the same read from the chief and from each worker.
    assert all(np.isfinite(w).all() for w in chief["weights"])
    for seen in chief["worker_weights"]:
        assert_weights_close(seen, chief["weights"], atol=0)
    gradient_bytes = 4 * (5 * 8 + 8 + 8 + 1)
    assert chief["bytes"] == 70 * gradient_bytes


# ---- sync: equals one single-device step on the K-times-larger batch ---------------------

def _sync_task(steps, batch):
    import keras
    import tensorflow as tf

    import tfdist

    strategy = tfdist.ParameterServerStrategy(mode="sync")
    x, y = regression_data(n=64, features=5, seed=4)

    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    with strategy.scope():
        model = _regressor(seed=5)
        model.compile(optimizer=optimizer(), loss="mse")
    initial = model.get_weights()
    # Worker i reads batches i, i+2, ...: step r sums batches 2r and 2r+1.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)

    reference = _regressor(seed=5)
    reference.set_weights(initial)
    reference.compile(optimizer=optimizer(), loss="mse")
    big = tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * batch).repeat()
    reference.fit(big, epochs=1, steps_per_epoch=steps, verbose=0)
    return {"weights": model.get_weights(), "reference": reference.get_weights(),
            "initial": initial, "iterations": int(model.optimizer.iterations.numpy()),
            "reference_iterations": int(reference.optimizer.iterations.numpy()),
            "loss": history.history["loss"], "mode": strategy.mode}


@pytest.mark.multiprocess
def test_sync_equals_single_device_on_summed_batch():
    # 64 examples in batches of 8 = 8 batches, 4 sync steps per pass: 6 steps wrap around.
    chief = run_cluster(_sync_task, 6, 8, workers=2, chief=True, ps=1)[0]
    assert chief["mode"] == "sync"
    assert chief["iterations"] == chief["reference_iterations"] == 6
    assert_weights_close(chief["weights"], chief["reference"], atol=1e-5)
    moved = max(np.abs(a - b).max() for a, b in zip(chief["weights"], chief["initial"]))
    assert moved > 1e-2  # it really trained


# ---- sharding: an embedding split across two ps tasks: tests/test_ps_sharded.py ----------


# ---- a worker killed in the middle of fit -------------------------------------------------

def _chief_alive(spec):
    from tfdist.strategies.parameter_server import _is_listening

    return _is_listening(spec.chief[0])


def _killed_worker_task(pid_dir):
    import time

    import tfdist

    task = os.environ["TFDIST_TASK"]
    if task == "worker-1":
        # This task is a pod: its TF server runs in a child process the chief will kill.
        child = subprocess.Popen(
            [sys.executable, "-c", "import tfdist; tfdist.ParameterServerStrategy()"])
        with open(os.path.join(pid_dir, "worker-1.pid"), "w") as f:
            f.write(str(child.pid))
        code = child.wait()
        spec = tfdist.ClusterSpec.from_env()
        while _chief_alive(spec):  # stay up (exit 0 later), like a failed pod's slot
            time.sleep(0.5)
        return {"server_exit": code}

    import keras

    # TF's own at-least-once (no ledger): exactly once is tested further below.
    strategy = tfdist.ParameterServerStrategy(exactly_once=False)
    x, y = regression_data(n=256, features=5, seed=6)

    class KillWorker(keras.callbacks.Callback):
        calls = 0

        def on_train_batch_end(self, batch, logs=None):
            KillWorker.calls += 1
            if KillWorker.calls == 3:
                with open(os.path.join(pid_dir, "worker-1.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)

    with strategy.scope():
        model = _regressor(seed=7)
        model.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=24, verbose=0,
                        callbacks=[KillWorker()])
    return {"iterations": int(model.optimizer.iterations.numpy()),
            "loss": history.history["loss"], "calls": KillWorker.calls,
            "weights": model.get_weights()}


@pytest.mark.multiprocess
def test_worker_killed_mid_fit_still_completes(tmp_path):
    chief, _, worker1, _ = run_cluster(_killed_worker_task, str(tmp_path), workers=2,
                                       chief=True, ps=1)
    assert worker1["server_exit"] == -signal.SIGKILL  # the server really died mid-fit
    assert chief["calls"] == 3 * 3  # 24 steps per epoch in dispatches of 8
    # Every step ran (exactly_once=False: a step cut short by the kill may have been
    # applied and rerun).
    assert chief["iterations"] >= 3 * 24
    assert len(chief["loss"]) == 3 and chief["loss"][-1] < chief["loss"][0]
    assert all(np.isfinite(w).all() for w in chief["weights"])


# ---- a worker killed under `tfdist launch` with no restart: the job carries on -------------

CARRY_ON_STEPS = 3 * 24  # 3 epochs of 24 steps


def _carry_on_task(pid_dir, mode):
    """The counting model of benchmarks.ps_exactly_once (each applied update lowers
    every weight by 1); the chief SIGKILLs worker-1's own process after its first
    dispatch, and nothing restarts it. In sync mode worker-0 then computes both of each
    step's gradients."""
    import keras
    import tensorflow as tf

    import tfdist
    from benchmarks.ps_exactly_once import counting_model

    with open(os.path.join(pid_dir, f"{os.environ['TFDIST_TASK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
    strategy = tfdist.ParameterServerStrategy(mode=mode)
    with strategy.scope():
        seen = tf.Variable(0, dtype=tf.int64)
        by_worker = tf.Variable(tf.zeros([2], tf.int64))
        model = counting_model(seen, by_worker, period=10**6, crashes=0)

    def dataset_fn(context):
        tag = float(context.input_pipeline_id)
        return tf.data.Dataset.from_tensors((tf.ones([4, 2]), tf.fill([4, 1], tag))).repeat()

    class KillWorker1(keras.callbacks.Callback):
        killed_at = None

        def on_train_batch_end(self, batch, logs=None):
            if KillWorker1.killed_at is None:
                KillWorker1.killed_at = by_worker.numpy().tolist()
                with open(os.path.join(pid_dir, "worker-1.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)

    model.fit(dataset_fn, epochs=3, steps_per_epoch=CARRY_ON_STEPS // 3, verbose=0,
              callbacks=[KillWorker1()])
    return {"iterations": int(model.optimizer.iterations.numpy()),
            "applied": -float(model.layers[-1].bias.numpy()[0]),
            "kernel": model.layers[-1].kernel.numpy().ravel().tolist(),
            "by_worker": by_worker.numpy().tolist(), "killed_at": KillWorker1.killed_at,
            "weights": model.get_weights()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_worker_killed_with_no_restart_left_the_job_carries_on_and_applies_each_step_once(
        tmp_path, capfd, mode):
    # The default max_restarts=0: tfdist.launch returns, with the chief's result.
    results = run_cluster(_carry_on_task, str(tmp_path), mode, workers=2, chief=True, ps=1,
                          stream=None)
    chief, worker1 = results[0], results[2]
    log = capfd.readouterr().err
    assert worker1 is None  # killed: it returned nothing
    assert ("tfdist launch: worker-1 exited with code -9 (signal SIGKILL); the "
            "parameter-server job carries on with 1 worker (no restarts left: "
            "--max-restarts 0)") in log, log
    assert "restart 1/" not in log, log
    # Exactly once: every requested step updated the weights once, and only once.
    assert chief["iterations"] == CARRY_ON_STEPS, str(chief)
    assert chief["applied"] == CARRY_ON_STEPS, str(chief)
    assert chief["kernel"] == [-CARRY_ON_STEPS] * 2, str(chief)
    assert all(np.isfinite(w).all() for w in chief["weights"])
    # worker-0 took the steps that were left after the kill.
    assert chief["by_worker"][0] > chief["killed_at"][0], str(chief)
    batches_per_step = 1 if mode == "async" else 2
    assert sum(chief["by_worker"]) >= batches_per_step * CARRY_ON_STEPS, str(chief)


# ---- clusters that cannot run parameter-server training ----------------------------------

_NO_PS = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
_NO_CHIEF = {"worker": ["127.0.0.1:2", "127.0.0.1:3"], "ps": ["127.0.0.1:4"]}


@pytest.mark.parametrize("jobs, missing, task_type", [
    (_NO_PS, "no 'ps' task", "chief"),
    (_NO_PS, "no 'ps' task", "worker"),
    (_NO_CHIEF, "no 'chief' task", "worker"),
    (_NO_CHIEF, "no 'chief' task", "ps"),
])
def test_bad_cluster_is_a_clear_error_at_construction(jobs, missing, task_type):
    import tfdist

    spec = tfdist.ClusterSpec.from_dict({"cluster": jobs, "task": {"type": task_type,
                                                                   "index": 0}})
    with pytest.raises(ValueError, match=missing) as info:
        tfdist.ParameterServerStrategy(spec)
    assert "Received: cluster=" in str(info.value)


def test_bad_mode_and_dispatch_are_clear_errors():
    import tfdist

    spec = tfdist.ClusterSpec.from_dict({"cluster": {
        "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "chief", "index": 0}})
    with pytest.raises(ValueError, match="mode must be one of"):
        tfdist.ParameterServerStrategy(spec, mode="hogwild")
    with pytest.raises(ValueError, match="steps_per_dispatch must be"):
        tfdist.ParameterServerStrategy(spec, steps_per_dispatch=0)
    with pytest.raises(ValueError, match="chief_poll_seconds must be"):
        tfdist.ParameterServerStrategy(spec, chief_poll_seconds=0)



@pytest.mark.multiprocess
def test_ps_and_worker_without_a_chief_exit_non_zero_naming_it():
    """A chief that never comes up: worker and ps tasks give up after startup_timeout."""
    from tfdist.launch import make_local_cluster

    cluster = make_local_cluster(workers=1, chief=True, ps=1)
    code = "import tfdist; tfdist.ParameterServerStrategy(startup_timeout=3)"
    processes = {}
    for task in ("worker", "ps"):
        env = dict(os.environ, TF_CONFIG=cluster.with_task(task).to_tf_config(),
                   TF_CPP_MIN_LOG_LEVEL="2")
        processes[task] = subprocess.Popen([sys.executable, "-c", code], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True)
    for task, process in processes.items():
        try:
            output, _ = process.communicate(timeout=150)  # before the fix: forever
        finally:
            process.kill()
        assert process.returncode == 1, output
        assert (f"DeadlineExceededError: {task}-0: the chief (chief-0 at {cluster.chief[0]}) "
                "did not start within 2 x startup_timeout=3s") in output, output


# ---- the step watchdog, without a cluster ---------------------------------------------------

class _FakeWorker:
    """What the watchdog wraps of a coordinator's worker: a closure blocks until released."""

    def __init__(self, index):
        self.worker_index = index
        self.release = threading.Event()

    def _process_closure(self, closure):
        self.release.wait(60)

    def _on_closure_failure(self, closure, error):
        pass


@pytest.fixture
def servers():
    """Addresses of a server that answers like a live gRPC server, and of a silent one
    (it accepts connections but never answers, like a stopped process)."""
    answering, silent = socket.create_server(("127.0.0.1", 0)), \
        socket.create_server(("127.0.0.1", 0))

    def answer():
        while True:
            try:
                connection, _ = answering.accept()
            except OSError:
                return
            with connection:
                connection.sendall(b"\0" * 9)

    threading.Thread(target=answer, daemon=True).start()
    yield {name: "127.0.0.1:%d" % sock.getsockname()[1]
           for name, sock in (("answering", answering), ("silent", silent))}
    answering.close()
    silent.close()


def _watchdog(servers, workers, step_timeout, control_dir=None, startup_timeout=60):
    import types

    from tfdist.strategies.parameter_server import _StepWatchdog

    fakes = [_FakeWorker(i) for i in range(len(workers))]
    coordinator = types.SimpleNamespace(_cluster=types.SimpleNamespace(workers=fakes))
    watchdog = _StepWatchdog(coordinator, [servers[w] for w in workers], step_timeout,
                             startup_timeout, control_dir)
    watchdog.EXIT_GRACE_SECONDS = 3600  # never exit the test process
    return watchdog, fakes


def _eventually(predicate, seconds=60):
    import time

    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_watchdog_asks_the_launcher_to_restart_a_hung_worker(servers, tmp_path):
    watchdog, fakes = _watchdog(servers, ["answering", "answering"], 0.5, str(tmp_path))
    try:
        threading.Thread(target=fakes[1]._process_closure, args=(None,), daemon=True).start()
        request = tmp_path / "restart-worker-1"
        assert _eventually(request.exists)
        assert request.read_text() == ("it has not finished a step within step_timeout=0.5s: "
                                       "it is hung or too slow")
        assert not (tmp_path / "restart-worker-0").exists() and watchdog.error is None
    finally:
        fakes[1].release.set()
        watchdog.stop()


def test_watchdog_names_a_frozen_worker_when_nothing_can_restart_it(servers):
    from tfdist.strategies.parameter_server import StepTimeoutError

    watchdog, fakes = _watchdog(servers, ["answering", "silent"], 0.5)
    try:
        # Both steps hang (a frozen worker blocks the chief), but only the silent one is named.
        assert _eventually(lambda: watchdog._silent)
        for fake in fakes:
            threading.Thread(target=fake._process_closure, args=(None,), daemon=True).start()
        assert _eventually(lambda: watchdog.error is not None)
        with pytest.raises(StepTimeoutError) as info:
            watchdog.raise_if_failed()
        assert info.value.tasks == ["worker-1"]
        assert str(info.value).startswith(
            "worker-1 is overdue: its server has not answered for 0.25s: it is frozen. Its "
            "step cannot be taken back from it while its process lives, and nothing here "
            "can restart it"), info.value
        assert str(info.value).endswith("Received: step_timeout=0.5")
    finally:
        for fake in fakes:
            fake.release.set()
        watchdog.stop()


def test_watchdog_fails_when_no_worker_is_left(servers, tmp_path):
    from tfdist.strategies.parameter_server import StepTimeoutError

    watchdog, _ = _watchdog(servers, ["silent", "silent"], 0.5, str(tmp_path),
                            startup_timeout=0.5)
    try:
        assert _eventually(lambda: watchdog.error is not None)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["restart-worker-0",
                                                               "restart-worker-1"]
        with pytest.raises(StepTimeoutError, match=r"^no worker is left: worker-0, worker-1 "
                           r"froze or hung, and none was restarted within 0\.5s"):
            watchdog.raise_if_failed()
    finally:
        watchdog.stop()


def test_watchdog_fails_when_no_worker_runs_and_not_while_one_does(servers):
    """Every worker killed and none restarted (e.g. on other nodes of a multi-node job,
    which no local launcher watches): the chief fails, naming them, instead of waiting
    in TF's coordinator forever. One worker still running: it goes on."""
    import time

    from tfdist.strategies.parameter_server import StepTimeoutError

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        servers = dict(servers, dead="127.0.0.1:%d" % unused.getsockname()[1])
    watchdog, _ = _watchdog(servers, ["dead", "dead"], 4, startup_timeout=0.5)
    try:
        assert _eventually(lambda: watchdog.error is not None)
        with pytest.raises(StepTimeoutError, match=r"^no worker is left: nothing has listened "
                           r"at the address of worker-0, worker-1 for startup_timeout=0\.5s "
                           r"\(killed, and not restarted\)") as info:
            watchdog.raise_if_failed()
        assert info.value.tasks == ["worker-0", "worker-1"]
    finally:
        watchdog.stop()
    watchdog, _ = _watchdog(servers, ["dead", "answering"], 4, startup_timeout=0.5)
    try:
        assert _eventually(lambda: 0 in watchdog._dead)
        watchdog._dead[0] = time.monotonic() - 100  # long dead
        watchdog.check()
        assert watchdog.error is None and 1 not in watchdog._dead
    finally:
        watchdog.stop()


def test_step_timeout_is_validated():
    import tfdist

    spec = tfdist.ClusterSpec.from_dict({"cluster": {
        "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "chief", "index": 0}})
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match=r"step_timeout must be None or a number > 0\. "
                                             rf"Received: step_timeout={bad!r}"):
            tfdist.ParameterServerStrategy(spec, step_timeout=bad)
    with pytest.raises(ValueError, match=r"exactly_once must be True or False\. "
                                         r"Received: exactly_once=1"):
        tfdist.ParameterServerStrategy(spec, exactly_once=1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"update_block_bytes must be an integer >= 1\. "
                                             rf"Received: update_block_bytes={bad!r}"):
            tfdist.ParameterServerStrategy(spec, update_block_bytes=bad)


# ---- a ps killed in the middle of fit: clear error, then resume from the checkpoint -------

def _killed_ps_task(work_dir):
    import tfdist

    task = os.environ["TFDIST_TASK"]
    attempt = int(os.environ["TFDIST_RESTART"])
    if task == "ps-0" and attempt == 0:
        serve_ps_from_a_child(os.path.join(work_dir, "ps-0.pid"))
        return None

    import keras

    from tfdist.keras.ps_fit import ParameterServerUnavailableError

    strategy = tfdist.ParameterServerStrategy()
    x, y = regression_data(n=128, features=5, seed=8)

    class KillPs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if attempt == 0 and epoch == 1:  # after the backup of epoch 2 was written
                with open(os.path.join(work_dir, "ps-0.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)

    with strategy.scope():
        model = _regressor(seed=9)
        model.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    backup = keras.callbacks.BackupAndRestore(os.path.join(work_dir, "backup"))
    try:
        history = model.fit(x, y, batch_size=8, epochs=4, steps_per_epoch=8, verbose=0,
                            callbacks=[backup, KillPs()])
    except ParameterServerUnavailableError as error:
        with open(os.path.join(work_dir, "error.txt"), "w") as f:
            f.write(str(error))
        raise
    return {"attempt": attempt, "epochs": history.epoch,
            "iterations": int(model.optimizer.iterations.numpy()),
            "weights": model.get_weights()}


@pytest.mark.multiprocess
def test_ps_killed_gives_clear_error_and_restart_resumes(tmp_path):
    chief = run_cluster(_killed_ps_task, str(tmp_path), workers=2, chief=True, ps=1,
                        max_restarts=1)[0]
    message = (tmp_path / "error.txt").read_text()
    assert "ps-0 became unavailable" in message and "BackupAndRestore" in message
    # The second start resumed after the two epochs backed up, with the optimizer state.
    assert chief["attempt"] == 1
    assert chief["epochs"] == [2, 3]
    assert chief["iterations"] == 4 * 8
    assert all(np.isfinite(w).all() for w in chief["weights"])


# ---- workers that die under `tfdist launch`: restarted alone, every step applied once -----

ONCE_PERIOD = 10  # worker-1 crashes after every 10th step it ran
ONCE_CRASHES = 2


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_killed_and_crashed_workers_restart_alone_and_every_step_applies_once(
        tmp_path, capfd, mode):
    # The counting job of benchmarks.ps_exactly_once (its docstring says how it counts).
    chief = run_cluster(crash_task, str(tmp_path), mode, ONCE_PERIOD, ONCE_CRASHES,
                        workers=2, chief=True, ps=1, max_restarts=ONCE_CRASHES + 1,
                        timeout=280, stream=None)[0]
    log = capfd.readouterr().err
    # The launcher restarted each worker alone, at its address; the job went on.
    assert log.count("worker-1 exited with code -6; restarting worker-1 alone") == \
        ONCE_CRASHES, log
    assert "worker-0 exited with code -9; restarting worker-0 alone" in log, log
    assert "restart 3/3" in log and "restart 4/" not in log, log
    # TF's coordinator took both back: each ran steps after its (last) restart.
    assert chief["seen"] > ONCE_PERIOD * ONCE_CRASHES, str(chief)  # str: shown whole
    # Exactly once: every requested step updated the weights once, and only once.
    assert chief["iterations"] == chief["requested"], str(chief)
    assert chief["applied"] == chief["requested"], str(chief)
    assert chief["kernel"] == [-chief["requested"]] * 2, str(chief)
    # Data is not exactly once: a step run again reads another batch.
    batches_per_step = 1 if mode == "async" else 2
    assert sum(chief["by_worker"]) >= batches_per_step * chief["requested"] + ONCE_CRASHES


def test_a_chief_that_listens_only_between_two_polls_is_seen(monkeypatch):
    """A short job's chief may listen for about a second only: a worker polling the
    chief every ``poll_seconds`` (1 s) could miss it and wait for a chief that never
    comes. Until the chief is seen it is polled every COME_UP_POLL_SECONDS."""
    from tfdist.strategies import parameter_server as ps

    polled, seen = threading.Event(), threading.Event()
    listening = ps._is_listening

    def watched(address, timeout=1.0):
        up = listening(address, timeout)
        (seen if up else polled).set()
        return up

    monkeypatch.setattr(ps, "_is_listening", watched)
    chief = socket.socket()
    chief.bind(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % chief.getsockname()[1]

    def up_between_polls():
        polled.wait(10)  # the worker's first poll found nothing
        chief.listen()
        seen.wait(0.6)  # well inside the 1 s between two polls of poll_seconds
        chief.close()

    thread = threading.Thread(target=up_between_polls)
    thread.start()
    try:
        ps.wait_for_chief(address, poll_seconds=1.0, misses=1, startup_timeout=5)
    finally:
        thread.join()
    assert seen.is_set()


def test_a_connection_to_itself_is_not_a_listening_chief(monkeypatch):
    """Polling a local port nobody listens on can, rarely, connect the polling socket
    to itself (its source port is the polled port: TCP simultaneous open). That is no
    chief."""
    from tfdist.strategies import parameter_server as ps

    lonely = socket.socket()
    lonely.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lonely.bind(("127.0.0.1", 0))
    address = lonely.getsockname()
    lonely.connect(address)  # nobody listens: the socket is connected to itself
    assert lonely.getpeername() == address
    monkeypatch.setattr(ps.socket, "create_connection", lambda *args, **kwargs: lonely)
    assert not ps._is_listening("127.0.0.1:%d" % address[1])
