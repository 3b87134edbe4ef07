"""``engine="horovod"``: Horovod/Gloo as the engine of the synchronous strategies,
started by tfdist itself (no horovodrun), against the same references as ``engine="tf"``.

- ``tfdist launch --workers 2``: `MultiWorkerMirroredStrategy` equals the single-process
  reference; with fp16 compression it stays within 2e-3 at half the bytes; with
  ``accumulate_steps=2`` it equals one step on the doubled batch; `ModelAverageStrategy`
  at period 1 (plain SGD) equals the reference and at period 4 the numpy local SGD.
- The same with 2 processes x 2 logical CPUs (one replica per process, as stock).
- A TF_CONFIG job not started by tfdist (plain subprocesses, hand-written TF_CONFIG).
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from helpers import (TESTS_DIR, assert_weights_close, classification_data, mlp,
                     require_horovod, run_cluster)
from test_model_average import GLOBAL_BATCH, fit_linear, linear_data, numpy_local_sgd

LR = 0.1
FP16_ATOL = 2e-3


@pytest.fixture(scope="module")
def horovod_installed():
    require_horovod()


def _fit_mlp(strategy, batch=GLOBAL_BATCH, epochs=2):
    import keras

    x, y = classification_data(n=64)
    with strategy.scope() if strategy is not None else _nothing():
        model = mlp()
        model.compile(keras.optimizers.SGD(LR),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def engine_task(logical_cpus=0, full=True):
    """Every engine="horovod" check of one process of a 2-process job."""
    if logical_cpus:
        import tfdist

        tfdist.devices.use_logical_cpus(logical_cpus)
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(engine="horovod")
    out = {"engine": strategy.engine, "replicas": strategy.num_replicas_in_sync,
           "chief": strategy.is_chief, "sync": _fit_mlp(strategy)}
    x, y = linear_data(n=80)
    average = tfdist.ModelAverageStrategy(period=4, engine="horovod")
    initial, model = fit_linear(average, x, y, epochs=2)
    out["average4"] = {"initial": initial, "weights": model.get_weights()}
    if full:
        fp16 = tfdist.MultiWorkerMirroredStrategy(engine="horovod", compression="fp16")
        out["fp16"] = (_fit_mlp(fp16), fp16.bytes_communicated, strategy.bytes_communicated)
        accumulate = tfdist.MultiWorkerMirroredStrategy(engine="horovod", accumulate_steps=2)
        out["accumulate"] = _fit_mlp(accumulate, batch=GLOBAL_BATCH // 2)
        out["average1"] = _fit_mlp(tfdist.ModelAverageStrategy(period=1, engine="horovod"))
    out["peers_answer"] = _peers_answer()
    if strategy.is_chief:
        out["reference"] = _fit_mlp(None)
    return out


def _peers_answer():
    """{peer: whether it answers the liveness probe} (rank 0: Gloo's rendezvous; others:
    their liveness server), as a frozen peer's survivor probes them. Ends with a
    barrier, so that no task exits while another probes it."""
    from tfdist.comm.liveness import is_responsive
    from tfdist.engines.horovod import ops as comm
    from tfdist.engines.horovod.rendezvous import peer_addresses

    answers = {name: is_responsive(address, 30) for name, address in
               peer_addresses().items()}
    comm.allreduce([1.0], name="tfdist.test.probed")
    return answers


def _check(results, full=True, replicas=2):
    chief, other = results
    assert chief["chief"] and not other["chief"]
    assert chief["peers_answer"] == {"worker-1": True}, chief["peers_answer"]
    assert other["peers_answer"] == {"worker-0": True}, other["peers_answer"]
    assert chief["engine"] == "horovod" and chief["replicas"] == replicas
    reference = chief["reference"]
    assert_weights_close(chief["sync"], other["sync"], atol=0)
    assert_weights_close(chief["sync"], reference, atol=1e-5)
    x, y = linear_data(n=80)
    initial = chief["average4"]["initial"]
    expected = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=4,
                               replicas=replicas)
    for result in results:
        assert_weights_close(result["average4"]["weights"], expected, atol=1e-5)
    if not full:
        return
    weights, fp16_bytes, plain_bytes = chief["fp16"]
    assert_weights_close(weights, reference, atol=FP16_ATOL)
    assert fp16_bytes * 2 == plain_bytes, (fp16_bytes, plain_bytes)
    # accumulate_steps=2 on batches of 8 = one step on each batch of 16 (the reference).
    assert_weights_close(chief["accumulate"], reference, atol=1e-5)
    assert_weights_close(chief["average1"], reference, atol=1e-5)
    assert_weights_close(chief["average1"], other["average1"], atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_horovod_engine_under_tfdist_launch(horovod_installed):
    _check(run_cluster(engine_task, timeout=280))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_horovod_engine_two_processes_of_two_logical_cpus(horovod_installed):
    """Logical CPUs are not replicas (as stock MultiWorkerMirroredStrategy and
    engine="tf"): one CPU per worker, 2 replicas in sync."""
    _check(run_cluster(engine_task, 2, False, timeout=280), full=False, replicas=2)


_PLAIN_TASK = textwrap.dedent("""
    import pickle, sys
    sys.path[:0] = [{tests!r}, {root!r}]
    import test_engines
    result = test_engines.engine_task(0, False)
    with open(sys.argv[1], "wb") as f:
        pickle.dump(result, f)
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_horovod_engine_in_a_tf_config_job_not_started_by_tfdist(horovod_installed, tmp_path):
    from tfdist.launch import find_free_ports

    ports = find_free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    code = _PLAIN_TASK.format(tests=TESTS_DIR, root=os.path.dirname(TESTS_DIR))
    procs = []
    try:
        for index in range(2):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            procs.append(subprocess.Popen([sys.executable, "-c", code,
                                           str(tmp_path / f"{index}.pkl")],
                                          env=env, start_new_session=True))
        for proc in procs:
            assert proc.wait(timeout=240) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    results = [pickle.loads((tmp_path / f"{i}.pkl").read_bytes()) for i in range(2)]
    _check(results, full=False)


