"""Elastic jobs (``tfdist launch --min-workers``, docs/elastic.md): lose a worker and
train on; a replacement joins the running job; the chief's role moves to the oldest
survivor. Real processes on one machine, as Horovod's own elastic tests.

Each launched job (tests/elastic_job.py) checks several things at once: the exit code,
the launcher's words, the survivors' processes (never restarted), the final weights
against single-process training with the same global batch, the step count, and who
saved the model.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ROOT, TESTS_DIR, assert_weights_close, require_horovod

EPOCHS = 3
STEPS = EPOCHS * 10  # elastic_job: 480 samples, global batch 48
# heartbeat_timeout of the jobs a worker joins: the members re-form at once and wait in
# Gloo's rendezvous, for at most this long, for the joiner still importing TensorFlow
# (docs/elastic.md, Limits); 5 s aborted the members on a loaded machine.
JOINER_HEARTBEAT = 30
# A kill soon after a replacement joined: the survivors re-form while the joiner traces
# its first step; 20 s aborted them in a CI run with two pytest workers.
SCHEDULE_HEARTBEAT = 60


@pytest.fixture(scope="module")
def reference():
    """Final weights of single-process training with the same global batch."""
    import elastic_job

    net = elastic_job.model()
    elastic_job.fit(net, EPOCHS)
    return net.get_weights()


def _launch(tmp_path, *flags, kill, workers=(3, 2), heartbeat=5, grow_after=None,
            **job_env):
    """Runs elastic_job under ``tfdist launch`` (``job_env``: more of its environment,
    e.g. ``JOB_PERIOD``); for each ``GROW`` event, asks the launcher for a worker
    (SIGUSR1) once the job has written that event's marker, and once more when the
    launcher has written ``grow_after``."""
    require_horovod()
    env = dict(os.environ, JOB_HEARTBEAT=str(heartbeat), PYTHONPATH=os.pathsep.join(
        [ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")]), **job_env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist.cli", "launch", "--workers", str(workers[0]),
         "--min-workers", str(workers[1]), "--timeout", "200", *flags,
         os.path.join(TESTS_DIR, "elastic_job.py"), str(tmp_path), str(EPOCHS), kill],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if grow_after is not None:
        return _launch_and_grow(proc, tmp_path, grow_after)
    try:
        for event in kill.split(","):
            if not event.endswith(":GROW"):
                continue
            marker = tmp_path / "grow-{}-{}".format(*event.split(":")[1:3])
            deadline = time.monotonic() + 200
            while not marker.exists() and proc.poll() is None and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=240)
    except BaseException:
        proc.kill()
        raise
    return _outcome(proc, stdout, stderr, tmp_path)


def told(done, chars=3000):
    """What a failed launch said: the tasks' output's tail, then the launcher's."""
    return (f"tasks' output (tail):\n{done.stdout[-chars:]}\n"
            f"launcher (tail):\n{done.stderr[-chars:]}")


def _launch_and_grow(proc, tmp_path, text):
    """Waits for ``text`` in the launcher's stderr, sends it SIGUSR1 (a worker joins),
    and returns `_launch`'s answer."""
    import threading

    lines, seen = [], threading.Event()

    def read_stderr():
        for line in proc.stderr:
            lines.append(line)
            if text in line:
                seen.set()
        seen.set()  # the launcher ended: nothing more will come

    out = []
    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        seen.wait(200)
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=240)
        for reader in readers:
            reader.join(timeout=10)
    except BaseException:
        proc.kill()
        raise
    return _outcome(proc, "".join(out), "".join(lines), tmp_path)


def _outcome(proc, stdout, stderr, tmp_path):
    """``(the launcher's CompletedProcess, {task: its json}, [[task, pid], ...])``."""
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    results = {name[:-5]: json.loads((tmp_path / name).read_text())
               for name in os.listdir(tmp_path) if name.endswith(".json")}
    starts = (tmp_path / "starts").read_text().split("\n")
    for line in starts:  # a frozen task is killed by the launcher; never leave one
        if line and not any(r["pid"] == int(line.split()[1]) for r in results.values()):
            _kill_if_ours(int(line.split()[1]), tmp_path)
    return done, results, [line.split() for line in starts if line]


