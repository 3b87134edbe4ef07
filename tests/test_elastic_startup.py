"""Elastic jobs at their edges (docs/elastic.md): a worker lost before any Horovod
formation, every member lost with no restart left, and a node cut off from node 0.

A task is a joiner only when the job had formed before the task's first membership
(the membership service's ``formed``); a worker that dies during start-up leaves
starters, who train on as one job and end at the single-process reference.
"""

import io
import time
import types

import numpy as np
import pytest

from helpers import assert_weights_close, require_horovod
from test_elastic import (SCHEDULE_HEARTBEAT, STEPS, _assert_members_agree_at_every_step,
                          _launch, reference, told)  # noqa: F401 (a fixture)


# ---- a worker lost before the first formation ------------------------------------

def test_a_membership_is_formed_once_a_member_reports_forming_it(monkeypatch):
    """Until a member reports a formation no membership is ``formed`` (a task that
    first forms then starts the job); after it every membership is. A report must
    name its key and a version published so far."""
    require_horovod()
    from tfdist import env
    from tfdist.engines.horovod import membership

    monkeypatch.setenv(env.TOKEN, "job-token")
    server = membership.MembershipServer("127.0.0.1", 2, 3, token="job-token",
                                         log=io.StringIO())
    try:
        server.publish([("worker-0", "h"), ("worker-1", "h"), ("worker-2", "h")])
        server.publish([("worker-0", "h"), ("worker-1", "h")])  # worker-2 died
        assert membership.fetch_state(server.address)["formed"] is False
        membership.report_formed(server.address, "worker-0", 3)  # not published yet
        monkeypatch.setenv(env.TOKEN, "another-token")
        membership.report_formed(server.address, "worker-0", 2)  # not signed for the job
        assert membership.fetch_state(server.address)["formed"] is False
        monkeypatch.setenv(env.TOKEN, "job-token")
        membership.report_formed(server.address, "worker-1", 2)
        assert membership.fetch_state(server.address)["formed"] is True
        server.publish([("worker-0", "h"), ("worker-1", "h"), ("worker-3", "h")])
        state = membership.fetch_state(server.address)
        assert (state["version"], state["formed"]) == (3, True)
    finally:
        server.close()


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("restarts", [0, 1], ids=["carries-on", "replaced"])
def test_a_worker_lost_before_any_formation_leaves_starters_at_the_reference(
        tmp_path, reference, restarts):
    """worker-2 exits 1 before it makes its strategy; worker-0 and worker-1 (and, with
    a restart, worker-2's replacement) first form with membership 2. They start the job
    (no joiner, no NoStateLeftError) and end at one process with the same global batch
    (it used to fail: each took itself for a joiner and found no member holding the
    state). The members wait in Gloo's rendezvous for the replacement, which imports
    TensorFlow meanwhile: `SCHEDULE_HEARTBEAT` (5 s aborted them; 30 s aborted the
    joiner tests' members at a load of 10 on 2 cores; docs/elastic.md, Limits)."""
    done, results, starts = _launch(tmp_path, "--max-restarts", str(restarts),
                                    kill="worker-2:0:0:START",
                                    heartbeat=SCHEDULE_HEARTBEAT if restarts else 5)
    output = done.stdout + done.stderr
    names = ["worker-0", "worker-1", "worker-2"][:2 + restarts]
    assert done.returncode == 0, told(done)
    assert ("restart 1/1: worker-2 exited with code 1; starting a replacement for "
            "worker-2, which starts the job with the others (none has formed Horovod yet)"
            if restarts else "worker-2 exited with code 1; the elastic job carries on with "
            "2 worker(s) (worker-0, worker-1)") in done.stderr
    for name in names:
        assert f"{name}: joins Horovod: membership 2, rank" in output, output[-3000:]
    assert "takes the state of rank" not in output
    assert "no member of the elastic job holds its training state" not in output
    assert sorted(results) == names
    for name, result in results.items():
        assert [pid for task, pid in starts if task == name][-1] == str(result["pid"])
        assert result["size"] == len(names) and result["recoveries"] == 0
        assert result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], reference)
    _assert_members_agree_at_every_step(results)


# ---- every member lost, no restart left ---------------------------------------------