@pytest.mark.unit
def test_engine_names_are_checked():
    from tfdist.engines import select_engine

    with pytest.raises(ValueError, match=r"engine must be one of .*Received: engine='gloo'"):
        select_engine("gloo", 2, on_gpus=False)
    assert select_engine("horovod", 2, on_gpus=False) == "horovod"
    assert select_engine("tf", 2, on_gpus=False) == "tf"


@pytest.mark.unit
def test_auto_picks_the_measured_engine(monkeypatch, caplog):
    from tfdist.engines import registry as engines

    monkeypatch.delenv(engines.ENV_VAR, raising=False)
    monkeypatch.setattr(engines, "_logged", set())
    monkeypatch.setattr(engines, "_horovod_installed", lambda: True)
    with caplog.at_level("INFO", logger="tfdist"):
        assert engines.select_engine("auto", 2, on_gpus=False) == "horovod"
        assert engines.select_engine("auto", 2, on_gpus=False, is_chief=True) == "horovod"
    assert [r.getMessage() for r in caplog.records].count(
        "engine='auto' chose 'horovod' for 2 workers: Gloo's all-reduce is faster than TF's "
        "gRPC ring on CPUs (see tfdist.engines).") == 1  # once per job
    assert engines.select_engine("auto", 1, on_gpus=False) == "tf"
    assert engines.select_engine("auto", 2, on_gpus=True) == "tf"
    monkeypatch.setattr(engines, "_horovod_installed", lambda: False)
    assert engines.select_engine("auto", 2, on_gpus=False) == "tf"
    monkeypatch.setenv(engines.ENV_VAR, "horovod")
    assert engines.select_engine("auto", 2, on_gpus=False) == "horovod"
    assert engines.select_engine("tf", 2, on_gpus=False) == "tf"  # explicit wins
    monkeypatch.setenv(engines.ENV_VAR, "gloo")
    with pytest.raises(ValueError, match="TFDIST_ENGINE must be 'tf' or 'horovod'"):
        engines.select_engine("auto", 2, on_gpus=False)