# ---- in-process: options, plans, data positions ------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("fields, words", [
    ({"workers": 2, "min_workers": 3}, "min_workers must be <= workers"),
    ({"workers": 2, "max_workers": 3}, "max_workers is for elastic jobs"),
    ({"workers": 3, "min_workers": 2, "max_workers": 2}, "max_workers must be >= workers"),
    ({"workers": 2, "min_workers": 0}, "min_workers must be an integer >= 1"),
    ({"workers": 2, "chief": True, "ps": 1, "min_workers": 1}, "trains with workers"),
    ({"workers": 2, "min_workers": 1, "elastic_timeout": -1}, "elastic_timeout"),
])
def test_elastic_options_are_checked_before_anything_runs(fields, words):
    from tfdist.launch.options import LaunchOptions

    with pytest.raises(ValueError, match=words):
        LaunchOptions(**fields).check()


@pytest.mark.unit
def test_cli_and_launch_take_the_elastic_options():
    import inspect

    import tfdist
    from tfdist.cli import build_parser

    args = build_parser().parse_args(["launch", "--workers", "3", "--min-workers", "2",
                                      "--max-workers", "4", "--elastic-timeout", "30",
                                      "train.py"])
    assert (args.min_workers, args.max_workers, args.elastic_timeout) == (2, 4, 30.0)
    parameters = inspect.signature(tfdist.launch).parameters
    assert parameters["elastic_timeout"].default == 600.0
    assert {"min_workers", "max_workers"} <= set(parameters)


def test_engine_tf_is_refused_in_an_elastic_job(monkeypatch):
    import tfdist
    from tfdist import env

    monkeypatch.setenv(env.ELASTIC_ADDR, "127.0.0.1:1")
    cluster = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
               "task": {"type": "worker", "index": 0}}
    with pytest.raises(ValueError, match=r"needs engine='horovod': engine='tf' cannot "
                                         r"re-form its cluster inside a running process"):
        tfdist.MultiWorkerMirroredStrategy(cluster, engine="tf")


@pytest.mark.unit
def test_a_formation_shuts_down_only_the_sockets_opened_while_it_formed():
    """`Formation.close` ends the connections made between `opening` and `opened` (the
    peer reads EOF at once) and leaves older ones alone."""
    import socket

    from tfdist.engines.horovod.connections import Formation

    older = socket.socketpair()
    formation = Formation()
    formation.opening()
    mine = socket.socketpair()
    formation.opened()
    try:
        assert formation.close() >= 1
        assert mine[1].recv(1) == b""  # shut down: the peer sees the end at once
        older[0].sendall(b"x")
        assert older[1].recv(1) == b"x"
        assert formation.close() == 0  # once
    finally:
        for pair in (older, mine):
            for end in pair:
                end.close()


@pytest.mark.parametrize("options, named", [
    ({"fragments": 2}, "fragments=2"), ({"fragments": 2, "sync_delay": 1}, "sync_delay=1"),
    ({"outer_compression": "int8"}, "outer_compression='int8'"),
    ({"commit_every_steps": 4}, "commit_every_steps=4")])
def test_streaming_diloco_is_refused_in_an_elastic_job(monkeypatch, options, named):
    import tfdist
    from tfdist import env

    monkeypatch.setenv(env.ELASTIC_ADDR, "127.0.0.1:1")
    with pytest.raises(ValueError, match=r"In an elastic job .* Received: .*" + named):
        tfdist.ModelAverageStrategy(period=4, engine="horovod", **options)


@pytest.mark.unit
def test_plan_ranks_follow_hosts_in_order_of_their_oldest_member():
    from tfdist.engines.horovod.membership import plan_of

    plan = plan_of([("worker-1", "a"), ("worker-0", "b"), ("worker-2", "a")])
    assert {n: (s["rank"], s["local_rank"], s["cross_rank"], s["cross_size"])
            for n, s in plan.items()} == {"worker-1": (0, 0, 0, 2), "worker-2": (1, 1, 0, 1),
                                          "worker-0": (2, 0, 1, 2)}
    assert {s["size"] for s in plan.values()} == {3}


def test_membership_service_publishes_versions_and_collects_lost_reports(monkeypatch):
    require_horovod()
    from tfdist import env
    from tfdist.engines.horovod import membership

    monkeypatch.setenv(env.TOKEN, "job-token")  # the launcher gives it every task
    server = membership.MembershipServer("127.0.0.1", 2, 3, token="job-token")
    try:
        assert membership.fetch_state(server.address)["version"] == 0
        server.publish([("worker-0", "127.0.0.1"), ("worker-1", "127.0.0.1")])
        state = membership.wait_for_membership(server.address, "worker-1", 0, timeout=5)
        assert (state["version"], state["min_workers"], state["max_workers"]) == (1, 2, 3)
        assert membership.slot_env(state, "worker-1", server.address)["HOROVOD_RANK"] == "1"
        membership.report_lost(server.address, "worker-0", 1)
        membership.report_lost(server.address, "worker-1", 0)  # an older membership's
        assert server.reports() == {"worker-0"}
        with pytest.raises(TimeoutError, match="worker-2: .* no membership with this task "
                                               r"after version 0 within 0.2s"):
            membership.wait_for_membership(server.address, "worker-2", 0, timeout=0.2)
    finally:
        server.close()