def _stateless_policy(max_restarts, used):
    from tfdist.launch.elastic import ElasticRestarts

    policy = ElasticRestarts(max_restarts, io.StringIO(), host="127.0.0.1", min_workers=2,
                             max_workers=3, elastic_timeout=60, token="t")
    policy.used = used
    policy.removed = ["worker-0 exited with code -9 (signal SIGKILL)"]
    tail = ("worker-3: no member of the elastic job holds its training state (membership "
            "4: worker-3, each started after every member that trained was lost); fit has "
            "a backup in /data/run 1/backup: the launcher starts the whole job again while "
            "--max-restarts allow, which resumes from it")
    worker = types.SimpleNamespace(tail_text=lambda: tail)
    assert policy._no_state_left([worker])
    return policy, worker


@pytest.mark.unit
def test_every_member_lost_with_a_backup_and_no_restart_left_says_the_job_fails():
    """With a restart left, the job starts again from fit's backup; with none, the note
    says it fails, does not start again, and how to resume (it used to say the job
    starts again from the backup, and then failed)."""
    policy, worker = _stateless_policy(max_restarts=2, used=1)
    assert policy.failure_note(worker).endswith("; the job starts again from fit's backup")
    assert policy.restart_job() == 2

    policy, worker = _stateless_policy(max_restarts=1, used=1)
    note = policy.failure_note(worker)
    assert "starts again from" not in note
    assert note.endswith(
        "; fit has a backup in /data/run 1/backup, but no restart is left (1/1 used): the "
        "job fails and does not start again; run the same command again to resume from "
        "the backup"), note
    assert "was lost (worker-0 exited with code -9 (signal SIGKILL))" in note
    assert policy.restart_job() is None


# ---- a node cut off from node 0 --------------------------------------------------

class _Beats:
    """A node's `NodeBeats` stand-in: node 0 last answered ``silent`` seconds ago."""

    instances = 0

    def __init__(self, master, token, rank, addr, workers, silent=0.0):
        type(self).instances += 1
        self.master, self.rank, self.token = master, rank, token
        self.contact = time.monotonic() - silent
        self.answer = {"names": ["worker-1"], "dropped": False, "ended": None, "kill": [],
                       "starts": {},
                       "cluster": {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}}
        self.rejoins = []

    def wait_for_answer(self, timeout, rejoin=None):
        self.rejoins.append(rejoin)
        if rejoin is not None:
            from tfdist.launch.results import LaunchError

            raise LaunchError(f"node 1: {rejoin}, and node 0 did not take it back")
        return self.answer

    def close(self):
        pass


@pytest.mark.unit
def test_a_node_silent_node_0_past_the_node_timeout_stops_its_workers_and_joins_again(
        monkeypatch):
    """Node 0 drops a node it has not heard from for `NODE_TIMEOUT` (5 s), and the node
    takes node 0's silence as the same: it stops its workers and joins again with a new
    launcher incarnation (it used to fail), failing only when node 0 does not take it
    back within --join-timeout."""
    from tfdist.launch import elastic_node
    from tfdist.launch.elastic_wire import NODE_TIMEOUT
    from tfdist.launch.options import LaunchOptions
    from tfdist.launch.results import LaunchError

    assert NODE_TIMEOUT == 5.0  # docs/elastic.md ("Several hosts") names it
    log = io.StringIO()
    fresh = elastic_node.ElasticNode(_Beats("m:1", "t", 1, "a", 1), log, "m:1", 60)
    fresh.check([])  # node 0 answers: nothing happens
    cut = elastic_node.ElasticNode(
        _Beats("m:1", "t", 1, "a", 1, silent=NODE_TIMEOUT + 3), log, "m:1", 60)
    with pytest.raises(elastic_node._Dropped, match=r"node 1 heard nothing from node 0 at "
                                                    r"m:1 for \d+s \(the network was cut"):
        cut.check([])

    beats = []

    def new_beats(*args):
        beats.append(_Beats(*args, silent=NODE_TIMEOUT + 3))
        return beats[-1]

    def run_attempt(argv, cluster, options, attempt, policy, **kwargs):
        policy.check([])  # node 0 silent: raises _Dropped
        raise AssertionError("the node went on")

    monkeypatch.setattr(elastic_node, "NodeBeats", new_beats)
    monkeypatch.setattr(elastic_node, "run_attempt", run_attempt)
    options = LaunchOptions(workers=1, nnodes=2, node_rank=1, master="m:1",
                            min_workers=1, join_timeout=7)
    with pytest.raises(LaunchError, match="node 1: node 1 heard nothing from node 0 .* and "
                                          "node 0 did not take it back"):
        elastic_node._run_node(["train.py"], options, log, "t", "a")
    assert beats[0].rejoins == [None] and beats[1].rejoins[0].startswith(
        "node 1 heard nothing from node 0 at m:1 for ")
    assert "its workers were stopped, and it joins the job again (node 0 must take it " \
           "back within --join-timeout 7s)" in log.getvalue()