def peer_fault_task(result_dir, fault):
    """worker-0 (rank 0, the rendezvous host) freezes (SIGSTOP), or worker-1 dies
    (SIGKILL), after 3 steps of fit (engine="auto")."""
    import signal

    import keras

    import tfdist

    me = os.environ["TFDIST_TASK"]
    victim = "worker-0" if fault == "stop" else "worker-1"
    with open(os.path.join(result_dir, f"{me}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if fault == "kill" and me != victim:
        # The launcher SIGTERMs the survivor when the victim dies: let it write its error.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    strategy = tfdist.MultiWorkerMirroredStrategy(heartbeat_timeout=5)
    assert strategy.engine == "horovod", strategy.engine

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if me == victim and batch == 2:
                os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)

    x, y = classification_data(n=64)
    with strategy.scope():
        model = mlp()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x, y, batch_size=8, epochs=50, verbose=0, callbacks=[Fault()])
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        with open(os.path.join(result_dir, f"{me}.error"), "w") as f:
            f.write(f"{type(error).__name__}: {error}")
        raise
    return "finished"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_horovod_engine_frozen_or_killed_peer_ends_the_job(horovod_installed, tmp_path,
                                                           fault):
    """The default engine on CPU: a frozen peer stops the survivor after heartbeat_timeout
    (Gloo's timeout), a killed one at once; the survivor's error names it, and the
    launcher fails the job. The frozen one is worker-0 (issue 14: "a frozen worker-0
    should be named"), whose rendezvous server is what the survivor probes."""
    import tfdist
    from helpers import RESULT_DIR_MARK, assert_no_leftover_processes

    try:
        with pytest.raises(tfdist.LaunchError) as info:
            # kill: the survivor ignores SIGTERM and exits by itself once it has failed.
            run_cluster(peer_fault_task, str(tmp_path), fault, timeout=120, stream=None,
                        grace_period=1 if fault == "stop" else 60,
                        env={RESULT_DIR_MARK: str(tmp_path)})
    finally:
        assert_no_leftover_processes(tmp_path)
    if fault == "kill":
        assert info.value.task == "worker-1" and info.value.returncode == -9, info.value
        error = (tmp_path / "worker-0.error").read_text()
        assert error.startswith(
            "UnknownError: worker-0: worker-1 is not running (nothing listens at "
            "127.0.0.1:"), error
        assert "): killed or exited. Horovod said: Horovod has been shut down." in error, error
    else:
        assert info.value.task == "worker-1", info.value
        error = (tmp_path / "worker-1.error").read_text()
        assert error.startswith(
            "UnknownError: worker-1: worker-0 did not answer Horovod within "
            "heartbeat_timeout=5s, nor a liveness probe within 2s: it is frozen (e.g. "
            "SIGSTOP), overloaded or unreachable. Horovod said: Horovod has been shut "
            "down."), error


def test_horovod_peer_error_names_silent_and_dead_peers(monkeypatch):
    """In one process: of three peers, the one whose port accepts but never answers is
    named as frozen, the one whose port is closed as not running, the live one not at
    all; an error that is not Horovod's, or with every peer answering, is unchanged."""
    import socket

    import tensorflow as tf

    from tfdist.engines.horovod import rendezvous as comm
    from tfdist.engines.base import EngineSetup
    from tfdist.engines.horovod.engine import HorovodEngine
    from tfdist.launch import find_free_ports

    alive = comm._serve_liveness("127.0.0.1", find_free_ports(1)[0])
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # the kernel accepts connections; nobody answers (as under SIGSTOP)
    closed = find_free_ports(1)[0]
    peers = {"worker-1": f"127.0.0.1:{alive.server_address[1]}",
             "worker-2": f"127.0.0.1:{silent.getsockname()[1]}",
             "worker-3": f"127.0.0.1:{closed}"}
    engine = HorovodEngine(EngineSetup(
        heartbeat_timeout=5.0, collective_timeout=3.0, task_name="worker-0"))
    monkeypatch.delenv(comm.GLOO_TIMEOUT_ENV, raising=False)
    shut_down = tf.errors.UnknownError(None, None, (
        "Graph execution error:\n\n  File \"x.py\", line 1, in f\n\nHorovod has been "
        "shut down. This was caused by an exception on one of the ranks.\n\t [[{{node "
        "tfdist.allreduce.14_0}}]] [Op:__inference_step_580]"))
    try:
        monkeypatch.setattr(comm, "_peers", peers)
        error = engine.peer_error(shut_down)
        assert type(error) is tf.errors.UnknownError
        assert error.message == (
            "worker-0: worker-2 did not answer Horovod within collective_timeout=3s, nor a "
            "liveness probe within 2s: it is frozen (e.g. SIGSTOP), overloaded or "
            f"unreachable; worker-3 is not running (nothing listens at 127.0.0.1:{closed}): "
            "killed or exited. Horovod said: Horovod has been shut down. This was caused "
            "by an exception on one of the ranks."), error.message
        other = tf.errors.UnknownError(None, None, "something else")
        assert engine.peer_error(other) is other
        monkeypatch.setattr(comm, "_peers", {"worker-1": peers["worker-1"]})
        assert engine.peer_error(shut_down) is shut_down
    finally:
        alive.shutdown()
        alive.server_close()
        silent.close()


