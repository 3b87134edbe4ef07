"""The fault matrix (docs/faults.md): every mode x fault that runs on one machine.

Cells already covered by tests/test_multi_worker.py (mirrored multi-worker: missing,
frozen and killed peer, kill + resume) and tests/test_parameter_server.py (worker
killed, ps killed + resume) are not repeated here. Each launched job checks several
cells at once, since starting a cluster costs ~10 s:

- model average: a worker killed at a random step, then the chief killed at a random
  step of the restarted run; the twice-restarted job ends at the weights of the
  uninterrupted run (local SGD in numpy). Then, in the same processes: a NaN loss stops
  both workers at the same step, and workers that build different models get a clear
  `ValueError`.
- mirrored multi-worker: the chief killed at a random step; the restarted job ends at
  the synchronous-SGD weights; then the same NaN and different-model checks.
- model average: a frozen (SIGSTOP) worker and a worker that never starts.
- parameter server, one job restarted 3 times: a worker that never starts, a frozen
  worker (fit hangs until the launcher's deadline), the chief killed; the last start
  resumes from BackupAndRestore and every requested step was applied.
- Horovod (under horovodrun): a rank killed at a random step, the chief (rank 0)
  killed, a frozen rank, a rank that never starts.
- ports: a port in use is named in the error (fixed cluster) or retried (free ports).

The random kill steps come from ``TFDIST_FAULT_SEED`` (default: a fresh seed, printed in
every failure message).
"""

import importlib
import io
import os
import random
import re
import signal
import socket
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import RESULT_DIR_MARK as MARK
from helpers import (TESTS_DIR, assert_no_leftover_processes, assert_weights_close,
                     require_horovod, run_cluster, run_horovod)
from test_model_average import linear_data, linear_model, numpy_local_sgd
from test_multi_worker import _read, _write

SEED = int(os.environ.get("TFDIST_FAULT_SEED", random.SystemRandom().randrange(10**6)))
GLOBAL_BATCH = 16
N = 64                      # 4 global batches per epoch
EPOCHS = 3
STEPS = EPOCHS * N // GLOBAL_BATCH
LR = 0.05


def _kill_plan(victims):
    """[(attempt, task, global step)]: each victim SIGKILLs itself after that step.

    A kill in attempt ``i`` restarts from the last epoch backed up before it, so the next
    kill is drawn from the steps the restarted run will actually take.
    """
    rng = random.Random(SEED)
    plan, first = [], 1
    for attempt, task in enumerate(victims):
        step = rng.randrange(first, STEPS + 1)
        plan.append((attempt, task, step))
        first = (step - 1) // (N // GLOBAL_BATCH) * (N // GLOBAL_BATCH) + 1
    return plan


# ---- code run inside the tasks (module level, so the tasks import it) --------------------


def _strategy(mode, **timeouts):
    import tfdist

    if mode == "model_average":
        return tfdist.ModelAverageStrategy(period=2, **timeouts)
    return tfdist.MultiWorkerMirroredStrategy(**timeouts)


def _nan_and_mismatch(strategy, me, result_dir):
    """Bad input after a finished fit: a NaN loss, then a different model per worker."""
    import keras

    from tfdist.keras.guards import StopOnNaN

    out = {}
    x, y = linear_data(n=N)
    y = y.copy()
    y[37] = np.nan  # global batch 3 (step 3 of epoch 1)
    with strategy.scope():
        model = linear_model()
        model.compile(keras.optimizers.SGD(LR), "mse")
    try:
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[StopOnNaN()])
        out["nan"] = "no error"
    except FloatingPointError as error:
        out["nan"] = str(error)
    out["nan_iterations"] = int(model.optimizer.iterations.numpy())
    units = 4 if me == "worker-0" else 3
    try:
        with strategy.scope():
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(units),
                              keras.layers.Dense(1)])
        out["mismatch"] = "no error"
    except Exception as error:  # the test checks the type
        out["mismatch"] = f"{type(error).__name__}: {error}"
    return out


