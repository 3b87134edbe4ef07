"""What a launch returns or raises, and how the launcher words a task's end."""

from __future__ import annotations

import dataclasses
import re
import signal
from typing import Sequence

from tfdist.cluster import ClusterSpec
from tfdist.launch.oom import oom_cause


class LaunchError(RuntimeError):
    """A launched job failed: a task exited non-zero, or the deadline passed.

    Attributes:
        task: Name of the task that failed first (``worker-1``), or None on timeout.
        returncode: Its exit code, or None on timeout.
        output_tail: The last lines that task printed.
        attempts: How many times the job was started.
    """

    def __init__(self, message, task=None, returncode=None, output_tail="", attempts=1):
        super().__init__(message)
        self.task = task
        self.returncode = returncode
        self.output_tail = output_tail
        self.attempts = attempts


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """What one task did: its exit code and the end of its output."""

    name: str
    returncode: int | None
    output_tail: str


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """A finished job: every task's result, and how many starts it took."""

    tasks: tuple[TaskResult, ...]
    attempts: int
    cluster: ClusterSpec


def launch_result(tasks: Sequence, attempts: int, cluster: ClusterSpec) -> LaunchResult:
    """The `LaunchResult` of a finished attempt's `TaskProcess` list (single-node or one
    node's share)."""
    return LaunchResult(tuple(TaskResult(t.name, t.poll(), t.tail_text()) for t in tasks),
                        attempts, cluster)


def exit_cause(name: str, code: int) -> str:
    """``worker-1 exited with code -9 (signal SIGKILL)``, or, when the kernel's counters
    say its OOM killer did it, ``out of memory: worker-1 was killed by the kernel's OOM
    killer (memory limit 200 MiB of cgroup /jobs/a)`` (`tfdist.launch.oom`)."""
    out_of_memory = oom_cause(name, code)
    if out_of_memory is not None:
        return out_of_memory
    return f"{name} exited with code {code}" + (
        f" (signal {signal.Signals(-code).name})" if code < 0 and -code in
        signal.valid_signals() else "")


_PORT_IN_USE_MARKERS = ("Address already in use", "address already in use",
                        "Could not start gRPC server", "Failed to add port")


def is_port_clash(tail: str) -> bool:
    """Whether a task's last lines (``tail``) say it could not bind its port."""
    return any(marker in tail for marker in _PORT_IN_USE_MARKERS)


# TensorFlow's words for an error it received from another task over gRPC.
_REMOTE = re.compile(r"from remote target /job:(\w+)/replica:\d+/task:(\d+)")
_ERROR = re.compile(r"\w+(?:Error|Exception): .*")


# Words of an error a task received because another task failed first: Horovod's for a
# rank's exception or exit, Gloo's timeout, and tfdist's for a peer that stopped
# answering (`tfdist.engines.peers`, `tfdist.engines.horovod.watch`).
_PEER_FAILURE_WORDS = ("Horovod has been shut down", "Timed out waiting", " did not answer ",
                       " is not running (nothing listens at ", " could not be reached (",
                       " is not responding: ")
# A task's own line about a peer (`tfdist.engines.horovod.watch`).
_NOT_RESPONDING = re.compile(
    r"tfdist: [\w.-]+: ([\w.-]+) is not responding: (.*?)(?:; Gloo's timeout .*)?$")
# A full disk in a task's last lines: `tfdist.files.disk_full`'s words.
_DISK_FULL = re.compile(r"disk full: .*")


def is_peer_failure(tail: str) -> bool:
    """Whether a task's last lines (``tail``) say it failed because another task did."""
    return any(words in tail for words in _PEER_FAILURE_WORDS)


def failure_cause(name: str, code: int, tail: str) -> str:
    """`exit_cause`, plus what its last lines (``tail``) say of the cause: a full disk
    (``worker-0 exited with code 1: disk full: cannot write ...``), a peer it found not
    responding (``worker-0 exited with code -6 (signal SIGABRT): it found worker-1 not
    responding (...)``), or the task whose error ``name`` received: ``chief-0 exited with
    code 1: its error came from ps-0 (ResourceExhaustedError: OOM when allocating ...)``.
    A ps that runs out of memory while the chief builds the model fails the chief, not
    itself."""
    cause = exit_cause(name, code)
    lines = tail.splitlines()
    for line in reversed(lines):
        found = _DISK_FULL.search(line)
        if found is not None:
            return f"{cause}: {found[0][:500]}"
        found = _NOT_RESPONDING.search(line)
        if found is not None:
            return f"{cause}: it found {found[1]} not responding ({found[2][:500]})"
    for end in range(len(lines), 0, -1):
        remote = _REMOTE.search(lines[end - 1])
        if remote is not None:
            break
    else:
        return cause
    task = f"{remote[1]}-{remote[2]}"
    if task == name:
        return cause
    error = next((m[0] for m in map(_ERROR.search, reversed(lines[:end])) if m), None)
    return f"{cause}: its error came from {task}" + (
        "" if error is None else f" ({error[:300]})")


def announce_restart(log, restart: int, max_restarts: int, cause: str, note: str = "") -> None:
    """Prints ``tfdist launch: restart 1/3: worker-1 exited with code 3`` (+ ``note``)."""
    print(f"tfdist launch: restart {restart}/{max_restarts}: {cause}{note}\n", end="",
          file=log, flush=True)  # one write: other threads may write to the same log