def test_data_positions_rewind_and_skip_over_global_batches():
    import tensorflow as tf

    import tfdist
    from tfdist.strategies.elastic.data import ElasticDataset

    strategy = tfdist.MirroredStrategy(["/cpu:0"])
    dataset = tf.data.Dataset.range(12).batch(4)  # 3 global batches
    iterator = iter(ElasticDataset(dataset, strategy))
    assert next(iterator).numpy().tolist() == [0, 1, 2, 3]
    iterator.mark()  # a commit
    assert next(iterator).numpy().tolist() == [4, 5, 6, 7]
    iterator.rewind()  # a rollback: the batch comes again
    assert iterator.position == 1
    iterator.skip(1)  # another member's newer commit
    assert next(iterator).numpy().tolist() == [8, 9, 10, 11] and iterator.position == 3


def test_a_global_batch_must_divide_by_every_replica_count():
    from tfdist.strategies.elastic.data import check_elastic_batch

    check_elastic_batch(48, 1, (2, 4))
    check_elastic_batch(None, 1, (2, 4))
    with pytest.raises(ValueError, match="batch_size=40, which does not divide by 3"):
        check_elastic_batch(40, 1, (2, 4))


# ---- launched jobs ----------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_lost_worker_with_no_restart_left_leaves_two_that_end_at_the_reference(
        tmp_path, reference):
    done, results, starts = _launch(tmp_path, kill="worker-2:1:4")
    assert done.returncode == 0, told(done)
    assert "worker-2 exited with code -9 (signal SIGKILL); the elastic job carries on " \
           "with 2 worker(s) (worker-0, worker-1)" in done.stderr
    assert sorted(results) == ["worker-0", "worker-1"]
    for name, result in results.items():
        assert [pid for task, pid in starts if task == name] == [str(result["pid"])]
        assert result["size"] == 2 and result["recoveries"] == 1
        assert result["iterations"] == STEPS
        # every step commits, read inside the step but for each epoch's first commit
        assert result["fused_commits"] >= STEPS - 2 * EPOCHS, result
        assert result["commits"] - result["fused_commits"] >= EPOCHS, result
        assert_weights_close([np.array(w) for w in result["weights"]], reference)
    _assert_members_agree_at_every_step(results)
    assert os.listdir(tmp_path).count("saved-by-worker-0") == 1


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_commits_every_k_calls_of_several_steps_roll_back_at_most_k_calls(
        tmp_path, reference):
    """``commit_every_steps=3`` with ``steps_per_execution=2``: a commit every 6 steps;
    the kill after step 16 (epoch 1, batch 5) rolls back the steps since the last one,
    and they are trained again with the same global batches."""
    done, results, _ = _launch(tmp_path, kill="worker-2:1:5", JOB_COMMIT_EVERY="3",
                               JOB_STEPS_PER_EXECUTION="2")
    assert done.returncode == 0, told(done)
    assert sorted(results) == ["worker-0", "worker-1"]
    for result in results.values():
        assert result["size"] == 2 and result["iterations"] == STEPS
        assert 1 <= result["steps_lost"] <= 6, result["steps_lost"]
        # the 3rd call of each epoch's 5 commits, at its 2nd step (one epoch re-formed)
        assert EPOCHS - 1 <= result["fused_commits"] <= 2 * EPOCHS, result
        assert_weights_close([np.array(w) for w in result["weights"]], reference)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_worker_added_to_a_running_job_joins_and_the_end_equals_the_reference(
        tmp_path, reference):
    done, results, starts = _launch(tmp_path, "--max-workers", "3", kill="worker-0:1:2:GROW",
                                    workers=(2, 2), heartbeat=JOINER_HEARTBEAT)
    assert done.returncode == 0, told(done)
    assert "adds a worker (up to --max-workers 3)" in done.stderr
    assert "adding worker-2, which joins the running elastic job (3 workers)" in done.stderr
    assert sorted(results) == ["worker-0", "worker-1", "worker-2"]
    for name, result in results.items():
        assert [pid for task, pid in starts if task == name] == [str(result["pid"])]
        assert result["size"] == 3 and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], reference)
    _assert_members_agree_at_every_step(results)
    assert os.listdir(tmp_path).count("saved-by-worker-0") == 1


