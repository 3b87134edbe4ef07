"""Local multi-process launcher: one subprocess per task, each with its own TF_CONFIG.

Used from the CLI (``tfdist launch``) and from Python or notebooks (`launch`). Every
task runs in its own process group, so stopping a task stops everything it started, and
every task dies with the launcher, however the launcher ends (`_start_process`). Task
output is relayed as it comes, each line and progress-bar update prefixed with the
task's name (`_relay`).
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import ctypes
import dataclasses
import importlib.machinery
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tfdist.checks import check_int, check_seconds
from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec, TaskSpec
from tfdist.rendezvous import gpu_env, run_node

DEFAULT_GRACE_SECONDS = 5.0
# Seconds an evaluator task may go on after training ended before it is stopped.
DEFAULT_EVALUATOR_WAIT_SECONDS = 120.0
TAIL_LINES = 40
MAX_PORT_RETRIES = 3
IDLE_SECONDS = 0.5  # an unfinished line is shown after this long without output
MAX_SEGMENT_CHARS = 65536  # a longer line without an end is cut there
_LINE_END = re.compile(r"(\r|\n)")
# A C++ log line in absl's format: "I0000 00:00:1795367414.655962    5257 port.cc:153] ..."
_CPP_LOG_LINE = re.compile(r"[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_ABSL_EARLY_LOG_NOTE = "WARNING: All log messages before absl::InitializeLog() is called"
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_HOROVOD_PREFIX = re.compile(r"\[(\d+)\]<(?:stdout|stderr)>:")
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_GUARD_SCRIPT = Path(__file__).with_name("_task_guard.py")
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


def launch_result(tasks: Sequence["TaskProcess"], attempts: int, cluster: ClusterSpec) -> LaunchResult:
    """The `LaunchResult` of a finished attempt (single-node or one node's share)."""
    return LaunchResult(tuple(TaskResult(t.name, t.poll(), t.tail_text()) for t in tasks),
                        attempts, cluster)


def announce_restart(log, restart: int, max_restarts: int, cause: str, note: str = "") -> None:
    """Prints ``tfdist launch: restart 1/3: worker-1 exited with code 3`` (+ ``note``)."""
    print(f"tfdist launch: restart {restart}/{max_restarts}: {cause}{note}\n", end="",
          file=log, flush=True)  # one write: other threads may write to the same log


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
                       host: str = "127.0.0.1", evaluator: bool = False) -> ClusterSpec:
    """A cluster of free ports on ``host`` (no task set)."""
    counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
    ports = find_free_ports(sum(counts.values()), host)
    by_type, start = {}, 0
    for task_type, count in counts.items():
        by_type[task_type] = ports[start:start + count]
        start += count
    return ClusterSpec.local(by_type, workers=workers, chief=chief, ps=ps, host=host,
                             evaluator=evaluator)