@pytest.mark.unit
def test_a_node_that_node_0_does_not_take_back_fails_naming_node_0():
    """A node joining again after node 0's silence waits --join-timeout for node 0 (here
    none listens) and then fails, naming node 0 and why it joined again."""
    from tfdist.launch.elastic_node import NodeBeats
    from tfdist.launch.results import LaunchError

    beats = NodeBeats("127.0.0.1:9", "t", 1, "127.0.0.1", 1)
    try:
        with pytest.raises(LaunchError, match=r"node 1: node 0 went silent, and node 0 did "
                                              r"not take this node back within "
                                              r"--join-timeout 0.3s: node 0 is lost"):
            beats.wait_for_answer(0.3, rejoin="node 0 went silent")
    finally:
        beats._stop.set()


# ---- a worker added: listed once it is ready ---------------------------------------

class _Task:
    """A launched task's stand-in: a spec, a name, running."""

    def __init__(self, spec):
        self.spec, self.name = spec, spec.name

    @staticmethod
    def poll():
        return None


def test_an_added_worker_is_listed_only_once_it_reports_ready(monkeypatch):
    """The launcher starts an added worker at once but lists it (a new membership, which
    makes the members re-form and wait in Gloo's rendezvous) only when the worker says,
    signed with the job's token, that it is about to form. Listed at its start, the
    members waited for a joiner still importing TensorFlow and, on a loaded machine,
    Gloo's timeout aborted them."""
    require_horovod()
    from tfdist import env
    from tfdist.cluster import ClusterSpec, TaskSpec
    from tfdist.engines.horovod import membership
    from tfdist.launch.elastic import ElasticRestarts

    log = io.StringIO()
    policy = ElasticRestarts(0, log, host="127.0.0.1", min_workers=2, max_workers=3,
                             elastic_timeout=60, token="job-token")
    tasks = [_Task(TaskSpec("worker", i)) for i in range(2)]
    with policy.attempt():
        policy.check(tasks)
        address = policy.server.address
        policy.add_worker()
        policy.grow(tasks, ClusterSpec(worker=("a:1", "a:2")),
                    lambda spec, restart, cluster: _Task(spec))
        assert [t.name for t in tasks] == ["worker-0", "worker-1", "worker-2"]
        assert "adding worker-2, which joins the running elastic job (3 workers)" in \
            log.getvalue()
        policy.add_worker()  # a fourth: past --max-workers, with worker-2 not yet listed
        policy.grow(tasks, None, None)
        assert "already has --max-workers 3 (3): none added" in log.getvalue()
        monkeypatch.setenv(env.TOKEN, "another-token")
        assert not membership.report_ready(address, "worker-2", timeout=0)
        monkeypatch.setenv(env.TOKEN, "job-token")
        assert membership.report_ready(address, "worker-1", timeout=0)  # not joining
        policy.check(tasks)
        assert membership.fetch_state(address)["version"] == 1
        assert membership.report_ready(address, "worker-2", timeout=0)
        policy.check(tasks)
        state = membership.fetch_state(address)
        assert state["version"] == 2
        assert [m["name"] for m in state["members"]] == ["worker-0", "worker-1", "worker-2"]
        assert "worker-2 ready: membership 2 takes it in (3 workers)" in log.getvalue()
        policy.check(tasks)
        assert membership.fetch_state(address)["version"] == 2  # listed once


def test_an_added_worker_lost_before_it_is_ready_changes_no_membership():
    """A joiner that dies before it reports ready was never listed: the members are not
    made to re-form, and a replacement (while restarts allow) is listed once it is
    ready, as the joiner would have been."""
    require_horovod()
    from tfdist.cluster import ClusterSpec, TaskSpec
    from tfdist.launch.elastic import ElasticRestarts

    for restarts, outcome in [(0, False), (1, True)]:
        log = io.StringIO()
        policy = ElasticRestarts(restarts, log, host="127.0.0.1", min_workers=2,
                                 max_workers=3, elastic_timeout=60, token="job-token")
        tasks = [_Task(TaskSpec("worker", i)) for i in range(2)]
        with policy.attempt():
            policy.check(tasks)
            policy.add_worker()
            policy.grow(tasks, ClusterSpec(worker=("a:1", "a:2")),
                        lambda spec, restart, cluster: _Task(spec))
            assert policy.lose("worker-2", "127.0.0.1", "worker-2 exited with code 1") \
                is outcome
            assert policy.server.version == 1
            assert ("worker-2" in policy.joining) is outcome