def _assert_members_agree_at_every_step(results):
    """Every step that several members ran left them with equal weights."""
    steps = [r["steps"] for r in results.values()]
    for key in set().union(*steps):
        held = [np.array(s[key]) for s in steps if key in s]
        for other in held[1:]:
            np.testing.assert_allclose(other, held[0], atol=1e-6, err_msg=key)


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_a_seeded_schedule_of_kills_and_joins_keeps_the_members_equal(tmp_path, reference):
    """worker-1 killed and replaced, worker-2 killed for good, a worker added: at
    batches drawn from a seed, one event per epoch. Gloo's timeout (heartbeat_timeout)
    also bounds each re-forming, and a replacement that has just joined may reach the
    next one seconds late (its first trace): `SCHEDULE_HEARTBEAT`."""
    rng = np.random.default_rng(2026)
    a, b, c = (int(rng.integers(2, 8)) for _ in range(3))
    schedule = f"worker-1:0:{a},worker-2:1:{b},worker-0:2:{c}:GROW"
    done, results, starts = _launch(tmp_path, "--max-restarts", "1", "--max-workers", "3",
                                    kill=schedule, heartbeat=SCHEDULE_HEARTBEAT)
    assert done.returncode == 0, schedule + "\n" + done.stderr[-3000:]
    assert "starting a replacement for worker-1" in done.stderr
    assert "worker-2 exited with code -9 (signal SIGKILL); the elastic job carries on " \
           "with 2 worker(s)" in done.stderr
    assert "adding worker-3, which joins the running elastic job (3 workers)" in done.stderr
    assert sorted(results) == ["worker-0", "worker-1", "worker-3"]
    assert [task for task, _ in starts].count("worker-1") == 2
    for result in results.values():
        assert result["size"] == 3 and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], reference)
    _assert_members_agree_at_every_step(results)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_lost_chief_is_replaced_by_a_joiner_and_the_oldest_survivor_saves(
        tmp_path, reference):
    done, results, starts = _launch(tmp_path, "--max-restarts", "1", kill="worker-0:1:4",
                                    heartbeat=JOINER_HEARTBEAT)
    assert done.returncode == 0, told(done)
    assert "restart 1/1: worker-0 exited with code -9 (signal SIGKILL); starting a " \
           "replacement for worker-0, which joins the running elastic job" in done.stderr
    assert sorted(results) == ["worker-0", "worker-1", "worker-2"]
    assert [task for task, _ in starts].count("worker-0") == 2  # the replacement
    for name in ("worker-1", "worker-2"):
        assert [pid for task, pid in starts if task == name] == [str(results[name]["pid"])]
    assert {n: r["rank"] for n, r in results.items()} == {
        "worker-1": 0, "worker-2": 1, "worker-0": 2}  # the joiner is the youngest
    for result in results.values():
        assert result["size"] == 3 and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], reference)
    saved = sorted(n for n in os.listdir(tmp_path) if n.startswith("saved-by-"))
    assert saved == ["saved-by-worker-1"]  # once, by the oldest survivor (rank 0)


def _kill_if_ours(pid, tmp_path):
    """SIGKILLs ``pid`` if it still runs elastic_job.py on ``tmp_path`` (pids are reused)."""
    import signal

    try:
        if str(tmp_path).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_frozen_worker_is_killed_named_and_the_others_train_on(tmp_path, reference):
    done, results, _ = _launch(tmp_path, kill="worker-1:1:4:STOP")
    assert done.returncode == 0, told(done)
    assert "worker-1 stopped answering Horovod: worker-0, worker-2 reported a lost peer " \
           "in membership 1" in done.stderr
    assert "worker-1 exited with code -9 (signal SIGKILL); the elastic job carries on " \
           "with 2 worker(s) (worker-0, worker-2)" in done.stderr
    assert sorted(results) == ["worker-0", "worker-2"]
    for result in results.values():
        assert result["size"] == 2 and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], reference)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_below_min_workers_past_the_elastic_timeout_fails_naming_who_is_missing(tmp_path):
    done, results, _ = _launch(tmp_path, "--elastic-timeout", "3", kill="worker-1:1:4",
                               workers=(2, 2))
    assert done.returncode == 1
    assert "the elastic job stayed below --min-workers 2 for more than --elastic-timeout " \
           "3s: 1 worker(s) left (worker-0); missing: worker-1 exited with code -9 " \
           "(signal SIGKILL)" in done.stderr, done.stderr[-3000:]
    assert not results