def test_horovod_mesh_watch_names_a_silent_peer_once(monkeypatch):
    """Issue 39: on a data x model mesh Horovod aborts a task (SIGABRT) when a peer
    freezes, so its engine watches the peers during fit: of a live, a silent (accepts,
    never answers) and a closed port, only the silent one is named, once, in one line
    the launcher quotes. Without process sets (one model group) nothing is watched."""
    import contextlib
    import io
    import socket

    from tfdist.engines.base import EngineSetup
    from tfdist.engines.horovod import ops, watch
    from tfdist.engines.horovod import rendezvous as comm
    from tfdist.engines.horovod.engine import HorovodEngine
    from tfdist.launch import find_free_ports
    from tfdist.launch.results import failure_cause

    alive = comm._serve_liveness("127.0.0.1", find_free_ports(1)[0])
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    peers = {"worker-1": f"127.0.0.1:{silent.getsockname()[1]}",
             "worker-2": f"127.0.0.1:{alive.server_address[1]}",
             "worker-3": f"127.0.0.1:{find_free_ports(1)[0]}"}
    engine = HorovodEngine(EngineSetup(heartbeat_timeout=4.0, task_name="worker-0"))
    monkeypatch.delenv(comm.GLOO_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(comm, "_peers", peers)
    try:
        monkeypatch.setattr(ops, "_sets", ops.ProcessSets())
        assert isinstance(engine.watch_peers(), contextlib.nullcontext)  # one group
        ops._sets.started[(0, 1)] = object()
        watcher = engine.watch_peers()
        assert isinstance(watcher, watch.PeerWatch)
        assert (watcher.interval, watcher.probe_timeout) == (0.8, 1.0)
        said = io.StringIO()
        watcher.stream = said
        assert watcher.check() == ["worker-1"]
        assert watcher.check() == []  # named once
        line = said.getvalue()
        assert line == (
            f"tfdist: worker-0: worker-1 is not responding: two liveness probes in a row at "
            f"{peers['worker-1']} failed (no answer within 1s): it is frozen (e.g. SIGSTOP), "
            "overloaded or unreachable; Gloo's timeout (heartbeat_timeout=4s) ends the job "
            "unless it answers again\n"), line
        assert failure_cause("worker-0", -6, line + "terminate called").endswith(
            "it found worker-1 not responding (two liveness probes in a row at "
            f"{peers['worker-1']} failed (no answer within 1s): it is frozen (e.g. SIGSTOP), "
            "overloaded or unreachable)")
    finally:
        alive.shutdown()
        alive.server_close()
        silent.close()


def missing_peer_task(result_dir):
    """worker-1 never starts; worker-0 must name it after startup_timeout."""
    import tfdist

    me = os.environ["TFDIST_TASK"]
    if me == "worker-1":
        return "absent"
    try:
        tfdist.MultiWorkerMirroredStrategy(engine="horovod", startup_timeout=5)
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        return f"{type(error).__name__}: {error}"
    return "started"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_horovod_engine_names_a_task_that_never_joins(horovod_installed, tmp_path):
    chief, absent = run_cluster(missing_peer_task, str(tmp_path), timeout=100)
    assert absent == "absent"
    assert chief.startswith("DeadlineExceededError: worker-0: task(s) worker-1 did not join "
                            "the cluster within startup_timeout=5s"), chief