class _Guard:
    """Kills the tasks' process groups when this process ends, however it ends.

    A small helper process (``_task_guard.py``, in a session of its own so signals sent
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


def _start_process(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
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


def _relay(pipe, add: Callable[[str, str], None], idle: float = IDLE_SECONDS) -> None:
    """Hands ``pipe``'s output to ``add(text, end)`` as it comes, until EOF, then closes it.

    Reads whatever is there (not whole lines) and cuts it at every ``\n`` and ``\r``:
    ``end`` is the character that ended ``text``, or "" for an unfinished segment shown
    because the process printed nothing for ``idle`` seconds (it comes again, finished).
    """
    fd = pipe.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending, shown = "", True
    try:
        while True:
            if not shown and not select.select([fd], [], [], idle)[0]:
                add(pending, "")
                shown = True
                continue
            chunk = os.read(fd, 65536)
            parts = _LINE_END.split(pending + decoder.decode(chunk, final=not chunk))
            pending = parts.pop()
            for text, end in zip(parts[::2], parts[1::2]):
                add(text, end)
            if len(pending) > MAX_SEGMENT_CHARS:
                add(pending, "\n")
                pending = ""
            shown = not pending
            if not chunk:
                break
        if pending:
            add(pending, "\n")
    finally:
        pipe.close()


def _cpp_log_level(env: dict[str, str]) -> int:
    """The TF_CPP_MIN_LOG_LEVEL of an environment (0 when unset or not a number)."""
    try:
        return int(env.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def _is_hidden(text: str, cpp_log_level: int) -> bool:
    """Whether TF_CPP_MIN_LOG_LEVEL=cpp_log_level hides this C++ log line.

    TF 2.21 logs its oneDNN banner before it reads its log level, so it shows at every
    level (checked); the launcher drops such lines as TF would have.
    """
    if text.startswith(_ABSL_EARLY_LOG_NOTE):
        return cpp_log_level >= 2
    return bool(_CPP_LOG_LINE.match(text)) and "IWEF".index(text[0]) < cpp_log_level


def _visible_len(text: str) -> int:
    """Columns ``text`` takes on a terminal (colour codes take none)."""
    return len(_ANSI_CODE.sub("", text))


def _write(stream, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (ValueError, OSError):  # closed, or the terminal hung up
        pass


class _Console:
    """Writes the tasks' output segments to their streams, whole and prefixed.

    A ``\r`` segment is a live update (a progress bar) and is written as one, so a
    terminal redraws ``[worker-0] 3/10 ━━━...`` in place. Tasks share that bottom line:
    whatever is written next (a line, or another task's update) covers the update.
    """

    def __init__(self):
        # id(stream) -> (task, line, width on screen) of the update the cursor is on
        self._open: dict[int, tuple[str | None, str, int]] = {}
        self._lock = threading.Lock()

    def write(self, stream, name: str | None, text: str, end: str) -> None:
        """Writes ``text`` of task ``name`` (None: no prefix), ended by ``end``."""
        line = text if name is None else f"[{name}] {text}"
        with self._lock:
            update = self._open.pop(id(stream), None)
            out = line
            if update is not None:
                if end == "\r" and update[:2] == (name, line):
                    self._open[id(stream)] = update  # unchanged
                    return
                if end == "\n" and not text and update[0] == name:
                    out = ""  # "\r\n": the update stays as the line
                else:  # cover all of the update (of this task or another)
                    out += " " * (update[2] - _visible_len(line))
            if end == "\r":
                self._open[id(stream)] = (name, line, _visible_len(out))
            _write(stream, out + end)

    def close(self, stream, name: str | None) -> None:
        """Ends an update of task ``name`` still open on ``stream``."""
        with self._lock:
            update = self._open.get(id(stream))
            if update is not None and update[0] == name:
                del self._open[id(stream)]
                _write(stream, "\n")


_CONSOLE = _Console()


class _TaskOutput:
    """One task's output: drops what its TF log level hides, keeps a tail, writes it."""

    def __init__(self, name: str | None, stream, cpp_log_level: int, tail=None):
        self.name, self.stream, self.cpp_log_level = name, stream, cpp_log_level
        self.tail = collections.deque(maxlen=TAIL_LINES) if tail is None else tail
        self._update = ""  # the last "\r" update, until a line ends it

    def add(self, text: str, end: str) -> None:
        """Takes one segment from `_relay`."""
        text = text.rstrip("\b")  # Keras backspaces over its bar before each "\r"
        if _is_hidden(text, self.cpp_log_level):
            return
        if end == "\n":
            self.tail.append(text or self._update)
            self._update = ""
        elif not text:
            return
        elif end == "\r":
            self._update = text
        if self.stream is not None:
            _CONSOLE.write(self.stream, self.name, text, end or "\r")

    def close(self) -> None:
        """At the end of the output: keeps the last update if no line ended it."""
        if self._update:
            self.tail.append(self._update)
            self._update = ""
        if self.stream is not None:
            _CONSOLE.close(self.stream, self.name)


class TaskProcess:
    """A running task: its process, and a thread that relays its output as it comes."""

    def __init__(self, spec: TaskSpec, argv: list[str], env: dict[str, str], stream):
        self.spec = spec
        self.name = spec.name
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.process = _start_process(argv, env)
        self._output = _TaskOutput(self.name, stream, _cpp_log_level(env), self.tail)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self):
        _relay(self.process.stdout, self._output.add)
        self._output.close()

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


