"""Local multi-process launcher: one subprocess per task, each with its own TF_CONFIG.

Used from the CLI (``tfdist launch``) and from Python or notebooks (`launch`). Every
task runs in its own process group, so stopping a task stops everything it started.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tfdist.cluster import ClusterSpec, TaskSpec

DEFAULT_GRACE_SECONDS = 5.0
TAIL_LINES = 40
MAX_PORT_RETRIES = 3
_namespace_ids = itertools.count()
_PORT_IN_USE_MARKERS = ("Address already in use", "address already in use",
                        "Could not start gRPC server", "Failed to add port")


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


def find_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports on ``host`` that were free a moment ago (all held open while choosing)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def make_local_cluster(workers: int, chief: bool = False, ps: int = 0,
                       host: str = "127.0.0.1") -> ClusterSpec:
    """A cluster of free ports on ``host`` (no task set)."""
    counts = {"chief": int(chief), "worker": workers, "ps": ps}
    ports = find_free_ports(sum(counts.values()), host)
    by_type, start = {}, 0
    for task_type, count in counts.items():
        by_type[task_type] = ports[start:start + count]
        start += count
    return ClusterSpec.local(by_type, workers=workers, chief=chief, ps=ps, host=host)


class _Task:
    """A running task: its process, and a thread that prefixes and keeps its output."""

    def __init__(self, spec: TaskSpec, argv: list[str], env: dict[str, str], stream):
        self.spec = spec
        self.name = spec.name
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.process = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self._reader = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._reader.start()

    def _pump(self, stream):
        for raw in iter(self.process.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            if stream is not None:
                try:
                    stream.write(f"[{self.name}] {line}\n")
                    stream.flush()
                except (ValueError, OSError):
                    pass
        self.process.stdout.close()

    def poll(self):
        return self.process.poll()

    def signal_group(self, signum):
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout=2.0):
        self._reader.join(timeout)

    def tail_text(self) -> str:
        return "\n".join(self.tail)


def stop_tasks(tasks: Sequence[_Task], grace: float = DEFAULT_GRACE_SECONDS) -> None:
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


@contextlib.contextmanager
def private_network():
    """A fresh network namespace with only loopback up; yields the ``wrap`` prefix.

    TensorFlow's gRPC server listens on ``0.0.0.0`` whatever address the cluster names
    (hard-coded in TF's ``grpc_server_lib.cc``). Tasks run with this prefix share one
    namespace whose only interface is its own loopback, so nothing outside the job can
    reach their ports. Needs root (``ip netns``); the namespace is removed on exit.

    Raises:
        RuntimeError: namespaces cannot be created here (not root, no ``ip``).
    """
    name = f"tfdist-{os.getpid()}-{next(_namespace_ids)}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        raise RuntimeError(f"isolate_network needs `ip netns` as root; creating namespace "
                           f"{name} failed: {str(detail).strip()}") from None
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True,
                       capture_output=True)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _task_env(cluster: ClusterSpec, spec: TaskSpec, env: dict[str, str] | None,
              attempt: int, backup_dir: str | None) -> dict[str, str]:
    task_env = dict(os.environ)
    task_env.update(env or {})
    task_env["TF_CONFIG"] = cluster.with_task(spec).to_tf_config()
    task_env["TFDIST_TASK"] = spec.name
    task_env["TFDIST_RESTART"] = str(attempt)
    task_env["PYTHONUNBUFFERED"] = "1"
    task_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if backup_dir:
        task_env["TFDIST_BACKUP_DIR"] = str(backup_dir)
    return task_env


def _run_once(argv: list[str], cluster: ClusterSpec, env, timeout, grace, stream,
              attempt, backup_dir, wrap=None) -> tuple[list[_Task], _Task | None, bool]:
    """Runs every task of one attempt. Returns (tasks, failed task, timed out)."""
    tasks: list[_Task] = []
    try:
        for spec in cluster.tasks():
            prefix = [str(a) for a in wrap(spec)] if wrap is not None else []
            tasks.append(_Task(spec, prefix + argv,
                               _task_env(cluster, spec, env, attempt, backup_dir), stream))
        required = [t for t in tasks if t.spec.type in ("chief", "worker")]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            failed = next((t for t in tasks if t.poll() not in (None, 0)), None)
            if failed is not None:
                stop_tasks([t for t in tasks if t is not failed], grace)
                failed.finish_output()
                return tasks, failed, False
            if all(t.poll() == 0 for t in required):
                stop_tasks([t for t in tasks if t.poll() is None], grace)
                return tasks, None, False
            if deadline is not None and time.monotonic() > deadline:
                stop_tasks(tasks, grace)
                return tasks, None, True
            time.sleep(0.05)
    except BaseException:
        stop_tasks(tasks, grace)
        raise


def _is_port_clash(task: _Task) -> bool:
    return any(marker in task.tail_text() for marker in _PORT_IN_USE_MARKERS)


def run(argv: Sequence[str], *, workers: int = 1, chief: bool = False, ps: int = 0,
        timeout: float | None = None, max_restarts: int = 0, env: dict | None = None,
        backup_dir: str | os.PathLike | None = None, grace_period: float = DEFAULT_GRACE_SECONDS,
        host: str = "127.0.0.1", stream=sys.stdout, log=None,
        cluster: ClusterSpec | None = None,
        wrap: Callable[[TaskSpec], Sequence[str]] | None = None,
        isolate_network: bool = False) -> LaunchResult:
    """Starts ``argv`` once per task and waits for the job.

    Args:
        argv: The command every task runs, e.g. ``[sys.executable, "train.py"]``.
        workers: Number of ``worker`` tasks, >= 1.
        chief: Whether to add a ``chief`` task.
        ps: Number of ``ps`` tasks.
        timeout: Seconds before every task is killed; None for no deadline.
        max_restarts: How often a failed job is stopped and started again.
        env: Extra environment variables for every task.
        backup_dir: Exported as ``TFDIST_BACKUP_DIR`` so restarts resume from it.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping tasks.
        host: Address every task binds to.
        stream: Where prefixed task output goes (None: keep only the tails).
        log: Where the launcher's own messages go (default: stderr).
        cluster: A prebuilt `ClusterSpec` (addresses only) to use instead of free
            ports on ``host``; ``workers``, ``chief`` and ``ps`` are then ignored, and
            a port clash is not retried. For tasks on other interfaces, e.g. network
            namespaces.
        wrap: Called with each task's `TaskSpec`; returns an argv prefix for that
            task, e.g. ``["ip", "netns", "exec", "ns0"]`` to run it in a namespace.
        isolate_network: Run the job in a private network namespace where only its
            own loopback exists (see `private_network`; needs root). TF's servers
            listen on 0.0.0.0: without this, other hosts can reach their ports.

    Returns:
        A `LaunchResult` when every chief and worker exited 0.

    Raises:
        LaunchError: a task failed (after all restarts), or the timeout passed.
        ValueError: bad arguments.
    """
    if cluster is not None:
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"cluster must be a tfdist.ClusterSpec. Received: {cluster!r}")
        cluster = dataclasses.replace(cluster, task=None)
        workers, chief, ps = len(cluster.worker), bool(cluster.chief), len(cluster.ps)
    _validate_counts(workers, chief, ps, timeout, max_restarts)
    if isolate_network:
        if wrap is not None:
            raise ValueError("isolate_network and wrap both place the tasks; give one.")
        with private_network() as prefix:
            return run(argv, workers=workers, chief=chief, ps=ps, timeout=timeout,
                       max_restarts=max_restarts, env=env, backup_dir=backup_dir,
                       grace_period=grace_period, host=host, stream=stream, log=log,
                       cluster=cluster, wrap=lambda spec: prefix)
    log = log or sys.stderr
    fixed_cluster = cluster
    attempt = restarts = port_retries = 0
    while True:
        cluster = fixed_cluster or make_local_cluster(workers, chief, ps, host)
        started = time.monotonic()
        tasks, failed, timed_out = _run_once(list(argv), cluster, env, timeout, grace_period,
                                             stream, attempt, backup_dir, wrap)
        if failed is None and not timed_out:
            return LaunchResult(
                tuple(TaskResult(t.name, t.poll(), t.tail_text()) for t in tasks),
                attempt + 1, cluster)
        if timed_out:
            cause = f"timed out after {timeout:g}s; every task was killed"
            error = LaunchError(f"job {cause}", attempts=attempt + 1,
                                output_tail="\n".join(f"[{t.name}] {t.tail_text()}"
                                                      for t in tasks))
        else:
            code = failed.poll()
            cause = f"{failed.name} exited with code {code}" + (
                f" (signal {signal.Signals(-code).name})" if code < 0 and -code in
                signal.valid_signals() else "")
            clash = _is_port_clash(failed)
            if clash:
                cause += (f": it could not bind its port "
                          f"{cluster.with_task(failed.spec).task_address} (in use?)")
            error = LaunchError(
                f"{cause} after {time.monotonic() - started:.1f}s; the other tasks were "
                f"stopped. Last output of {failed.name}:\n{failed.tail_text()}",
                task=failed.name, returncode=code, output_tail=failed.tail_text(),
                attempts=attempt + 1)
            if fixed_cluster is None and clash and port_retries < MAX_PORT_RETRIES:
                port_retries += 1
                attempt += 1
                print(f"tfdist launch: {failed.name} could not bind its port "
                      f"{cluster.with_task(failed.spec).task_address}; retrying on new ports",
                      file=log, flush=True)
                continue
        if restarts >= max_restarts:
            raise error
        restarts += 1
        attempt += 1
        print(f"tfdist launch: restart {restarts}/{max_restarts}: {cause}", file=log,
              flush=True)


def _validate_counts(workers, chief, ps, timeout, max_restarts):
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1. Received: workers={workers!r}")
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ValueError(f"ps must be an integer >= 0. Received: ps={ps!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds. Received: timeout={timeout!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0. "
                         f"Received: max_restarts={max_restarts!r}")


def launch(target: str | os.PathLike | Callable, *args: Any, workers: int = 1,
           chief: bool = False, ps: int = 0, timeout: float | None = None,
           max_restarts: int = 0, env: dict | None = None, backup_dir=None,
           grace_period: float = DEFAULT_GRACE_SECONDS, stream=sys.stdout,
           isolate_network: bool = False, **kwargs: Any):
    """Runs a script or a function as a local cluster, one fresh process per task.

    A function (from a notebook, say) is pickled by value with cloudpickle, run in every
    task with ``*args`` and ``**kwargs``, and its return values come back as a list in
    task order (chief, workers, ps; ps tasks return None). Multi-worker TensorFlow
    cannot start twice in one process, so this is how a notebook trains on many workers.

    Args:
        target: A path to a Python script (``args`` become its argv) or a callable.
        *args: Script arguments, or positional arguments of the function.
        workers: Number of worker tasks.
        chief: Whether to add a chief task.
        ps: Number of parameter-server tasks.
        timeout: Seconds before the whole job is killed.
        max_restarts: Restarts of the whole job after a failure.
        env: Extra environment variables.
        backup_dir: Directory exported as ``TFDIST_BACKUP_DIR`` for resuming.
        grace_period: Seconds between SIGTERM and SIGKILL.
        stream: Where the prefixed output goes; None to silence it.
        isolate_network: Run the job in a private network namespace (needs root): TF's
            servers listen on 0.0.0.0, and this keeps them unreachable from outside.
        **kwargs: Keyword arguments of the function.

    Returns:
        For a script, a `LaunchResult`; for a function, the list of return values.

    Raises:
        LaunchError: a task failed or the timeout passed; names the task.
        FileNotFoundError: the script does not exist.
    """
    options = dict(workers=workers, chief=chief, ps=ps, timeout=timeout,
                   max_restarts=max_restarts, env=env, backup_dir=backup_dir,
                   grace_period=grace_period, stream=stream, isolate_network=isolate_network)
    if callable(target):
        return _launch_function(target, args, kwargs, options)
    if kwargs:
        raise TypeError(f"keyword arguments are only for functions. Received: {sorted(kwargs)}")
    script = Path(target)
    if not script.is_file():
        raise FileNotFoundError(f"script {str(target)!r} does not exist")
    return run([sys.executable, str(script), *map(str, args)], **options)


def _launch_function(fn, args, kwargs, options):
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="tfdist-launch-") as tmp:
        payload = Path(tmp, "payload.pkl")
        payload.write_bytes(cloudpickle.dumps((fn, args, kwargs)))
        argv = [sys.executable, "-m", "tfdist._task_main", str(payload), tmp]
        # Functions of importable modules are pickled by reference: let every task
        # import what this process can.
        env = dict(options.pop("env") or {})
        paths = [env.get("PYTHONPATH", ""), *sys.path, os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        result = run(argv, env=env, **options)
        values = []
        for task in result.cluster.tasks():
            path = Path(tmp, f"{task.name}.result.pkl")
            # Written by our own child process into our private temp dir: safe to load.
            values.append(cloudpickle.loads(path.read_bytes()) if path.exists() else None)
        return values
