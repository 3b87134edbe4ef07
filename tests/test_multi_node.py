"""Multi-node `tfdist launch`: two network namespaces joined by a veth pair act as hosts.

Each "host" runs ``tfdist launch --nnodes 2 --node-rank R --master ADDR:PORT`` (through
``ip netns exec``). The namespaces are made once per module and removed at its end.
The rendezvous rules (refusals, fail-fast messages) and GPU pinning are also checked
without namespaces, on loopback and with a faked GPU list.
"""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import tfdist
from tfdist.launch import gpus, rendezvous
from tfdist.launch import find_free_ports

from helpers import TESTS_DIR, assert_weights_close, tcp_listener

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

REPO = os.path.dirname(TESTS_DIR)
TOKEN = "s3cret-test-token"


# ---- two hosts -----------------------------------------------------------------------------

class Hosts:
    """Two namespaces ``names`` with veth addresses ``addrs`` (node 0, node 1)."""

    def __init__(self, names, addrs):
        self.names, self.addrs = names, addrs

    def pids(self, rank):
        out = subprocess.run(["ip", "netns", "pids", self.names[rank]], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2)")
    pid = os.getpid()
    names = [f"tfdist{pid}n0", f"tfdist{pid}n1"]
    links = [f"tfd{pid}v0", f"tfd{pid}v1"]  # <= 15 characters
    subnet = f"10.{200 + pid % 50}.{pid // 50 % 250}"
    addrs = [f"{subnet}.1", f"{subnet}.2"]
    made = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", links[0], "netns", names[0], "type", "veth",
            "peer", "name", links[1], "netns", names[1])
        for name, link, addr in zip(names, links, addrs):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield Hosts(names, addrs)
    finally:
        for name in made:  # whatever a failed test left in them, then the namespace
            for task in Hosts(names, addrs).pids(names.index(name)):
                try:
                    os.kill(task, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, REPO, env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _start_node(hosts, rank, script, *args, master_port, options=(), env=None):
    """Starts node ``rank``'s launcher in its namespace (``hosts`` None: on loopback);
    returns the Popen."""
    prefix = [] if hosts is None else ["ip", "netns", "exec", hosts.names[rank]]
    master = "127.0.0.1" if hosts is None else hosts.addrs[0]
    argv = [*prefix, sys.executable, "-m", "tfdist.cli",
            "launch", "--nnodes", "2", "--node-rank", str(rank),
            "--master", f"{master}:{master_port}", "--workers", "1",
            *options, str(script), *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(env), cwd=REPO, start_new_session=True)


def _finish(process, timeout=240):
    """(exit code, output) of a launcher; killed (and failed) if it outlives ``timeout``."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"launcher still running after {timeout}s:\n{output[-3000:]}")
    return process.returncode, output


def _port():
    return 29000 + os.getpid() % 1000  # only used inside the namespaces: no clash outside


def _script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ---- across two hosts ----------------------------------------------------------------------

_TRAIN = """
    import json, os, sys
    import numpy as np
    import tfdist
    from test_multi_worker import _fit
    from helpers import classification_data

    strategy = tfdist.MultiWorkerMirroredStrategy(startup_timeout=90, collective_timeout=120)
    out, me = sys.argv[1], os.environ["TFDIST_TASK"]
    x, y = classification_data(n=64)
    weights = _fit(strategy, x, y, "sgd", False)["weights"]
    np.savez(os.path.join(out, me + ".npz"), *weights)
    if me == "worker-0":
        np.savez(os.path.join(out, "reference.npz"), *_fit(None, x, y, "sgd", False)["weights"])
"""


def _load(path):
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def run_two_nodes(hosts, tmp_path, job: str, port_offset: int = 0) -> None:
    """Runs the script ``job`` on both namespaces' nodes; both must exit 0."""
    script = _script(tmp_path, job)
    port = _port() + port_offset
    nodes = [_start_node(hosts, r, script, tmp_path, master_port=port,
                         options=("--token", TOKEN, "--join-timeout", "120"))
             for r in (0, 1)]
    results = [_finish(n) for n in nodes]
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"node {rank}:\n{output[-4000:]}"


@pytest.mark.slow
def test_two_node_multi_worker_job_matches_the_single_process_reference(hosts, tmp_path):
    run_two_nodes(hosts, tmp_path, _TRAIN)
    reference = _load(tmp_path / "reference.npz")
    for task in ("worker-0", "worker-1"):
        assert_weights_close(_load(tmp_path / f"{task}.npz"), reference, atol=1e-5)


_SLEEP = """
    import json, os, sys, time
    out, me = sys.argv[1], os.environ["TFDIST_TASK"]
    keys = ("TF_CONFIG", "TFDIST_NODE_RANK", "TFDIST_LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
    seen = {k: os.environ.get(k) for k in keys}
    seen["pid"] = os.getpid()
    with open(os.path.join(out, me + ".tmp"), "w") as f:
        json.dump(seen, f)
    os.replace(os.path.join(out, me + ".tmp"), os.path.join(out, me + ".json"))
    time.sleep(600)
"""


def _wait_for_files(paths, processes, seconds=120):
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            outputs = [_finish(p, 30)[1][-2000:] for p in processes]
            pytest.fail(f"tasks did not start: {outputs}")
        time.sleep(0.1)


@pytest.mark.slow
def test_tf_config_has_both_veth_addresses_and_a_killed_worker_stops_both_nodes(
        hosts, tmp_path):
    script = _script(tmp_path, _SLEEP)
    nodes = [_start_node(hosts, r, script, tmp_path, master_port=_port() + 1,
                         options=("--token", TOKEN, "--grace-period", "2"))
             for r in (0, 1)]
    try:
        files = [tmp_path / "worker-0.json", tmp_path / "worker-1.json"]
        _wait_for_files(files, nodes)
        seen = [json.loads(f.read_text()) for f in files]
        for rank, task in enumerate(seen):
            config = json.loads(task["TF_CONFIG"])
            workers = config["cluster"]["worker"]
            assert [w.rsplit(":", 1)[0] for w in workers] == hosts.addrs
            assert config["task"] == {"type": "worker", "index": rank}
            assert (task["TFDIST_NODE_RANK"], task["TFDIST_LOCAL_RANK"]) == (str(rank), "0")
        os.kill(seen[1]["pid"], signal.SIGKILL)
        started = time.monotonic()
        results = [_finish(n, 120) for n in nodes]
        stopped_after = time.monotonic() - started
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for rank, (code, output) in enumerate(results):
        assert code == 1, f"node {rank}:\n{output[-3000:]}"
        assert "worker-1 exited with code -9 (signal SIGKILL) on node 1" in output, output
    assert stopped_after < 60, f"the launchers took {stopped_after:.0f}s to stop"
    for rank in (0, 1):
        # The launcher's guard process may take a moment to see its pipe close and exit.
        deadline = time.monotonic() + 10
        while hosts.pids(rank) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hosts.pids(rank) == [], f"processes left on node {rank}"


@pytest.mark.slow
def test_a_node_that_never_joins_is_named(hosts, tmp_path):
    script = _script(tmp_path, "print('never runs')\n")
    node = _start_node(hosts, 0, script, master_port=_port() + 2,
                       options=("--token", TOKEN, "--join-timeout", "3"))
    code, output = _finish(node, 120)
    assert code == 1, output
    assert "node(s) 1 did not join within 3s" in output, output
    assert "never runs" not in output


@pytest.mark.slow
def test_a_wrong_token_is_refused(hosts, tmp_path):
    script = _script(tmp_path, "print('never runs')\n")
    port = _port() + 3
    good = _start_node(hosts, 0, script, master_port=port,
                       options=("--token", TOKEN, "--join-timeout", "10"))
    bad = _start_node(hosts, 1, script, master_port=port,
                      options=("--token", "not-the-token", "--join-timeout", "10"))
    bad_code, bad_output = _finish(bad, 120)
    good_code, good_output = _finish(good, 120)
    assert bad_code == 1, bad_output
    assert (f"node 1 (connecting from {hosts.addrs[1]}) was refused: its token does not "
            "match node 0's") in bad_output, bad_output
    # Node 0 fails at once, with the reason (not after --join-timeout).
    assert good_code == 1, good_output
    assert "was refused: its token does not match node 0's" in good_output, good_output
    assert "did not join" not in good_output
    assert "never runs" not in bad_output + good_output


# ---- restarts of the whole job: two launchers on loopback ----------------------------------

_CRASH = """
    import os, sys, time
    out, me, attempt = sys.argv[1], os.environ["TFDIST_TASK"], os.environ["TFDIST_RESTART"]
    with open(os.path.join(out, me + ".attempts"), "a") as f:
        f.write(attempt + "\\n")
    if me == "worker-1" and (sys.argv[2] == "always" or attempt == "0"):
        sys.exit(3)
    time.sleep(0 if attempt == "1" else 600)  # attempt 0: stopped by the failure
"""


def _restarted_pair(tmp_path, mode):
    """Runs `_CRASH` (``mode``: ``once`` or ``always``) on two loopback launchers with
    --max-restarts 1; returns their (exit code, output)."""
    script = _script(tmp_path, _CRASH)
    port = find_free_ports(1)[0]
    nodes = [_start_node(None, r, script, tmp_path, mode, master_port=port,
                         options=("--token", TOKEN, "--max-restarts", "1", "--grace-period",
                                  "1", "--join-timeout", "60"))
             for r in (0, 1)]
    try:
        return [_finish(n, 120) for n in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


def test_max_restarts_restarts_every_node_and_the_job_then_succeeds(tmp_path):
    results = _restarted_pair(tmp_path, "once")
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"node {rank}:\n{output[-3000:]}"
        assert "tfdist launch: restart 1/1: worker-1 on node 1 exited with code 3" in output, \
            output
    # Both tasks ran twice: every node restarted, with TFDIST_RESTART from node 0.
    for task in ("worker-0", "worker-1"):
        assert (tmp_path / f"{task}.attempts").read_text().split() == ["0", "1"]


def test_with_no_restart_left_both_nodes_fail_naming_the_task_and_node(tmp_path):
    results = _restarted_pair(tmp_path, "always")
    for rank, (code, output) in enumerate(results):
        assert code == 1, f"node {rank}:\n{output[-3000:]}"
        assert output.count("tfdist launch: restart 1/1: worker-1 on node 1") == 1, output
        assert "restart 2/" not in output
        failed = [line for line in output.splitlines() if "FAILED" in line]
        assert failed and "worker-1 exited with code 3" in failed[0], output
        assert "on node 1" in failed[0] and "no restart left (1/1 used)" in failed[0], output
    assert (tmp_path / "worker-1.attempts").read_text().split() == ["0", "1"]


_RESUME = """
    import json, os, sys
    import numpy as np
    import tfdist
    from tfdist.keras import callbacks as cbs
    from helpers import classification_data, kill_worker_1, mlp
    from test_multi_worker import GLOBAL_BATCH, _compile

    # TF's engine: the one whose faults (a killed peer) tfdist names.
    strategy = tfdist.MultiWorkerMirroredStrategy(startup_timeout=90, collective_timeout=120,
                                                  engine="tf")
    out, me = sys.argv[1], os.environ["TFDIST_TASK"]
    restart = int(os.environ["TFDIST_RESTART"])
    x, y = classification_data(n=64)
    with strategy.scope():
        model = mlp()
        _compile(model, "sgd")
    epochs_run = []
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[cbs.BackupAndRestore(),
                         kill_worker_1(epochs_run)])  # worker-1 is on node 1
    np.savez(os.path.join(out, me + ".npz"), *model.get_weights())
    with open(os.path.join(out, me + ".json"), "w") as f:
        json.dump({"restart": restart, "epochs_run": epochs_run}, f)
    if me == "worker-0":  # the same training, uninterrupted, in one process
        reference = mlp()
        _compile(reference, "sgd")
        reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
        np.savez(os.path.join(out, "reference.npz"), *reference.get_weights())
"""


@pytest.mark.slow
def test_a_restarted_two_node_job_resumes_from_its_backup(hosts, tmp_path):
    script = _script(tmp_path, _RESUME)
    backup = tmp_path / "backup"  # one file system here; on real hosts, shared storage
    nodes = [_start_node(hosts, r, script, tmp_path, master_port=_port() + 4,
                         options=("--token", TOKEN, "--max-restarts", "1", "--backup-dir",
                                  backup, "--grace-period", "2"))
             for r in (0, 1)]
    results = [_finish(n) for n in nodes]
    assert [code for code, _ in results] == [0, 0], "\n".join(o[-4000:] for _, o in results)
    for rank, (code, output) in enumerate(results):
        assert "restart 1/1: worker-1 on node 1 exited with code -9 (signal SIGKILL)" in \
            output, output
    reference = _load(tmp_path / "reference.npz")
    for task in ("worker-0", "worker-1"):
        seen = json.loads((tmp_path / f"{task}.json").read_text())
        assert seen == {"restart": 1, "epochs_run": [1, 2]}  # resumed after epoch 1
        assert_weights_close(_load(tmp_path / f"{task}.npz"), reference, atol=1e-5)
    assert not backup.exists()  # deleted after training
    for rank in (0, 1):
        assert hosts.pids(rank) == [], f"processes left on node {rank}"


# ---- the rendezvous rules, on loopback -------------------------------------------------------

# ---- an elastic job over two hosts ---------------------------------------------------------

def _wait_for(predicate, processes, what, seconds=150):
    deadline = time.monotonic() + seconds
    while not predicate():
        ended = [p for p in processes if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {seconds}s" +
                        (f"; a launcher ended (rc {ended[0].returncode})" if ended else ""))
        time.sleep(0.1)


@pytest.mark.slow
def test_an_elastic_job_loses_a_whole_host_carries_on_and_takes_it_back(hosts, tmp_path):
    """Node 1 (its launcher and its worker) is killed in epoch 2; node 0 carries on alone,
    its worker never restarted; node 1's launcher is started again in epoch 3 and its
    worker joins. Both end equal to one process with the same global batch."""
    import elastic_job

    from helpers import require_horovod

    require_horovod()
    net = elastic_job.model()
    elastic_job.fit(net, 3)
    reference = net.get_weights()
    job = os.path.join(TESTS_DIR, "elastic_job.py")
    events = "worker-0:1:3:HOLD,worker-0:2:2:GROW"
    env = _env({"JOB_HEARTBEAT": "30", "TFDIST_TOKEN": TOKEN})
    logs = [tmp_path / f"node{i}.log" for i in range(3)]

    def start(rank, log):
        argv = ["ip", "netns", "exec", hosts.names[rank], sys.executable, "-m", "tfdist.cli",
                "launch", "--nnodes", "2", "--node-rank", str(rank), "--master",
                f"{hosts.addrs[0]}:{_port()}", "--workers", "1", "--min-workers", "1",
                "--timeout", "240", job, str(tmp_path), "3", events]
        with open(log, "w") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO, start_new_session=True)

    node0, node1 = start(0, logs[0]), start(1, logs[1])
    back = None
    try:
        _wait_for((tmp_path / "hold-1-3").exists, [node0, node1], "worker-0 at epoch 2")
        for pid in [node1.pid, *hosts.pids(1)]:  # the whole host goes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node1.wait(timeout=30)
        _wait_for(lambda: "node 1 (" in logs[0].read_text() and "sent no heartbeat" in
                  logs[0].read_text(), [node0], "node 0 dropping node 1")
        (tmp_path / "release-1-3").touch()
        _wait_for((tmp_path / "grow-2-2").exists, [node0], "worker-0 alone in epoch 3")
        back = start(1, logs[2])  # the host comes back
        assert node0.wait(timeout=240) == 0, logs[0].read_text()[-3000:]
        assert back.wait(timeout=60) == 0, logs[2].read_text()[-3000:]
    finally:
        for process in (node0, node1, back):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    said = logs[0].read_text()
    assert "worker-1 removed; the elastic job carries on with 1 worker(s) (worker-0)" in said
    assert "node 1 (" + hosts.addrs[1] + ") joins the running elastic job with worker-1" in said
    assert said.count("sent no heartbeat") == 1, said  # the real loss; the end says it ended
    starts = [line.split() for line in (tmp_path / "starts").read_text().splitlines()]
    assert [name for name, _ in starts].count("worker-0") == 1  # never restarted
    for name in ("worker-0", "worker-1"):
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["size"] == 2 and result["iterations"] == 30
        assert_weights_close([np.array(w) for w in result["weights"]], reference, atol=1e-5)
    assert sorted(p.name for p in tmp_path.glob("saved-by-*")) == ["saved-by-worker-0"]


def test_elastic_node_messages_are_signed_and_checked():
    from tfdist.launch.elastic_hub import _beat_problem
    from tfdist.launch.elastic_wire import sign, verify

    beat = {"rank": 1, "addr": "10.0.0.2", "workers": 1, "ports": [4000],
            "incarnation": "ab", "beat": 3, "exited": {"worker-1": [0, 0]}}
    assert verify(TOKEN, sign(TOKEN, beat)) == beat
    assert verify("another", sign(TOKEN, beat)) is None
    assert verify(TOKEN, b"not json") is None
    assert _beat_problem(None, "1", 2).startswith("its signature is not the job's token")
    assert _beat_problem(beat, "1", 2) is None
    assert "rank must be 1..1" in _beat_problem(beat, "2", 2)
    assert "IP address" in _beat_problem({**beat, "addr": "x; rm"}, "1", 2)
    assert "as many ports" in _beat_problem({**beat, "ports": []}, "1", 2)


def _join(port, rank, nnodes=2, token=TOKEN, counts=None, **kwargs):
    counts = counts or {"chief": 0, "worker": 1, "ps": 0}
    return rendezvous.join(f"127.0.0.1:{port}", rank=rank, nnodes=nnodes, token=token,
                           counts=counts, ports=find_free_ports(sum(counts.values())),
                           timeout=kwargs.pop("timeout", 20), **kwargs)


def _attempt(call):
    """``call()``'s result, or the exception it raised."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - handed to the test
        return error


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "node rank 0 has already joined"),
    (dict(rank=1, nnodes=3), "it says --nnodes 3, node 0 says --nnodes 2"),
    (dict(rank=2), r"node rank must be in 0\.\.1\. Received: 2"),
    (dict(rank=1, counts={"chief": 1, "worker": 0, "ps": 0}), "only node 0 may run the chief"),
    (dict(rank=1, token="wrong"), "its token does not match"),
    (dict(rank=1, max_restarts=1), "it says --max-restarts 1, node 0 says --max-restarts 0"),
    (dict(rank=1, addr="10.0.0.9 evil"), "addr must be a host name or an IP address"),
], ids=["same-rank", "nnodes", "rank", "chief", "token", "max-restarts", "addr"])
def test_a_refused_node_fails_node_0_at_once_with_the_reason(kwargs, message):
    port, log = find_free_ports(1)[0], io.StringIO()
    server = rendezvous.RendezvousServer("127.0.0.1", port, 2, TOKEN, join_timeout=120,
                                         log=log).start()
    node_0 = {}
    first = threading.Thread(target=lambda: node_0.setdefault(0, _attempt(
        lambda: _join(port, 0, timeout=120))))
    try:
        first.start()
        _wait_until(lambda: "node 0 joined" in log.getvalue())
        with pytest.raises(rendezvous.RendezvousError, match=message):
            _join(port, **kwargs)
        first.join(60)  # hang guard: node 0's join timeout is 120 s
        assert 0 in node_0, "node 0 still waits after a refusal"
        assert isinstance(node_0[0], rendezvous.RendezvousError), node_0
        assert re.search(message, str(node_0[0])) and "was refused" in str(node_0[0])
        assert "did not join" not in log.getvalue()
    finally:
        for link in node_0.values():
            if isinstance(link, rendezvous.NodeLink):
                link.close()
        server.close(wait=1)


def test_rendezvous_forms_the_cluster_and_relays_a_failure():
    port = find_free_ports(1)[0]
    server = rendezvous.RendezvousServer("127.0.0.1", port, 2, TOKEN, join_timeout=60,
                                         log=open(os.devnull, "w")).start()
    links = _together(lambda: _join(port, 0), lambda: _join(port, 1, addr="10.9.9.9"))
    try:
        assert links[0].cluster == links[1].cluster
        assert links[0].cluster.worker[1].startswith("10.9.9.9:")  # --node-addr wins
        assert [t.name for t in links[1].tasks] == ["worker-1"]
        links[1].report_failure("worker-1", "worker-1 exited with code 3")
        _wait_until(lambda: links[0].stop is not None)
        assert links[0].stop == {"type": "stop", "node": 1, "task": "worker-1",
                                 "reason": "worker-1 exited with code 3", "round": 0,
                                 "restart": None, "max_restarts": 0, "lost": False}
    finally:
        for link in links:
            if isinstance(link, rendezvous.NodeLink):
                link.close()
        server.close(wait=1)


@pytest.mark.parametrize("respond, what", [
    (lambda conn: None, "it sent nothing within 2s"),
    (lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"),
     r"it sent b'SSH-2.0-OpenSSH_9.6\r\n'"),
    (lambda conn: conn.close(), "it closed the connection without a word"),
    (lambda conn: conn.sendall(b'{"type": "hello"}\n'), "it sent {'type': 'hello'}"),
], ids=["silent", "garbage", "closes", "other-json"])
def test_a_master_that_is_not_a_rendezvous_fails_within_the_join_timeout(respond, what):
    result = {}
    with tcp_listener(respond) as port:
        thread = threading.Thread(target=lambda: result.setdefault("error", _attempt(
            lambda: _join(port, 1, timeout=2))))
        thread.start()
        thread.join(25)  # hang guard: this node used to wait 2 + 30 s
        assert "error" in result, "the node still waits for a challenge after 25s"
    error = result["error"]
    assert isinstance(error, rendezvous.RendezvousError), error
    assert f"127.0.0.1:{port} is not a tfdist rendezvous" in str(error), error
    assert what in str(error), error


def test_the_cli_names_a_master_that_is_not_a_rendezvous(tmp_path):
    script = _script(tmp_path, "print('never runs')\n")
    with tcp_listener(lambda conn: None) as port:
        node = _start_node(None, 1, script, master_port=port,
                           options=("--token", TOKEN, "--join-timeout", "2"))
        code, output = _finish(node, 60)
    assert code == 1, output
    assert f"127.0.0.1:{port} is not a tfdist rendezvous" in output, output
    assert "it sent nothing within 2s" in output and "never runs" not in output


def _together(*calls):
    """Runs the blocking ``calls`` (joins, rejoins) at once; their results, in order."""
    results = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as error:  # noqa: BLE001 - handed to the test
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def _wait_until(predicate, seconds=20):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert predicate()


def test_rendezvous_restart_rounds_agree_and_take_back_a_restarted_node():
    port = find_free_ports(1)[0]
    server = rendezvous.RendezvousServer("127.0.0.1", port, 2, TOKEN, join_timeout=20,
                                         log=open(os.devnull, "w"), max_restarts=2).start()
    links = _together(lambda: _join(port, 0, max_restarts=2),
                      lambda: _join(port, 1, max_restarts=2))
    try:
        assert [link.round for link in links] == [0, 0]
        # A task fails on node 1: node 0 decides restart 1/2 for both nodes.
        links[1].report_failure("worker-1", "worker-1 exited with code 3")
        _wait_until(lambda: all(link.stop for link in links))
        assert [link.restart for link in links] == [1, 1]
        assert links[0].stop["node"] == 1 and links[0].stop["task"] == "worker-1"
        _together(*(lambda link=link: link.rejoin(find_free_ports(1), 20) for link in links))
        assert [link.round for link in links] == [1, 1]
        assert links[0].cluster == links[1].cluster and links[0].stop is None
        # Node 1's launcher dies: restart 2/2; a new launcher of node 1 joins it.
        links[1].close()
        _wait_until(lambda: links[0].stop is not None)
        assert links[0].restart == 2 and links[0].stop["task"] is None
        assert links[0].stop["lost"]
        fresh = _together(lambda: links[0].rejoin(find_free_ports(1), 20),
                          lambda: _join(port, 1, max_restarts=2))[1]
        links[1] = fresh
        assert [link.round for link in links] == [2, 2]
        assert [t.name for t in fresh.tasks] == ["worker-1"]
        # No restart left: the next failure stops the job.
        links[0].report_failure("worker-0", "worker-0 exited with code 1")
        _wait_until(lambda: all(link.stop for link in links))
        assert [link.restart for link in links] == [None, None]
    finally:
        for link in links:
            if isinstance(link, rendezvous.NodeLink):
                link.close()
        server.close(wait=1)


def test_a_node_that_dies_during_a_restart_round_is_named_within_the_join_timeout():
    port = find_free_ports(1)[0]
    server = rendezvous.RendezvousServer("127.0.0.1", port, 2, TOKEN, join_timeout=3,
                                         log=open(os.devnull, "w"), max_restarts=1).start()
    links = _together(lambda: _join(port, 0, max_restarts=1),
                      lambda: _join(port, 1, max_restarts=1))
    try:
        links[1].report_failure("worker-1", "worker-1 exited with code 3")
        _wait_until(lambda: all(link.stop for link in links))
        links[1].close()  # dies before it rejoins
        with pytest.raises(rendezvous.RendezvousError,
                           match=r"node\(s\) 1 did not rejoin within 3s for restart 1/1"):
            links[0].rejoin(find_free_ports(1), 30)
    finally:
        for link in links:
            link.close()
        server.close(wait=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(nnodes=2, node_rank=2, master="127.0.0.1:1"), "node_rank must be in 0..1"),
    (dict(nnodes=2, node_rank=1, master="127.0.0.1:1", chief=True, token="t"),
     "only node 0 may run the chief"),
    (dict(nnodes=2), "needs master='HOST:PORT'"),
    (dict(nnodes=2, master="nohost"), "master must be HOST:PORT"),
    (dict(nnodes=2, node_rank=1, master="127.0.0.1:1"), "needs the rendezvous token"),
    (dict(nnodes=2, master="127.0.0.1:1", max_restarts=-1), "max_restarts must be"),
])
def test_bad_multi_node_arguments(kwargs, match, tmp_path, monkeypatch):
    monkeypatch.delenv("TFDIST_TOKEN", raising=False)
    script = _script(tmp_path, "print('never runs')\n")
    with pytest.raises(ValueError, match=match):
        tfdist.launch(script, **kwargs)


# ---- GPU pinning -------------------------------------------------------------------------------

def test_assign_gpus():
    assert gpus.assign_gpus([], 2) == [None, None]
    assert gpus.assign_gpus(["0", "1", "2", "3"], 2) == ["0,1", "2,3"]
    assert gpus.assign_gpus(["4", "6"], 2, 1) == ["4", "6"]
    assert gpus.assign_gpus(["0"], 3) == ["0", "0", "0"]
    with pytest.raises(ValueError, match="needs 4 GPUs for 2 task"):
        gpus.assign_gpus(["0", "1"], 2, 2)
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "1, 3"}) == ["1", "3"]


def test_an_elastic_job_splits_the_gpus_over_its_worker_slots():
    """An added worker (``worker-k``, k past the first workers) gets its slot's GPUs."""
    from tfdist.cluster import TaskSpec

    pin = gpus.elastic_gpu_env(4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [pin(TaskSpec("worker", k))["CUDA_VISIBLE_DEVICES"] for k in range(6)] == [
        "0", "1", "2", "3", "0", "1"]
    assert gpus.elastic_gpu_env(3, {"CUDA_VISIBLE_DEVICES": "-1"})(TaskSpec("worker", 5)) == {}


def test_each_task_gets_its_own_gpus(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        with open(os.path.join(sys.argv[1], os.environ["TFDIST_TASK"]), "w") as f:
            f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    """)

    def seen():
        return [(tmp_path / f"worker-{i}").read_text() for i in range(2)]

    fake = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # the node's GPUs, as the launcher sees them
    tfdist.launch(script, tmp_path, workers=2, env=fake, stream=None, timeout=60)
    assert seen() == ["0,1", "2,3"]
    tfdist.launch(script, tmp_path, workers=2, env=fake, gpus_per_task=1, stream=None,
                  timeout=60)
    assert seen() == ["0", "1"]
    if shutil.which("nvidia-smi") is None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        tfdist.launch(script, tmp_path, workers=2, stream=None, timeout=60)
        assert seen() == ["<unset>", "<unset>"]  # no GPUs: nothing set


# ---- a parameter-server job carries on without a dead worker: two launchers on loopback ---

_PS_WORKER_DIES = """
    import os, signal, sys, time
    out, me = sys.argv[1], os.environ["TFDIST_TASK"]
    done = os.path.join(out, "chief-done")

    def wait(predicate):
        deadline = time.monotonic() + 60  # hang guard
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.02)

    if me == "worker-1":  # on node 1
        open(os.path.join(out, "worker-1-dies"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if me == "chief-0":
        wait(lambda: os.path.exists(os.path.join(out, "worker-1-dies")))
        open(done, "w").close()
    elif me == "worker-0":
        wait(lambda: os.path.exists(done))
    else:
        time.sleep(600)  # ps-0: stopped when training is done
"""


def test_a_ps_job_carries_on_when_a_worker_of_another_node_dies(tmp_path):
    script = _script(tmp_path, _PS_WORKER_DIES)
    port = find_free_ports(1)[0]
    common = ("--token", TOKEN, "--grace-period", "1", "--join-timeout", "60")
    nodes = [_start_node(None, 0, script, tmp_path, master_port=port,
                         options=(*common, "--chief", "--ps", "1")),
             _start_node(None, 1, script, tmp_path, master_port=port, options=common)]
    try:
        results = [_finish(n, 120) for n in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"node {rank}:\n{output[-3000:]}"
    assert ("tfdist launch: worker-1 exited with code -9 (signal SIGKILL); the parameter-"
            "server job carries on with 1 worker (no restarts left: --max-restarts 0)"
            ) in results[1][1], results[1][1]