def split_horovod_prefix(text: str) -> tuple[str | None, str]:
    """``[1]<stdout>:text`` (horovodrun's prefix) -> ``("worker-1", "text")``.

    For `run_command`'s ``route``: output without that prefix (horovodrun's own) gives
    ``(None, text)``.
    """
    match = _HOROVOD_PREFIX.match(text)
    return (f"worker-{match[1]}", text[match.end():]) if match else (None, text)


def run_command(argv: Sequence[str], *, timeout: float | None = None, env: dict | None = None,
                grace_period: float = DEFAULT_GRACE_SECONDS, stream=sys.stdout,
                route: Callable[[str], tuple[str | None, str]] | None = None) -> int:
    """Runs one command as `run` runs a task, for launchers of their own (``horovodrun``).

    The command gets its own process group, dies with this process, and runs with the
    tasks' environment (unbuffered Python, TF's start-up banners hidden). Its output is
    relayed as it comes; ``route`` maps each line to ``(task name, text)`` so it gets
    the same ``[worker-0]`` prefix as in `run` (None: the line as it is).

    Returns:
        The command's exit code. Its process group is stopped when it ends.

    Raises:
        LaunchError: the timeout passed (the process group was stopped).
    """
    env = _command_env(env)
    process = _start_process(list(argv), env)
    outputs: dict[str | None, _TaskOutput] = {}

    def add(text, end):
        name, text = route(text) if route is not None else (None, text)
        if name not in outputs:
            outputs[name] = _TaskOutput(name, stream, _cpp_log_level(env))
        outputs[name].add(text, end)

    reader = threading.Thread(target=_relay, args=(process.stdout, add), daemon=True)
    reader.start()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{Path(argv[0]).name} timed out after {timeout:g}s; its process "
                          f"group was stopped") from None
    finally:
        for signum, wait in ((signal.SIGTERM, grace_period), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait)
        reader.join(2.0)
        for output in list(outputs.values()):
            output.close()
    return process.returncode


@contextlib.contextmanager
def private_network():
    """A fresh network namespace with only loopback up; yields the ``wrap`` prefix.

    TensorFlow's gRPC server listens on ``0.0.0.0`` whatever address the cluster names
    (hard-coded in TF's ``grpc_server_lib.cc``). Tasks run with this prefix share one
    namespace whose only interface is its own loopback, so nothing outside the job can
    reach their ports. The namespace has no name: this process holds it open by a file
    descriptor and the tasks by living in it, so the kernel frees it when they are all
    gone, even if this process is killed (a named ``ip netns`` would stay behind).
    Needs root (``unshare --net``, ``nsenter``).

    Raises:
        RuntimeError: namespaces cannot be created here (not root, no ``unshare``).
    """
    # A helper makes the namespace and brings loopback up; we keep a handle, it exits.
    command = ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && read _"]
    try:
        helper = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    except OSError as error:
        raise RuntimeError(f"isolate_network needs `unshare` (util-linux): {error}") from None
    ready = helper.stdout.readline().strip() == "up"
    handle = os.open(f"/proc/{helper.pid}/ns/net", os.O_RDONLY) if ready else None
    _, errors = helper.communicate("")
    if handle is None:
        raise RuntimeError(f"isolate_network needs root to create a network namespace; "
                           f"`{' '.join(command)}` failed with exit code "
                           f"{helper.returncode}: {errors.strip()}")
    try:
        yield ["nsenter", f"--net=/proc/{os.getpid()}/fd/{handle}", "--"]
    finally:
        os.close(handle)


def _command_env(env: dict[str, str] | None) -> dict[str, str]:
    """Ours and ``env``, with unbuffered Python (live output) and TF's INFO and WARNING
    start-up lines hidden (TF_CPP_MIN_LOG_LEVEL=2), unless the user set a level."""
    command_env = dict(os.environ)
    command_env.update(env or {})
    command_env["PYTHONUNBUFFERED"] = "1"
    command_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return command_env


def task_env(cluster: ClusterSpec, spec: TaskSpec, env: dict[str, str] | None,
             attempt: int, backup_dir: str | None) -> dict[str, str]:
    """The environment of task ``spec``: ``env`` plus its TF_CONFIG and tfdist's variables."""
    environ = _command_env(env)
    environ["TF_CONFIG"] = cluster.with_task(spec).to_tf_config()
    environ["TFDIST_TASK"] = spec.name
    environ["TFDIST_RESTART"] = str(attempt)
    if backup_dir:
        environ["TFDIST_BACKUP_DIR"] = str(backup_dir)
    return environ