def _resume_task(result_dir, mode, plan):
    """Trains with BackupAndRestore; the planned victims SIGKILL themselves."""
    import keras

    from tfdist.keras import callbacks as cbs

    me, attempt = os.environ["TFDIST_TASK"], int(os.environ["TFDIST_RESTART"])
    strategy = _strategy(mode, startup_timeout=60, collective_timeout=60)
    x, y = linear_data(n=N)
    with strategy.scope():
        model = linear_model()
        model.compile(keras.optimizers.SGD(LR), "mse")
    initial = model.get_weights()
    kill_at = [step for a, task, step in plan if a == attempt and task == me]

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if kill_at and int(self.model.optimizer.iterations.numpy()) == kill_at[0]:
                _write(result_dir, f"killed-{attempt}", me)
                os.kill(os.getpid(), signal.SIGKILL)

    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                        verbose=0, callbacks=[cbs.BackupAndRestore(), Kill()])
    out = {"task": me, "attempt": attempt, "initial": initial, "epochs": history.epoch,
           "weights": model.get_weights(),
           "iterations": int(model.optimizer.iterations.numpy())}
    out.update(_nan_and_mismatch(strategy, me, result_dir))
    return out


def _fault_task(result_dir, fault, victim):
    """Model average with a peer that never starts ("missing") or freezes ("stop")."""
    import keras

    me = os.environ["TFDIST_TASK"]
    _write(result_dir, f"{me}.pid", str(os.getpid()))
    if fault == "missing" and me == victim:
        return "absent"
    try:
        # engine="tf": collective_timeout is TF's (engine="horovod": tests/test_engines.py).
        strategy = _strategy("model_average", engine="tf",
                             startup_timeout=5 if fault == "missing" else 60,
                             collective_timeout=5 if fault == "stop" else 60,
                             heartbeat_timeout=120)
        x, y = linear_data(n=N)
        with strategy.scope():
            model = linear_model()
            model.compile(keras.optimizers.SGD(LR), "mse")

        class Stop(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if me == victim and int(self.model.optimizer.iterations.numpy()) == 5:
                    os.kill(os.getpid(), signal.SIGSTOP)

        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, verbose=0, callbacks=[Stop()])
    except Exception as error:
        _write(result_dir, f"{me}.error", f"{type(error).__name__}: {error}")
        raise
    return "finished"


# ---- model average and mirrored multi-worker: kill, restart, resume, bad input ------------


def _check_bad_input(results, mode):
    """NaN: both workers stop at the same step; mismatch: ValueError.

    Synchronous: at the NaN's step, with one message. Model average: the worker whose
    shard holds the NaN sees it at step 3; both stop after the average at step 4.
    """
    messages = [r["nan"] for r in results]
    if mode == "model_average":
        seen = [m for m in messages if m.startswith("loss became nan at epoch 1, step 3 on ")]
        assert len(seen) == 1, messages
        for r in results:
            assert r["task"] in r["nan"], r
            assert ("training stopped on every worker after the average at epoch 1, step 4"
                    in r["nan"]), r
            assert r["nan_iterations"] == 4, r
    else:
        for r in results:
            assert r["nan"].startswith("loss became nan at epoch 1, step 3 on " + r["task"]), r
            assert "training stopped on every worker" in r["nan"]
            assert r["nan_iterations"] == 3, r
        assert messages[0].replace("worker-0", "worker-1") == messages[1]
    # The receiver of the chief's broadcast sees the mismatch; the chief learns of it when
    # the other worker stops (its error then comes from the collective).
    mismatch = results[1]["mismatch"]
    assert re.match(r"ValueError: the workers built different models: variable 'kernel' "
                    r"does not match between workers: its shape is (\[3,4\] on worker-0 and "
                    r"\[3,3\]|\[3,3\] on worker-1 and \[3,4\]) on another worker\. Every "
                    r"worker must create the same variables", mismatch), mismatch
    assert re.match(r"(ValueError: the workers built different models|(Unavailable|Aborted|"
                    r"Cancelled|DeadlineExceeded)Error)", results[0]["mismatch"]), results[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, victims", [
    ("model_average", ["worker-1", "worker-0"]),   # a worker, then the chief
    ("multi_worker", ["worker-0"]),                 # the chief
])
def test_kill_restart_resumes_to_uninterrupted_weights(tmp_path, capfd, mode, victims):
    plan = _kill_plan(victims)
    results = run_cluster(_resume_task, str(tmp_path), mode, plan, timeout=280,
                          stream=None, max_restarts=len(victims),
                          backup_dir=str(tmp_path / "backup"))
    where = f"mode={mode}, plan={plan}, TFDIST_FAULT_SEED={SEED}"
    log = capfd.readouterr().err
    for attempt, task, step in plan:
        assert _read(tmp_path, f"killed-{attempt}") == task, where
        assert (f"restart {attempt + 1}/{len(victims)}: {task} exited with code -9 "
                "(signal SIGKILL)") in log, (where, log[-2000:])
    x, y = linear_data(n=N)
    initial = results[0]["initial"]
    reference = numpy_local_sgd(x, y, initial[0], initial[1], steps=STEPS,
                                period=2 if mode == "model_average" else 1, lr=LR)
    resumed_from = (plan[-1][2] - 1) // (N // GLOBAL_BATCH)
    for r in results:
        assert r["attempt"] == len(victims), where
        assert r["epochs"] == list(range(resumed_from, EPOCHS)), where
        assert r["iterations"] == STEPS, where  # every step exactly once in the end
        assert_weights_close(r["weights"], reference, atol=1e-5)
    assert_weights_close(results[0]["weights"], results[1]["weights"], atol=0)
    _check_bad_input(results, mode)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["missing", "stop"])
