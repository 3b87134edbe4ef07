"""An out-of-memory kill is named: "out of memory", the task and its cgroup's limit.

The unit tests read fake cgroup files (v1 and v2) in ``tmp_path``; the launch test puts
``tfdist launch`` into a real cgroup v1 memory group with a 200 MB limit (needs root)
and runs a task that allocates far beyond it.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from benchmarks.memcap import MemoryCaps
from tfdist.launch import oom

pytestmark = pytest.mark.timeout(180)

_V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw
"""


def _fake_proc(tmp_path, cgroup_lines, mounts):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "42").mkdir()
    (proc / "42" / "cgroup").write_text(cgroup_lines)
    (proc / "self" / "mountinfo").write_text(mounts)
    return proc


@pytest.mark.unit
def test_v1_counters_limit_and_wording(tmp_path):
    v1, v2 = tmp_path / "memory", tmp_path / "unified"
    group = v1 / "jobs" / "a"
    group.mkdir(parents=True)
    v2.mkdir()  # hybrid: the unified hierarchy has no memory files
    (v1 / "jobs" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (group / "memory.limit_in_bytes").write_text("209715200\n")
    (group / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (group / "memory.failcnt").write_text("84\n")
    proc = _fake_proc(tmp_path, "4:memory:/jobs/a\n1:cpu:/\n0::/\n",
                      _V1_MOUNTS.format(v1=v1, v2=v2))

    found = oom.find_cgroup(42, proc)
    assert (found.version, found.path, found.directory) == (1, "/jobs/a", group)
    assert oom.oom_kills(found) == 3  # the oom_kill line, not failcnt
    assert oom.memory_limit(found) == (209715200, group)
    assert oom.describe("worker-0", found) == (
        "out of memory: worker-0 was killed by the kernel's OOM killer "
        "(memory limit 200 MiB of cgroup /jobs/a)")

    # A kernel without the oom_kill line: the limit's hits (failcnt) count.
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    assert oom.oom_kills(found) == 84


@pytest.mark.unit
def test_v2_counters_and_a_parents_limit(tmp_path):
    v2 = tmp_path / "cg2"
    group = v2 / "user.slice" / "job"
    group.mkdir(parents=True)
    (v2 / "user.slice" / "memory.max").write_text("1073741824\n")
    (group / "memory.max").write_text("max\n")
    (group / "memory.events").write_text(
        "low 0\nhigh 0\nmax 17\noom 2\noom_kill 1\noom_group_kill 0\n")
    mounts = f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n"
    proc = _fake_proc(tmp_path, "0::/user.slice/job\n", mounts)

    found = oom.find_cgroup(42, proc)
    assert (found.version, found.path, found.directory) == (2, "/user.slice/job", group)
    assert oom.oom_kills(found) == 1
    assert oom.memory_limit(found) == (1073741824, v2 / "user.slice")
    assert oom.describe("ps-0", found) == (
        "out of memory: ps-0 was killed by the kernel's OOM killer "
        "(memory limit 1024 MiB of cgroup /user.slice)")

    (v2 / "user.slice" / "memory.max").write_text("max\n")  # no limit anywhere
    assert oom.memory_limit(found) is None
    assert "cgroup /user.slice/job has no memory limit: the host ran out" in \
        oom.describe("ps-0", found)


@pytest.mark.unit
def test_bind_mounted_hierarchy_and_no_cgroup(tmp_path):
    """Without a cgroup namespace, a container's hierarchy is mounted at its own root."""
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.oom_control").write_text("oom_kill 0\n")
    mounts = f"35 31 0:32 /docker/abc {v1} rw,relatime - cgroup cgroup rw,memory\n"
    proc = _fake_proc(tmp_path, "4:memory:/docker/abc\n", mounts)
    assert oom.find_cgroup(42, proc).directory == v1
    assert oom.find_cgroup(7, proc) is None  # no such process
    (v1 / "memory.oom_control").unlink()
    assert oom.find_cgroup(42, proc) is None  # no readable counter


@pytest.mark.unit
def test_only_a_sigkill_with_a_new_oom_kill_is_named(tmp_path, monkeypatch):
    group = tmp_path / "g"
    group.mkdir()
    (group / "memory.oom_control").write_text("oom_kill 5\n")
    (group / "memory.limit_in_bytes").write_text("104857600\n")
    cgroup = oom.MemoryCgroup("/g", group, tmp_path, 1)
    monkeypatch.setattr(oom, "find_cgroup", lambda pid: cgroup)
    monkeypatch.setattr(oom, "_watched", {})  # this test's tasks only
    from tfdist.launch.results import exit_cause

    oom.watch("worker-9", 1234)
    assert exit_cause("worker-9", -9) == "worker-9 exited with code -9 (signal SIGKILL)"
    (group / "memory.oom_control").write_text("oom_kill 6\n")
    assert exit_cause("worker-9", 1) == "worker-9 exited with code 1"
    assert exit_cause("worker-9", -int(signal.SIGTERM)).endswith("(signal SIGTERM)")
    assert exit_cause("worker-9", -9) == (
        "out of memory: worker-9 was killed by the kernel's OOM killer "
        "(memory limit 100 MiB of cgroup /g)")
    oom.watch("worker-9", 1234)  # a restarted task starts from the new count
    assert exit_cause("worker-9", -9) == "worker-9 exited with code -9 (signal SIGKILL)"


@pytest.mark.multiprocess
def test_launch_names_an_oom_kill(tmp_path):
    assert os.geteuid() == 0, "this test creates a memory cgroup: run it as root"
    caps = MemoryCaps(200 * 2**20, tag="tfdist-test")
    try:
        group = caps.group("launch")
        script = tmp_path / "hog.py"
        script.write_text(textwrap.dedent("""
            import numpy as np
            print("allocating", flush=True)
            held = []
            while True:  # 64 MiB at a time, each page touched
                held.append(np.ones(8 * 2**20, dtype=np.float64))
        """))
        procs = str(group / "cgroup.procs")

        def join_group():  # in the launcher, before exec: its tasks inherit the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        launcher = subprocess.run(
            [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "1", str(script)],
            capture_output=True, text=True, timeout=150, preexec_fn=join_group)
        output = launcher.stdout + launcher.stderr
        assert launcher.returncode != 0, output
        assert "[worker-0] allocating" in output, output
        assert ("out of memory: worker-0 was killed by the kernel's OOM killer "
                f"(memory limit 200 MiB of cgroup ") in output, output
        assert f"/{group.name})" in output, output
        assert "exited with code -9" not in output, output
        assert int(oom.oom_kills(oom.MemoryCgroup("", group, group, 1))) >= 1
        assert caps.oom_killed("launch")
    finally:
        caps.remove()  # waits for the launcher's task guard, which ends after it