# A parameter-server chief asks the launcher to restart a worker by creating the file
# ``<TFDIST_CONTROL_DIR>/restart-<task>`` (its text: why). See `_PsWorkerRestarts`.
CONTROL_DIR_ENV = "TFDIST_CONTROL_DIR"


class _PsWorkerRestarts:
    """Restarts a dead parameter-server worker alone, at its address, while the chief runs.

    In a cluster with a chief and ps tasks the chief's `ClusterCoordinator` reschedules
    a dead worker's steps and takes a restarted worker back, so the job goes on. Each
    restart uses one of ``max_restarts`` (shared with whole-job restarts); when none
    is left, the worker's death fails the job as before. A worker the chief names in a
    restart request (a frozen one) is SIGKILLed first.
    """

    def __init__(self, max_restarts: int, log):
        self.max_restarts = max_restarts
        self.log = log
        self.used = 0  # worker restarts so far
        self.job_restarts = 0  # whole-job restarts so far (set by `run`)
        self.control_dir = None  # set by `_run_once` for each attempt

    def kill_requested(self, tasks) -> None:
        """SIGKILLs the running workers the chief asked to restart."""
        for name in os.listdir(self.control_dir):
            task = next((t for t in tasks if f"restart-{t.name}" == name), None)
            path = os.path.join(self.control_dir, name)
            if task is None or task.poll() is not None:
                continue
            reason = Path(path).read_text(errors="replace").strip()
            os.unlink(path)
            print(f"tfdist launch: the chief asked to restart {task.name} ({reason}); "
                  "killing it", file=self.log, flush=True)
            task.signal_group(signal.SIGKILL)

    def replace(self, tasks, failed, start) -> bool:
        """Restarts ``failed`` in ``tasks`` with ``start(spec, n)``; False if it may not."""
        chief = next((t for t in tasks if t.spec.type == "chief"), None)
        spent = self.used + self.job_restarts
        if failed.spec.type != "worker" or chief is None or chief.poll() is not None or \
                spent >= self.max_restarts:
            return False
        self.used += 1
        code = failed.poll()
        failed.signal_group(signal.SIGKILL)  # whatever it started goes too
        failed.finish_output()
        announce_restart(self.log, spent + 1, self.max_restarts,
                         f"{failed.name} exited with code {code}",
                         f"; restarting {failed.name} alone (parameter-server job)")
        tasks[tasks.index(failed)] = start(failed.spec, self.used)
        return True


