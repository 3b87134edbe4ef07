"""A frozen parameter server is named, and the healthy workers are not blamed (issue 31).

The chief's watchdog probes each ps's server as it probes the workers: a ps silent for
``step_timeout / 2`` (at most 30 s: 30 s with the default ``step_timeout=600``) ends
the job, named. Under `tfdist launch` the launcher kills it and fails naming it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from helpers import RESULT_DIR_MARK as MARK
from helpers import ROOT, TESTS_DIR, assert_no_leftover_processes
from test_parameter_server import _eventually, _FakeWorker, servers  # noqa: F401

# The job: ps-0 records its pid; the chief SIGSTOPs it after the first dispatch.
_JOB = """
    import os, signal, sys
    out, step_timeout = sys.argv[1], sys.argv[2]
    me = os.environ["TFDIST_TASK"]
    with open(os.path.join(out, me + ".pid"), "w") as f:
        f.write(str(os.getpid()))
    import keras, numpy as np, tfdist
    options = {} if step_timeout == "default" else {"step_timeout": float(step_timeout)}
    strategy = tfdist.ParameterServerStrategy(steps_per_dispatch=2, **options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")

    class FreezePs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stopped = os.path.join(out, "stopped")
            if not os.path.exists(stopped):
                with open(os.path.join(out, "ps-0.pid")) as f:
                    os.kill(int(f.read()), signal.SIGSTOP)
                open(stopped, "w").close()

    x = np.ones((64, 3), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[FreezePs()])
    print("fit ended", flush=True)
"""

LAUNCH_TIMEOUT = 240  # the launcher's --timeout; the job must end well before it


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("step_timeout, silent", [("default", 30), ("20", 10)])
def test_a_frozen_ps_is_named_and_the_workers_are_not_blamed(tmp_path, step_timeout, silent):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_JOB))
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")]), **{MARK: str(tmp_path)})
    process = subprocess.Popen(
        [sys.executable, "-m", "tfdist.cli", "launch", "--chief", "--workers", "2", "--ps",
         "1", "--timeout", str(LAUNCH_TIMEOUT), str(script), str(tmp_path), step_timeout],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    try:
        # Before: silent until --timeout (default), or both workers killed (20).
        out, err = process.communicate(timeout=LAUNCH_TIMEOUT - 60)
    finally:
        process.kill()
        assert_no_leftover_processes(tmp_path)  # SIGCONT + SIGKILL a task left behind
    assert (tmp_path / "stopped").exists(), err[-3000:]
    assert process.returncode == 1, err[-3000:]
    failed = [line for line in err.splitlines() if line.startswith("tfdist launch: FAILED:")]
    assert len(failed) == 1 and failed[0].startswith(
        "tfdist launch: FAILED: ps-0 exited with code -9 (signal SIGKILL): ps-0 was not "
        f"responding (its server has not answered for {silent}s: it is frozen (e.g. "
        "SIGSTOP) or cut off), so the chief had it killed"), (failed, err[-3000:])
    assert (f"[chief-0] tfdist: ps-0 is not responding: its server has not answered for "
            f"{silent}s") in out + err, (out + err)[-3000:]
    for worker in ("worker-0", "worker-1"):  # healthy: neither blamed nor restarted
        assert f"{worker} is overdue" not in out + err, (out + err)[-3000:]
        assert f"restart {worker}" not in err and f"{worker} exited" not in err, err[-3000:]
    assert "timed out" not in err and "fit ended" not in out, err[-3000:]


# ---- the watchdog alone, without a cluster -------------------------------------------------


def test_watchdog_names_a_silent_ps_and_not_the_workers_whose_steps_wait_for_it(
        servers, tmp_path, monkeypatch):  # noqa: F811
    """It asks the launcher to stop ps-1 and fails once the launcher has (removed the
    request), so that the launcher sees the ps end before the chief."""
    import types

    from tfdist.strategies.parameter_server import StepTimeoutError, _StepWatchdog

    monkeypatch.setattr(_StepWatchdog, "STOP_WAIT_SECONDS", 3600)
    fakes = [_FakeWorker(i) for i in range(2)]
    coordinator = types.SimpleNamespace(_cluster=types.SimpleNamespace(workers=fakes))
    watchdog = _StepWatchdog(coordinator, [servers["answering"]] * 2, 0.5, 60, str(tmp_path),
                             ps_addresses=[servers["answering"], servers["silent"]])
    watchdog.EXIT_GRACE_SECONDS = 3600  # never exit the test process
    try:
        for fake in fakes:  # both workers' steps hang, waiting for ps-1
            threading.Thread(target=fake._process_closure, args=(None,), daemon=True).start()
        request = tmp_path / "stop-ps-1"
        assert _eventually(request.exists)
        assert request.read_text().startswith("its server has not answered for 0.25s")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["stop-ps-1"]
        assert watchdog.error is None  # until the launcher has stopped it
        request.unlink()  # as the launcher does once ps-1 has exited
        assert _eventually(lambda: watchdog.error is not None)
        with pytest.raises(StepTimeoutError) as info:
            watchdog.raise_if_failed()
        assert info.value.tasks == ["ps-1"]
        assert str(info.value).startswith(
            "ps-1 is not responding: its server has not answered for 0.25s: it is frozen "
            "(e.g. SIGSTOP) or cut off. A ps holds the model's variables"), info.value
        assert not list(tmp_path.iterdir())  # no worker was asked to restart
    finally:
        for fake in fakes:
            fake.release.set()
        watchdog.stop()


def test_a_tf_error_naming_a_frozen_ps_waits_for_the_watchdog_to_name_it(
        servers):  # noqa: F811
    """Under load, a gRPC connection the chief opens to a ps after it froze may fail
    (UnavailableError, "timed out before receiving SETTINGS frame") before the probes
    find the ps silent: the chief raises the watchdog's error, naming the ps, not TF's.
    An error naming a ps that answers is left to the chief at once."""
    import types

    from tfdist.strategies.parameter_server import StepTimeoutError, _StepWatchdog

    coordinator = types.SimpleNamespace(_cluster=types.SimpleNamespace(
        workers=[_FakeWorker(0)]))
    watchdog = _StepWatchdog(coordinator, [servers["answering"]], 4.0, 60,
                             ps_addresses=[servers["answering"], servers["silent"]])
    watchdog.EXIT_GRACE_SECONDS = 3600  # never exit the test process
    unavailable = "failed to connect to all addresses. Additional GRPC error information " \
                  "from remote target /job:ps/replica:0/task:{} while calling Enqueue"
    try:
        watchdog.settle(RuntimeError(unavailable.format(0)))  # ps-0 answers: no wait
        assert watchdog.error is None
        with pytest.raises(StepTimeoutError) as info:
            watchdog.settle(RuntimeError(unavailable.format(1)))
        assert info.value.tasks == ["ps-1"]
        assert str(info.value).startswith("ps-1 is not responding: its server has not "
                                          "answered for 2s"), info.value
    finally:
        watchdog.stop()


def test_watchdog_blames_a_hung_worker_only_after_every_ps_answered(
        servers, tmp_path):  # noqa: F811
    """A step overdue while a ps has not yet answered a probe begun after it went overdue
    is not blamed (a ps slower to be found frozen than step_timeout); once it has, it is."""
    import time
    import types

    from tfdist.strategies.parameter_server import _StepWatchdog

    fakes = [_FakeWorker(0)]
    coordinator = types.SimpleNamespace(_cluster=types.SimpleNamespace(workers=fakes))
    watchdog = _StepWatchdog(coordinator, [servers["answering"]], 0.5, 60, str(tmp_path),
                             ps_addresses=[servers["answering"]])
    watchdog.stop()  # checks by hand from here, once its threads have ended
    assert _eventually(lambda: not any(t.name in ("tfdist-probe-ps-0", "tfdist-step-watchdog")
                                       for t in threading.enumerate()))
    request = tmp_path / "restart-worker-0"
    try:
        watchdog._running[0] = (object(), time.monotonic() - 1.0)  # overdue by 0.5 s
        watchdog._ps_answered[0] = time.monotonic() - 0.8  # before it went overdue
        watchdog.check()
        assert not request.exists()
        watchdog._ps_answered[0] = time.monotonic()
        watchdog.check()
        assert request.read_text() == ("it has not finished a step within step_timeout="
                                       "0.5s: it is hung or too slow")
    finally:
        fakes[0].release.set()


def test_launcher_kills_a_worker_to_restart_and_a_ps_to_stop_and_names_the_ps(tmp_path):
    """`PsWorkerRestarts.check` reads the chief's requests: ``restart-worker-1`` and
    ``stop-ps-0`` SIGKILL them; the ps's end is then worded with the chief's reason."""
    import io
    import types

    from tfdist.launch import PsWorkerRestarts

    def task(name):
        fake = types.SimpleNamespace(name=name, signals=[])
        fake.signal_group = fake.signals.append
        fake.poll = lambda: -9 if fake.signals else None  # SIGKILL ends it
        return fake

    tasks = [task("chief-0"), task("worker-0"), task("worker-1"), task("ps-0")]
    log = io.StringIO()
    policy = PsWorkerRestarts(0, log)
    with policy.attempt():
        for request, why in (("restart-worker-1", "hung"), ("stop-ps-0", "silent 30s")):
            (tmp_path / "x").write_text(why)
            os.replace(tmp_path / "x", os.path.join(policy.control_dir, request))
        policy.check(tasks)
        assert os.listdir(policy.control_dir) == []
    assert [t.signals for t in tasks] == [[], [], [signal.SIGKILL], [signal.SIGKILL]]
    assert "the chief asked to restart worker-1 (hung); killing it" in log.getvalue()
    assert ("the chief found ps-0 not responding (silent 30s); killing it, which ends the "
            "job") in log.getvalue()
    assert policy.failure_note(tasks[3]).startswith(
        ": ps-0 was not responding (silent 30s), so the chief had it killed")
    assert policy.failure_note(tasks[1]) == ""
