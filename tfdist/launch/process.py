"""A task process: started in its own process group, dead with the launcher, relayed.

Every task runs in its own process group, so stopping a task stops everything it
started, and every task dies with the launcher, however the launcher ends
(`start_process`). Its output is relayed as it comes (`tfdist.launch.output`).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from tfdist.cluster import TaskSpec
from tfdist.launch import oom
from tfdist.launch.options import DEFAULT_GRACE_SECONDS
from tfdist.launch.output import TAIL_LINES, TaskOutput, cpp_log_level, relay

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Run by path (``python -I -S``), so it imports nothing of tfdist.
_GUARD_SCRIPT = Path(__file__).with_name("task_guard.py")


class _Guard:
    """Kills the tasks' process groups when this process ends, however it ends.

    A small helper process (``task_guard.py``, in a session of its own so signals sent
    to our group miss it) reads each task's process-group ID from a pipe whose write end
    only this process holds. When this process ends, even by SIGKILL, the kernel closes
    that end: the helper reads EOF and SIGKILLs every group still alive. It forgets
    groups that have emptied, so it never signals a reused ID. One helper serves every
    job this process launches; it is started with the first task.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._helper: subprocess.Popen | None = None

    def watch(self, pgid: int) -> None:
        """Adds the process group ``pgid`` to those killed if this process dies."""
        with self._lock:
            if self._helper is None or self._helper.poll() is not None:
                self._helper = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_GUARD_SCRIPT)], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True)
            try:
                self._helper.stdin.write(f"{pgid}\n".encode())
                self._helper.stdin.flush()
            except OSError:  # the helper was killed: the next task starts a new one
                pass


_GUARD = _Guard()
_prctl = None


def _parent_death_signal():
    """A ``preexec_fn`` that makes the kernel SIGKILL the child when its parent dies.

    Linux's prctl(PR_SET_PDEATHSIG) fires when the *thread* that started the child ends,
    so tasks are started by the thread that waits for them. None off Linux.
    """
    global _prctl
    if not sys.platform.startswith("linux"):
        return None
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        _prctl.restype = ctypes.c_int
    prctl, parent, kill = _prctl, os.getpid(), int(signal.SIGKILL)

    def set_parent_death_signal():  # runs in the child between fork and exec: no imports
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os.kill(os.getpid(), kill)

    return set_parent_death_signal


def start_process(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Starts a task in a new session (its own process group) that dies with us.

    Two mechanisms, so neither is a single point of failure: the kernel SIGKILLs the
    task itself when the launching thread ends (`_parent_death_signal`), and `_Guard`
    SIGKILLs the task's whole group (whatever the task started) when this process ends.
    """
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=_parent_death_signal())
    _GUARD.watch(process.pid)
    return process


def command_env(env: dict[str, str] | None) -> dict[str, str]:
    """Ours and ``env``, with unbuffered Python (live output) and TF's INFO and WARNING
    start-up lines hidden (TF_CPP_MIN_LOG_LEVEL=2), unless the user set a level."""
    environ = dict(os.environ)
    environ.update(env or {})
    environ["PYTHONUNBUFFERED"] = "1"
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return environ


class TaskProcess:
    """A running task: its process, a thread that relays its output as it comes, and one
    that notes when it exits.

    Attributes:
        exited_at: `time.monotonic` when the process exited (None while it runs), so the
            launcher can tell which of several failed tasks failed first.
    """

    def __init__(self, spec: TaskSpec, argv: list[str], env: dict[str, str], stream):
        self.spec = spec
        self.name = spec.name
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.exited_at: float | None = None
        self.process = start_process(argv, env)
        oom.watch(self.name, self.process.pid)  # to tell an OOM kill from other SIGKILLs
        self._output = TaskOutput(self.name, stream, cpp_log_level(env), self.tail)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _pump(self):
        relay(self.process.stdout, self._output.add)
        self._output.close()

    def _wait(self):
        self.process.wait()
        self.exited_at = time.monotonic()

    def poll(self):
        """The exit code, or None while the task runs (`exited_at` is set with it)."""
        code = self.process.poll()
        if code is not None:
            self._waiter.join()  # it has the code: it is noting the time, or has
        return code

    def signal_group(self, signum):
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout=2.0):
        self._reader.join(timeout)

    def tail_text(self) -> str:
        return "\n".join(self.tail)


def stop_tasks(tasks: Sequence[TaskProcess], grace: float = DEFAULT_GRACE_SECONDS) -> None:
    """SIGTERM every task's process group, then SIGKILL what is left after ``grace``.

    The group is killed even when its leader has exited, so no grandchild survives.
    """
    for task in tasks:
        task.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for task in tasks:
        try:
            task.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for task in tasks:
        task.signal_group(signal.SIGKILL)
        try:
            task.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        task.finish_output()