def _run_once(argv: list[str], cluster: ClusterSpec, env, timeout, grace, stream,
              attempt, backup_dir, wrap=None,
              ps_restarts: _PsWorkerRestarts | None = None, *,
              specs: Sequence[TaskSpec] | None = None,
              extra_env: Callable[[TaskSpec], dict] | None = None,
              peers=None, evaluator_wait: float = DEFAULT_EVALUATOR_WAIT_SECONDS,
              log=None) -> tuple[list[TaskProcess], TaskProcess | None, bool]:
    """Runs every task of one attempt. Returns (tasks, failed task, timed out).

    ``specs`` are the tasks to start here (default: all of ``cluster``), ``extra_env``
    adds variables per task, and ``peers`` (a `tfdist.rendezvous.NodeLink`) joins this
    node to a multi-node job: a failure here is reported to node 0, and node 0's word
    (stop, or end) stops the tasks here; the caller reads ``peers`` for which.

    An ``evaluator`` task does not train: its exit code never fails the job (a non-zero
    one is reported on ``log``), and once the chief and workers have exited 0 it has
    ``evaluator_wait`` seconds to end on its own before it is stopped like a ps task.
    """
    log = log or sys.stderr
    reported: set[str] = set()
    trained_at = None
    tasks: list[TaskProcess] = []
    if ps_restarts is not None:
        ps_restarts.control_dir = tempfile.mkdtemp(prefix="tfdist-control-")

    def start(spec, task_restart=0):
        prefix = [str(a) for a in wrap(spec)] if wrap is not None else []
        environ = task_env(cluster, spec, env, attempt, backup_dir)
        if extra_env is not None:
            environ.update(extra_env(spec))
        if ps_restarts is not None:
            environ[CONTROL_DIR_ENV] = ps_restarts.control_dir
            environ["TFDIST_TASK_RESTART"] = str(task_restart)
        return TaskProcess(spec, prefix + argv, environ, stream)

    try:
        for spec in (cluster.tasks() if specs is None else specs):
            tasks.append(start(spec))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if ps_restarts is not None:
                ps_restarts.kill_requested(tasks)
            _report_evaluator_exit(tasks, reported, log)
            failed = next((t for t in tasks if t.poll() not in (None, 0)
                           and t.spec.type != "evaluator"), None)
            if failed is not None and ps_restarts is not None and \
                    ps_restarts.replace(tasks, failed, start):
                continue
            if failed is not None:
                if peers is not None:
                    peers.report_failure(failed.name, exit_cause(failed.name, failed.poll()))
                stop_tasks([t for t in tasks if t is not failed], grace)
                failed.finish_output()
                return tasks, failed, False
            done = all(t.poll() == 0 for t in tasks if t.spec.type in TRAINING_TASK_TYPES)
            if done and peers is not None:
                peers.report_done()  # ps tasks serve on until every node is done
            if done and trained_at is None:
                trained_at = time.monotonic()
            evaluating = done and peers is None and _is_evaluating(tasks) and \
                time.monotonic() - trained_at < evaluator_wait
            if (done and peers is None and not evaluating) or (
                    peers is not None and peers.should_stop()):
                stop_tasks([t for t in tasks if t.poll() is None], grace)
                return tasks, None, False
            if deadline is not None and time.monotonic() > deadline:
                if peers is not None:
                    peers.report_failure(None, f"the job timed out after {timeout:g}s")
                stop_tasks(tasks, grace)
                return tasks, None, True
            time.sleep(0.05)
    except BaseException:
        stop_tasks(tasks, grace)
        raise
    finally:
        if ps_restarts is not None:
            shutil.rmtree(ps_restarts.control_dir, ignore_errors=True)


def _is_evaluating(tasks: Sequence[TaskProcess]) -> bool:
    """Whether an evaluator task is still running."""
    return any(t.spec.type == "evaluator" and t.poll() is None for t in tasks)


def _report_evaluator_exit(tasks: Sequence[TaskProcess], reported: set[str], log) -> None:
    """Reports (once) an evaluator that exited non-zero; the job goes on without it."""
    for task in tasks:
        code = task.poll()
        if task.spec.type == "evaluator" and code not in (None, 0) and \
                task.name not in reported:
            reported.add(task.name)
            task.finish_output()
            print(f"tfdist launch: {exit_cause(task.name, code)}; training goes on "
                  f"without it. Last output of {task.name}:\n{task.tail_text()}",
                  file=log, flush=True)


def exit_cause(name: str, code: int) -> str:
    """``worker-1 exited with code -9 (signal SIGKILL)``."""
    return f"{name} exited with code {code}" + (
        f" (signal {signal.Signals(-code).name})" if code < 0 and -code in
        signal.valid_signals() else "")


def _is_port_clash(task: TaskProcess) -> bool:
    return any(marker in task.tail_text() for marker in _PORT_IN_USE_MARKERS)


