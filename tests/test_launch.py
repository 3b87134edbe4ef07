"""The local launcher: exit codes, stopping, timeouts, TF_CONFIG and function mode."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import tfdist
from tfdist.cluster import ClusterSpec

pytestmark = pytest.mark.timeout(120)


def _script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _cli(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "tfdist.cli", "launch", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_all_succeed_and_tf_config_is_valid_and_distinct(tmp_path):
    script = _script(tmp_path, """
        import json, os, sys
        out = sys.argv[1]
        name = os.environ["TFDIST_TASK"]
        with open(os.path.join(out, name + ".json"), "w") as f:
            f.write(os.environ["TF_CONFIG"])
        print("hello from", name)
    """)
    result = _cli("--workers", 2, "--chief", script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[worker-1] hello from worker-1" in result.stdout
    configs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(configs) == {"chief-0", "worker-0", "worker-1"}
    specs = [ClusterSpec.from_dict(c) for c in configs.values()]
    assert len({s.task for s in specs}) == 3
    assert len({json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}) == 1
    addresses = [a for _, _, a in specs[0].addresses()]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)


def test_one_failure_stops_the_others_and_is_named(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        name = os.environ["TFDIST_TASK"]
        open(os.path.join(sys.argv[1], name + ".pid"), "w").write(str(os.getpid()))
        if name == "worker-1":
            time.sleep(1)
            print("boom: something broke")
            sys.exit(3)
        time.sleep(600)
    """)
    start = time.monotonic()
    result = _cli("--workers", 3, "--grace-period", 2, script, tmp_path)
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "worker-1 exited with code 3" in result.stderr
    assert "boom: something broke" in result.stderr
    for pid_file in tmp_path.glob("*.pid"):
        assert not _alive(int(pid_file.read_text())), pid_file.stem


def test_timeout_kills_everything_including_grandchildren(tmp_path):
    script = _script(tmp_path, """
        import os, subprocess, sys, time, signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # forces the SIGKILL path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        name = os.environ["TFDIST_TASK"]
        open(os.path.join(sys.argv[1], name + ".pid"), "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    """)
    result = _cli("--workers", 2, "--timeout", 3, "--grace-period", 1, script, tmp_path)
    assert result.returncode != 0
    assert "timed out after 3s" in result.stderr
    pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
    assert len(pids) == 4
    assert not [p for p in pids if _alive(p)]


def test_ps_tasks_are_stopped_when_workers_finish(tmp_path):
    script = _script(tmp_path, """
        import os, time
        if os.environ["TFDIST_TASK"].startswith("ps"):
            time.sleep(600)
    """)
    start = time.monotonic()
    result = _cli("--workers", 1, "--ps", 1, "--grace-period", 1, script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 30


def _task_name(offset):
    return os.environ["TFDIST_TASK"], json.loads(os.environ["TF_CONFIG"])["task"]["index"] + offset


def test_function_mode_returns_each_task_value():
    values = tfdist.launch(_task_name, 10, workers=2, chief=True, timeout=60, stream=None)
    assert values == [("chief-0", 10), ("worker-0", 10), ("worker-1", 11)]


def _fail_on_worker_1():
    if os.environ["TFDIST_TASK"] == "worker-1":
        raise RuntimeError("worker one failed on purpose")
    time.sleep(600)


def test_function_mode_failure_raises_launch_error():
    with pytest.raises(tfdist.LaunchError, match="worker-1") as info:
        tfdist.launch(_fail_on_worker_1, workers=2, timeout=60, grace_period=1, stream=None)
    assert "worker one failed on purpose" in info.value.output_tail
    assert info.value.task == "worker-1"


@pytest.mark.parametrize("kwargs,match", [
    ({"workers": 0}, "workers must be an integer >= 1"),
    ({"workers": 1, "ps": -1}, "ps must be"),
    ({"workers": 1, "timeout": 0}, "timeout must be"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdist.launch(_task_name, 0, **kwargs)


def test_missing_script_is_named(tmp_path):
    result = _cli("--workers", 1, tmp_path / "nope.py")
    assert result.returncode == 2
    assert "nope.py" in result.stderr and "does not exist" in result.stderr


def _can_make_namespaces():
    probe = subprocess.run(["ip", "netns", "add", f"tfdist-probe-{os.getpid()}"],
                           capture_output=True)
    subprocess.run(["ip", "netns", "del", f"tfdist-probe-{os.getpid()}"], capture_output=True)
    return probe.returncode == 0


def test_isolated_network_keeps_task_ports_unreachable_from_outside(tmp_path):
    """Tasks listen on 0.0.0.0 as TF's servers do; in the private namespace they reach
    each other, and the host cannot reach them."""
    import socket
    import threading

    if not _can_make_namespaces():
        pytest.fail("this test needs `ip netns` as root (the CI machine has it)")
    script = _script(tmp_path, """
        import json, os, socket, sys, time
        out = sys.argv[1]
        config = json.loads(os.environ["TF_CONFIG"])
        me = config["cluster"]["worker"][config["task"]["index"]]
        server = socket.socket()
        server.bind(("0.0.0.0", int(me.rsplit(":", 1)[1])))
        server.listen()
        open(os.path.join(out, os.environ["TFDIST_TASK"] + ".ready"), "w").write(me)
        for peer in config["cluster"]["worker"]:  # the peer may not listen yet: retry
            host, port = peer.rsplit(":", 1)
            for attempt in range(300):
                try:
                    socket.create_connection((host, int(port)), timeout=10).close()
                    break
                except ConnectionRefusedError:
                    time.sleep(0.1)
            else:
                sys.exit(f"could not reach {peer} inside the namespace")
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(out, "checked")) and time.time() < deadline:
            time.sleep(0.1)
    """)
    outcome = {}

    def run_job():
        try:
            outcome["result"] = tfdist.launch(script, tmp_path, workers=2, timeout=90,
                                              isolate_network=True, stream=None)
        except Exception as error:  # re-raised below, in the test's thread
            outcome["error"] = error

    job = threading.Thread(target=run_job)
    job.start()
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.ready"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        addresses = [p.read_text() for p in tmp_path.glob("*.ready")]
        assert len(addresses) == 2
        for address in addresses:
            host, port = address.rsplit(":", 1)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, int(port)), timeout=5)
    finally:
        (tmp_path / "checked").write_text("")
        job.join(120)
    if "error" in outcome:
        raise outcome["error"]
    assert [t.returncode for t in outcome["result"].tasks] == [0, 0]
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tfdist-{os.getpid()}-" not in leftover
