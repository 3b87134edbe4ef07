"""Tasks die with their launcher, whatever ends it: SIGKILL, SIGHUP, with or without
``--isolate-network`` (and then the job's network namespace goes too).

Each test starts ``tfdist launch`` in its own session, as a terminal or a scheduler
would, waits until every task (and a child of each task) has written its PID, ends the
launcher, and polls until those processes are gone.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(180)

WORKERS = 2
# Each task starts a child (in the task's process group), then writes
# "task_pid child_pid network_namespace" and sleeps.
TASK = textwrap.dedent("""
    import os, subprocess, sys, time
    out = sys.argv[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    name = os.environ["TFDIST_TASK"]
    net = os.readlink("/proc/self/ns/net")
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(f"{os.getpid()} {child.pid} {net}")
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name + ".pid"))
    time.sleep(600)
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_until_gone(pids, seconds=30.0):
    """The PIDs still alive after up to ``seconds`` (generous: the machine is shared)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _namespace_users(namespace):
    """PIDs of the processes in the network namespace ``net:[inode]``."""
    users = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == namespace:
                    users.append(int(entry))
            except OSError:
                pass
    return users


def _named_namespaces(launcher_pid):
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines()
            if line.startswith(f"tfdist-{launcher_pid}-")]


@pytest.fixture
def job(tmp_path):
    """Starts ``tfdist launch`` in its own session; yields a handle; cleans up after.

    The cleanup kills (by PID) whatever this test's job left behind, so a failing run
    does not leave sleeping tasks on the machine.
    """
    script = tmp_path / "task.py"
    script.write_text(TASK)
    started = {}

    def start(*flags):
        log = open(tmp_path / "launcher.log", "w")
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tfdist.cli", "launch", "--workers", str(WORKERS),
             "--grace-period", "1", *flags, str(script), str(tmp_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        started["launcher"] = launcher
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < WORKERS:
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
            assert time.monotonic() < deadline, "the tasks did not start in 120 s"
            time.sleep(0.1)
        records = [p.read_text().split() for p in sorted(tmp_path.glob("*.pid"))]
        started["pids"] = [int(pid) for record in records for pid in record[:2]]
        return launcher, started["pids"], {record[2] for record in records}

    yield start
    launcher = started.get("launcher")
    if launcher is not None:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        for pid in started.get("pids", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in _named_namespaces(launcher.pid):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.multiprocess
def test_sigkilled_launcher_takes_every_task_and_its_children_with_it(job):
    launcher, pids, _ = job()
    assert len(pids) == 2 * WORKERS and all(_alive(p) for p in pids)
    launcher.kill()
    launcher.wait()
    assert _wait_until_gone(pids) == []


@pytest.mark.multiprocess
def test_hung_up_launcher_stops_every_task_and_exits_non_zero(job, tmp_path):
    launcher, pids, _ = job()
    launcher.send_signal(signal.SIGHUP)
    assert launcher.wait(60) != 0
    assert _wait_until_gone(pids) == []
    assert "interrupted" in (tmp_path / "launcher.log").read_text()


def _can_unshare():
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkilled_isolated_job_leaves_no_task_and_no_namespace(job):
    if not _can_unshare():
        pytest.fail("this test needs root to create network namespaces (CI has it)")
    launcher, pids, namespaces = job("--isolate-network")
    assert len(namespaces) == 1
    namespace = namespaces.pop()
    assert namespace != os.readlink("/proc/self/ns/net"), "tasks were not isolated"
    launcher.kill()
    launcher.wait()
    assert _wait_until_gone(pids) == []
    deadline = time.monotonic() + 30
    while _namespace_users(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _namespace_users(namespace) == []
    assert _named_namespaces(launcher.pid) == []