def run(argv: Sequence[str], *, workers: int = 1, chief: bool = False, ps: int = 0,
        timeout: float | None = None, max_restarts: int = 0, env: dict | None = None,
        backup_dir: str | os.PathLike | None = None, grace_period: float = DEFAULT_GRACE_SECONDS,
        host: str = "127.0.0.1", stream=sys.stdout, log=None,
        cluster: ClusterSpec | None = None,
        wrap: Callable[[TaskSpec], Sequence[str]] | None = None,
        isolate_network: bool = False, restart_ps_workers: bool = True,
        gpus_per_task: int | None = None, nnodes: int = 1, node_rank: int = 0,
        master: str | None = None, node_addr: str | None = None, token: str | None = None,
        join_timeout: float = 120.0, evaluator: bool = False,
        evaluator_wait: float = DEFAULT_EVALUATOR_WAIT_SECONDS) -> LaunchResult:
    """Starts ``argv`` once per task and waits for the job.

    With ``master`` (and ``nnodes`` > 1), this is one node of a multi-node job: every
    node runs the same call with its own ``node_rank``; ``workers``, ``chief`` and
    ``ps`` count the tasks of this node (see `tfdist.rendezvous`).

    Args:
        argv: The command every task runs, e.g. ``[sys.executable, "train.py"]``.
        workers: Number of ``worker`` tasks, >= 1.
        chief: Whether to add a ``chief`` task.
        ps: Number of ``ps`` tasks.
        timeout: Seconds before every task is killed; None for no deadline.
        max_restarts: How often a failed job is stopped and started again. In a
            multi-node job every node stops and rejoins node 0, which counts the
            restarts for all (every node must give the same number).
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
        restart_ps_workers: In a cluster with a chief and ps tasks, a worker that dies
            while the chief runs is restarted alone, at the same address (one of
            ``max_restarts`` each), instead of the whole job; the chief may also ask
            for a frozen worker to be killed and restarted (see `_PsWorkerRestarts`).
        gpus_per_task: GPUs each task gets in ``CUDA_VISIBLE_DEVICES``; default: the
            node's GPUs (CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``) divided by its
            tasks. Without GPUs nothing is set.
        nnodes: Nodes (hosts) in the job.
        node_rank: This node's rank, 0..nnodes-1. Node 0 hosts the rendezvous.
        master: ``HOST:PORT`` of node 0's rendezvous; needed when ``nnodes`` > 1.
        node_addr: The address other nodes reach this node's tasks at (default: the
            address node 0 sees this node's connection come from).
        token: Shared rendezvous secret (default: $TFDIST_TOKEN; node 0 makes one and
            prints it when neither is set).
        join_timeout: Seconds for every node to join before each joined node fails,
            naming the missing ones.
        evaluator: Whether to add an ``evaluator`` task (TF's role for side-car
            evaluation, e.g. `tfdist.keras.SidecarEvaluator`). It does not train: the
            job's outcome is the chief's and workers'. Single-node jobs only.
        evaluator_wait: Seconds the evaluator may run on after training ended (to
            evaluate the last checkpoints) before it is stopped like a ps task.

    Returns:
        A `LaunchResult` when every chief and worker exited 0 (in a multi-node job:
        this node's tasks, and the whole cluster).

    Raises:
        LaunchError: a task failed (after all restarts), or the timeout passed.
        ValueError: bad arguments.
    """
    if cluster is not None:
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"cluster must be a tfdist.ClusterSpec. Received: {cluster!r}")
        cluster = dataclasses.replace(cluster, task=None)
        workers, chief, ps = len(cluster.worker), bool(cluster.chief), len(cluster.ps)
        evaluator = bool(cluster.evaluator)
    _validate_counts(workers, chief, ps, timeout, max_restarts)
    check_seconds("evaluator_wait", evaluator_wait)
    if master is not None or nnodes != 1:
        if evaluator:
            raise ValueError("an evaluator task runs in single-node jobs only; run it as "
                             "a job of its own (or in the chief's process) on a multi-node "
                             f"job. Received: evaluator=True, nnodes={nnodes!r}")
        return _run_node(argv, workers=workers, chief=chief, ps=ps, timeout=timeout,
                         max_restarts=max_restarts, env=env, backup_dir=backup_dir,
                         grace_period=grace_period, stream=stream, log=log, cluster=cluster,
                         wrap=wrap, isolate_network=isolate_network,
                         gpus_per_task=gpus_per_task, nnodes=nnodes, node_rank=node_rank,
                         master=master, node_addr=node_addr, token=token,
                         join_timeout=join_timeout)
    if isolate_network:
        if wrap is not None:
            raise ValueError("isolate_network and wrap both place the tasks; give one.")
        with private_network() as prefix:
            return run(argv, workers=workers, chief=chief, ps=ps, timeout=timeout,
                       max_restarts=max_restarts, env=env, backup_dir=backup_dir,
                       grace_period=grace_period, host=host, stream=stream, log=log,
                       cluster=cluster, wrap=lambda spec: prefix,
                       restart_ps_workers=restart_ps_workers, gpus_per_task=gpus_per_task,
                       evaluator=evaluator, evaluator_wait=evaluator_wait)
    log = log or sys.stderr
    ps_restarts = _PsWorkerRestarts(max_restarts, log) if (
        restart_ps_workers and chief and ps) else None
    fixed_cluster = cluster
    attempt = restarts = port_retries = 0
    while True:
        cluster = fixed_cluster or make_local_cluster(workers, chief, ps, host, evaluator)
        started = time.monotonic()
        if ps_restarts is not None:
            ps_restarts.job_restarts = restarts
        pins = gpu_env(cluster.tasks(), _command_env(env), gpus_per_task)
        tasks, failed, timed_out = _run_once(list(argv), cluster, env, timeout, grace_period,
                                             stream, attempt, backup_dir, wrap, ps_restarts,
                                             extra_env=lambda spec: pins[spec.name],
                                             evaluator_wait=evaluator_wait, log=log)
        if failed is None and not timed_out:
            return launch_result(tasks, attempt + 1, cluster)
        if timed_out:
            cause = f"timed out after {timeout:g}s; every task was killed"
            error = LaunchError(f"job {cause}", attempts=attempt + 1,
                                output_tail="\n".join(f"[{t.name}] {t.tail_text()}"
                                                      for t in tasks))
        else:
            code = failed.poll()
            cause = exit_cause(failed.name, code)
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
        spent = restarts + (ps_restarts.used if ps_restarts is not None else 0)
        if spent >= max_restarts:
            raise error
        restarts += 1
        attempt += 1
        announce_restart(log, spent + 1, max_restarts, cause)