def test_model_average_missing_or_frozen_peer_is_an_error(tmp_path, fault):
    import tfdist

    try:
        with pytest.raises(tfdist.LaunchError) as info:
            run_cluster(_fault_task, str(tmp_path), fault, "worker-1", timeout=120,
                        stream=None, grace_period=1, env={MARK: str(tmp_path)})
    finally:
        assert_no_leftover_processes(tmp_path)
    assert info.value.task == "worker-0", info.value
    message = _read(tmp_path, "worker-0.error")
    assert message and message.startswith("DeadlineExceededError"), message
    if fault == "missing":
        assert "task(s) worker-1 did not join" in message and "startup_timeout=5s" in message
    else:
        assert "Collective has timed out" in message, message
        assert _read(tmp_path, "worker-1.error") is None  # frozen, never got to say it


# ---- parameter server ---------------------------------------------------------------------


def _ps_task(result_dir):
    """Attempt 0: worker-1 never starts. Attempt 1: the chief, as if not started by
    `tfdist launch`, freezes worker-1 (SIGSTOP) after the first dispatch. Attempt 2: the
    same under `tfdist launch`; then the chief is killed after the backup of epoch 2.
    Attempt 3 resumes."""
    import keras
    import tensorflow as tf

    import tfdist

    me, attempt = os.environ["TFDIST_TASK"], int(os.environ["TFDIST_RESTART"])
    restart = os.environ.get("TFDIST_TASK_RESTART", "0")
    for name in (f"{me}.pid", f"{me}.attempt{attempt}.{restart}.pid"):
        _write(result_dir, name, str(os.getpid()))
    if attempt == 0 and me == "worker-1":
        return "absent"
    if attempt == 1:
        os.environ.pop("TFDIST_CONTROL_DIR", None)  # nothing can restart a worker
    try:  # workers and ps wait longer: the chief's failure to start is the fault here
        strategy = tfdist.ParameterServerStrategy(
            startup_timeout=5 if me == "chief-0" else 60, step_timeout=10)
    except tf.errors.DeadlineExceededError as error:
        _write(result_dir, f"{me}.error-{attempt}", f"{type(error).__name__}: {error}")
        raise
    x, y = linear_data(n=N)

    class Fault(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if attempt == 2 and epoch == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # after the backup of epoch 2

        def on_train_batch_end(self, batch, logs=None):
            stopped = f"stopped-{attempt}"
            if attempt in (1, 2) and not os.path.exists(os.path.join(result_dir, stopped)):
                os.kill(int(_read(result_dir, "worker-1.pid")), signal.SIGSTOP)
                _write(result_dir, stopped, "worker-1")

    with strategy.scope():
        model = linear_model()
        model.compile(keras.optimizers.SGD(LR), "mse")
    backup = keras.callbacks.BackupAndRestore(os.path.join(result_dir, "backup"))
    history = model.fit(x, y, batch_size=8, epochs=4, steps_per_epoch=8, verbose=0,
                        callbacks=[backup, Fault()])
    return {"attempt": attempt, "epochs": history.epoch,
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss": history.history["loss"], "weights": model.get_weights()}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ps_missing_frozen_worker_and_killed_chief_then_resume_every_step(tmp_path, capfd):
    """A missing worker is named after startup_timeout. A frozen worker is named after
    step_timeout: without `tfdist launch` fit fails; under it the launcher kills and
    restarts the worker alone, and fit goes on. A killed chief stops the job. Each
    failed start is restarted, and BackupAndRestore resumes."""
    output = io.StringIO()
    try:
        chief = run_cluster(_ps_task, str(tmp_path), workers=2, chief=True, ps=1, timeout=150,
                            stream=output, max_restarts=4, grace_period=1,
                            env={MARK: str(tmp_path)})[0]
    finally:
        # The frozen workers too (SIGKILL ends a stopped process).
        assert_no_leftover_processes(tmp_path)
    log = capfd.readouterr().err
    assert "restart 1/4: chief-0 exited with code 1" in log, log
    message = _read(tmp_path, "chief-0.error-0")
    assert message.startswith("DeadlineExceededError: chief-0: task(s) worker-1 did not "
                              "start within startup_timeout=5s"), message
    # Frozen, nothing can restart it: the chief fails naming it.
    frozen = "worker-1 is overdue: its server has not answered for 5s: it is frozen"
    assert "restart 2/4: chief-0 exited with code 1" in log, log
    errors = [line for line in output.getvalue().splitlines()
              if line.startswith("[chief-0]") and "Error" in line]
    assert f"StepTimeoutError: {frozen}. Its step cannot be taken back" in output.getvalue(), \
        errors
    # Frozen under tfdist launch: named, killed, restarted alone; fit went on.
    assert _read(tmp_path, "stopped-2") == "worker-1"
    assert (f"[chief-0] tfdist: {frozen}; asking tfdist launch to kill and restart it"
            ) in output.getvalue(), output.getvalue()[-3000:]
    assert ("the chief asked to restart worker-1 (its server has not answered for 5s: it "
            "is frozen); killing it") in log, log
    assert "restart 3/4: worker-1 exited with code -9; restarting worker-1 alone" in log, log
    assert "restart 4/4: chief-0 exited with code -9 (signal SIGKILL)" in log, log
    assert chief["attempt"] == 3
    assert chief["epochs"] == [2, 3]  # resumed after the two epochs backed up
    assert chief["iterations"] == 4 * 8  # every requested step was applied once
    assert all(np.isfinite(w).all() for w in chief["weights"])


# ---- Horovod (horovodrun --gloo) ----------------------------------------------------------


def horovod_fault_task(result_dir, fault, victim, step):
    """``fault``: "kill" (rank ``victim`` SIGKILLs itself after ``step``), "stop"
    (it freezes after ``step``), "missing" (it exits before `hvd.init`) or "hang" (it
    never reaches `hvd.init`: a rank that never starts)."""
    rank = int(os.environ["HOROVOD_RANK"])
    _write(result_dir, f"rank{rank}.pid", str(os.getpid()))
    if fault == "missing" and rank == victim:
        return "absent"
    if fault == "hang" and rank == victim:
        time.sleep(600)
    import keras

    import tfdist

    try:
        strategy = tfdist.HorovodStrategy()
        x, y = linear_data(n=N)
        with strategy.scope():
            model = linear_model()
            model.compile(keras.optimizers.SGD(LR), "mse")

        class Fault(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if rank == victim and int(self.model.optimizer.iterations.numpy()) == step:
                    os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

        model.fit(x, y, batch_size=GLOBAL_BATCH // 2, epochs=EPOCHS, shuffle=False,
                  verbose=0, callbacks=[Fault()])
    except Exception as error:
        _write(result_dir, f"rank{rank}.error", f"{type(error).__name__}: {error}")
        raise
    return "finished"


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault, victim", [("kill", 1), ("kill", 0), ("stop", 1),
                                           ("missing", 1), ("hang", 1)])
def test_horovod_faults(tmp_path, fault, victim):
    require_horovod()
    step = random.Random(SEED + victim).randrange(1, STEPS + 1)
    try:
        with pytest.raises(AssertionError) as info:
            run_horovod(horovod_fault_task, str(tmp_path), fault, victim, step, timeout=120,
                        env={MARK: str(tmp_path), "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"})
    finally:
        assert_no_leftover_processes(tmp_path)
    output = str(info.value)
    errors = {p[:-6]: _read(tmp_path, p) for p in os.listdir(tmp_path) if p.endswith(".error")}
    where = f"fault={fault}, victim={victim}, step={step}, TFDIST_FAULT_SEED={SEED}"
    assert output.startswith("horovodrun exited with"), (where, output[-3000:])
    # horovodrun names the first rank that failed and terminates the others. A killed
    # rank is usually first; its peer may raise before horovodrun polls (exit code 1).
    firsts = {"kill": [(victim, 137), (1 - victim, 1)],
              "hang": [(1 - victim, 134)]}.get(fault, [(1 - victim, 1)])
    assert any(f"The first process to do so was:\nProcess name: {rank}\nExit code: {code}"
               in output for rank, code in firsts), (where, output[-3000:])
    if fault == "kill":
        assert f"Process {victim} exit with status code 137" in output, (where, output[-3000:])
    survivor = f"rank{1 - victim}"
    assert set(errors) <= {survivor}, (where, errors)
    if fault == "hang":  # Gloo's rendezvous timeout aborts the survivor in C++ (134, above)
        assert survivor not in errors, (where, errors)
        return
    if fault != "kill":  # the survivor raised: it is the first failure
        assert errors[survivor].startswith("UnknownError") and \
            "Horovod has been shut down" in errors[survivor], (where, errors)
    if fault == "stop":
        assert f"Process {victim} exit with status code 137" in output  # killed by horovodrun


# ---- ports -------------------------------------------------------------------------------

_PORT_SCRIPT = """
import tensorflow as tf
import tfdist
spec = tfdist.ClusterSpec.from_env()
tf.distribute.Server(tf.train.ClusterSpec(spec.jobs()), job_name=spec.task.type,
                     task_index=spec.task.index, start=True)
print("serving")
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_port_in_use_is_named_or_retried(tmp_path):
    launch = importlib.import_module("tfdist.launch.local")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_PORT_SCRIPT))
    argv = [sys.executable, str(script)]
    env = {"PYTHONPATH": os.path.dirname(TESTS_DIR)}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cluster = launch.make_local_cluster(2)
        taken = cluster.__class__.from_dict({"cluster": {
            "worker": [cluster.worker[0], f"127.0.0.1:{port}"]}})
        # A fixed cluster is not retried: the error names the task and the address.
        with pytest.raises(launch.LaunchError) as info:
            launch.run(argv, cluster=taken, timeout=100, stream=None, env=env,
                       grace_period=1)
        assert info.value.task == "worker-1", info.value
        assert str(info.value).startswith(
            f"worker-1 exited with code 1: it could not bind its port 127.0.0.1:{port} "
            "(in use?) after"), str(info.value)[-2000:]
        # Free ports: the first choice clashes, the launcher picks new ones and succeeds.
        real, calls = launch.make_local_cluster, []

        def clashing(*args, **kwargs):
            calls.append(1)
            return taken if len(calls) == 1 else real(*args, **kwargs)

        log = io.StringIO()
        original = launch.make_local_cluster
        launch.make_local_cluster = clashing
        try:
            result = launch.run(argv, workers=2, timeout=100, stream=None, env=env, log=log,
                                grace_period=1)
        finally:
            launch.make_local_cluster = original
    assert result.attempts == 2
    assert (f"worker-1 could not bind its port 127.0.0.1:{port}; retrying on new ports"
            in log.getvalue()), log.getvalue()
    assert all("serving" in t.output_tail for t in result.tasks)


def test_ps_startup_timeout_is_validated():
    import tfdist

    spec = tfdist.ClusterSpec.from_dict({"cluster": {
        "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "chief", "index": 0}})
    with pytest.raises(ValueError, match=r"startup_timeout must be a number > 0\. "
                                         r"Received: startup_timeout=0"):
        tfdist.ParameterServerStrategy(spec, startup_timeout=0)
