"""One task of a job placed by a cluster engine (`tfdist.spark`, `tfdist.ray`).

The engine gives each task a process of its own (a Spark Python worker, a Ray actor)
and reuses it, but multi-worker TensorFlow cannot start twice in one process. So the
task runs the user's function the way `tfdist.launch` does: in a fresh child process
(``python -m tfdist.runners.task_main``) in its own process group, killed with its
parent however that ends, with its output relayed under the task's name. A failure raises
`TaskFailedError` with the end of that output.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tfdist.cluster import ClusterSpec, TaskSpec
from tfdist.launch.attempt import task_env
from tfdist.launch.options import DEFAULT_GRACE_SECONDS
from tfdist.launch.process import TaskProcess, stop_tasks
from tfdist.launch.results import exit_cause

# Ends a failure's message: the same facts as one JSON line, read back by the driver
# from an engine's error text (Spark passes the task's exception on as text only).
FAILURE_MARK = "tfdist-task-failure: "
_FAILURE_LINE = re.compile(re.escape(FAILURE_MARK) + r"(\{.*\})")


class TaskFailedError(RuntimeError):
    """A task's child process failed; raised inside the engine's task.

    Attributes:
        task: The task's name, e.g. ``worker-1``.
        returncode: The child's exit code, or None when it timed out.
        output_tail: The last lines the child printed.
    """

    def __init__(self, task: str, returncode: int | None, output_tail: str, cause: str):
        facts = {"task": task, "returncode": returncode, "tail": output_tail, "cause": cause}
        super().__init__(f"{cause}. Last output of {task}:\n{output_tail}\n"
                         f"{FAILURE_MARK}{json.dumps(facts)}")
        self.task, self.returncode, self.output_tail, self.cause = (
            task, returncode, output_tail, cause)

    def __reduce__(self):  # engines pickle exceptions back to the driver
        return type(self), (self.task, self.returncode, self.output_tail, self.cause)


def read_failure(text: str) -> dict | None:
    """The facts of the first `TaskFailedError` quoted in an engine's error text."""
    match = _FAILURE_LINE.search(text)
    if match is None:
        return None
    try:
        return json.loads(match[1])
    except ValueError:
        return None


def make_payload(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    """``fn`` (by value), its arguments, and where this process imports its own code
    from, pickled."""
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"fn must be callable. Received: {fn!r}")
    return cloudpickle.dumps({"call": cloudpickle.dumps((fn, tuple(args), dict(kwargs))),
                              "path": _user_paths()})


def _user_paths() -> list[str]:
    """This process's import path less its interpreter's own (stdlib, site-packages):
    where the user's modules are, without mixing another Python's packages in."""
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = []
    for path in sys.path:
        path = os.path.abspath(path or os.getcwd())  # "": the working directory
        real = os.path.realpath(path)
        if "site-packages" in real or "dist-packages" in real or any(
                real == prefix or real.startswith(prefix + os.sep) for prefix in own):
            continue
        paths.append(path)
    return paths


def reserve_port() -> socket.socket:
    """A socket bound to a free port on every interface (as TF's server binds).

    Held until the task starts, so no other task on this host picks the same port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    return sock


def run_task(payload: bytes, cluster: ClusterSpec, index: int, *,
             env: dict[str, str] | None = None, timeout: float | None = None,
             reserved: socket.socket | None = None, stream=sys.stderr,
             grace_period: float = DEFAULT_GRACE_SECONDS) -> bytes:
    """Runs worker ``index`` of ``cluster`` in a fresh child process; returns its result.

    Args:
        payload: From `make_payload`.
        cluster: Every task's address (its ``task`` is ignored).
        index: This task's worker index.
        env: Extra environment variables for the child.
        timeout: Seconds before the child is killed; None for no deadline.
        reserved: The socket holding this task's port, closed just before the start.
        stream: Where the child's output goes, each line prefixed with the task's name.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping the child.

    Returns:
        The function's return value, pickled.

    Raises:
        TaskFailedError: the child exited non-zero or timed out.
    """
    import cloudpickle

    job = cloudpickle.loads(payload)
    spec = TaskSpec("worker", index)
    child_env = dict(env or {})
    # The driver's import path, where it exists here: functions of the driver's own
    # modules are pickled by reference and imported by the child.
    paths = [child_env.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", ""),
             *(p for p in job["path"] if os.path.exists(p))]
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    with tempfile.TemporaryDirectory(prefix="tfdist-task-") as tmp:
        call = Path(tmp, "payload.pkl")
        call.write_bytes(job["call"])
        argv = [sys.executable, "-m", "tfdist.runners.task_main", str(call), tmp]
        if reserved is not None:
            reserved.close()
        task = TaskProcess(spec, argv, task_env(cluster, spec, child_env, 0, None), stream)
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        try:
            while task.poll() is None and not timed_out:
                time.sleep(0.05)
                timed_out = deadline is not None and time.monotonic() > deadline
        finally:
            stop_tasks([task], grace_period)  # whatever it started goes too
        if timed_out:
            raise TaskFailedError(spec.name, None, task.tail_text(),
                                  f"{spec.name} timed out after {timeout:g}s")
        code = task.poll()
        if code != 0:
            raise TaskFailedError(spec.name, code, task.tail_text(),
                                  exit_cause(spec.name, code))
        return Path(tmp, f"{spec.name}.result.pkl").read_bytes()


def load_results(blobs: Sequence[bytes]) -> list[Any]:
    """Return values from `run_task`, in task order."""
    import cloudpickle

    # Pickled by our own task code from the user's function, as the engine itself does.
    return [cloudpickle.loads(blob) for blob in blobs]


def check_run_options(workers: Any, timeout: Any) -> None:
    """Raises ValueError for a worker count or timeout `run` cannot use."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1. Received: workers={workers!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be > 0 seconds or None. Received: timeout={timeout!r}")