def _run_node(argv, *, master, nnodes, cluster, isolate_network, **options):
    """One node of a multi-node job (`tfdist.rendezvous.run_node`), after checks."""
    if master is None:
        raise ValueError(f"a multi-node job needs master='HOST:PORT' (node 0's rendezvous). "
                         f"Received: nnodes={nnodes!r}, master=None")
    unsupported = {"cluster": cluster, "isolate_network": isolate_network}
    given = {k: v for k, v in unsupported.items() if v}
    if given:
        raise ValueError(f"a multi-node job does not support {', '.join(given)} yet. "
                         f"Received: {given}")
    return run_node(argv, master=master, nnodes=nnodes, **options)


def _validate_counts(workers, chief, ps, timeout, max_restarts):
    check_int("workers", workers, 1)
    check_int("ps", ps, 0)
    check_seconds("timeout", timeout, allow_none=True)
    check_int("max_restarts", max_restarts, 0)


def launch(target: str | os.PathLike | Callable | None = None, *args: Any,
           module: str | None = None, workers: int = 1,
           chief: bool = False, ps: int = 0, timeout: float | None = None,
           max_restarts: int = 0, env: dict | None = None, backup_dir=None,
           grace_period: float = DEFAULT_GRACE_SECONDS, stream=sys.stdout,
           isolate_network: bool = False, restart_ps_workers: bool = True,
           gpus_per_task: int | None = None, nnodes: int = 1, node_rank: int = 0,
           master: str | None = None, node_addr: str | None = None,
           token: str | None = None, join_timeout: float = 120.0, evaluator: bool = False,
           evaluator_wait: float = DEFAULT_EVALUATOR_WAIT_SECONDS, **kwargs: Any):
    """Runs a script or a function as a local cluster, one fresh process per task.

    A function (from a notebook, say) is pickled by value with cloudpickle, run in every
    task with ``*args`` and ``**kwargs``, and its return values come back as a list in
    task order (chief, workers, ps, evaluator; ps tasks return None, and so does an
    evaluator stopped after ``evaluator_wait``). Multi-worker TensorFlow
    cannot start twice in one process, so this is how a notebook trains on many workers.

    With ``module="pkg.train"`` every task runs ``python -m pkg.train`` instead, and all
    positional arguments are the module's: ``launch("--epochs", 3, module="pkg.train")``.

    Args:
        target: A path to a Python script (``args`` become its argv) or a callable;
            with ``module``, the module's first argument (or nothing).
        *args: Script or module arguments, or positional arguments of the function.
        module: A module every task runs as ``python -m module``, found as ``python -m``
            finds it (the current directory first).
        workers: Number of worker tasks.
        chief: Whether to add a chief task.
        ps: Number of parameter-server tasks.
        timeout: Seconds before the whole job is killed.
        max_restarts: Restarts of the whole job after a failure (multi-node: on every
            node; give every node the same number).
        env: Extra environment variables.
        backup_dir: Directory exported as ``TFDIST_BACKUP_DIR`` for resuming.
        grace_period: Seconds between SIGTERM and SIGKILL.
        stream: Where the prefixed output goes; None to silence it.
        isolate_network: Run the job in a private network namespace (needs root): TF's
            servers listen on 0.0.0.0, and this keeps them unreachable from outside.
        restart_ps_workers: With a chief and ps tasks, restart a dead (or frozen)
            worker alone while the chief runs, one of ``max_restarts`` each (see `run`).
        gpus_per_task: GPUs pinned per task with CUDA_VISIBLE_DEVICES (see `run`).
        nnodes: Nodes in a multi-node job; every node makes the same call.
        node_rank: This node's rank (node 0 hosts the rendezvous at ``master``).
        master: ``HOST:PORT`` of node 0's rendezvous.
        node_addr: This node's address as the others reach it (default: as node 0 sees it).
        token: Shared rendezvous secret (default: $TFDIST_TOKEN, else node 0 prints one).
        join_timeout: Seconds for every node to join.
        evaluator: Add one ``evaluator`` task (see `run`); single-node jobs only.
        evaluator_wait: Seconds the evaluator may run on after training ended.
        **kwargs: Keyword arguments of the function.

    Returns:
        For a script or module, a `LaunchResult`; for a function, the list of return
        values (in a multi-node job: None for the tasks of other nodes).

    Raises:
        LaunchError: a task failed or the timeout passed; names the task.
        FileNotFoundError: the script does not exist.
        ModuleNotFoundError: the module's top-level package is nowhere to be found.
        TypeError: no target and no module, or keyword arguments without a function.
    """
    options = dict(workers=workers, chief=chief, ps=ps, timeout=timeout,
                   max_restarts=max_restarts, env=env, backup_dir=backup_dir,
                   grace_period=grace_period, stream=stream, isolate_network=isolate_network,
                   restart_ps_workers=restart_ps_workers, gpus_per_task=gpus_per_task,
                   nnodes=nnodes, node_rank=node_rank, master=master, node_addr=node_addr,
                   token=token, join_timeout=join_timeout, evaluator=evaluator,
                   evaluator_wait=evaluator_wait)
    if module is not None:
        return _launch_module(module, target, args, kwargs, options)
    if target is None:
        raise TypeError("launch needs a script path, a function or module=. Received none.")
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


def _launch_module(module, target, args, kwargs, options):
    """``python -m module ARGS`` in every task; ``target``, if given, is the first ARG."""
    if kwargs:
        raise TypeError(f"keyword arguments are only for functions. Received: {sorted(kwargs)}")
    if callable(target):
        raise TypeError(f"give a function or module=, not both. Received: {target!r} and "
                        f"module={module!r}")
    _check_module(module, (options.get("env") or {}).get("PYTHONPATH", ""))
    module_args = args if target is None else (target, *args)
    return run([sys.executable, "-m", module, *map(str, module_args)], **options)


def _check_module(module, pythonpath: str = "") -> None:
    """Fails unless ``module`` is a dotted name whose top-level package a task's
    ``python -m`` would find (the current directory first). Imports nothing."""
    if not isinstance(module, str) or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"module must be a dotted module name like 'pkg.train'. "
                         f"Received: module={module!r}")
    top = module.split(".")[0]
    search = [os.getcwd(), *pythonpath.split(os.pathsep),
              *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]
    if top not in sys.builtin_module_names and importlib.machinery.PathFinder.find_spec(
            top, [p for p in search if p]) is None:
        raise ModuleNotFoundError(f"no module named {top!r} in the current directory "
                                  f"({os.getcwd()}) or on the path. Received: module={module!r}")
