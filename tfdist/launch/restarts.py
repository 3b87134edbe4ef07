"""Restart policies: what a failed task costs, given to the launcher by its caller.

`JobRestarts` stops every task and starts the whole job again, while ``max_restarts``
allow. `PsWorkerRestarts` also restarts a dead parameter-server worker alone, at its
address, while the chief runs, and with no restart left carries on without it. The launcher calls a policy's hooks; it does not know
which strategy the tasks run: `tfdist.launch` and ``tfdist train`` choose the policy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from tfdist import env
from tfdist.cluster import TaskSpec
from tfdist.launch.results import announce_restart, exit_cause, is_port_clash

# A parameter-server chief asks the launcher to restart a worker by creating the file
# ``<TFDIST_CONTROL_DIR>/restart-<task>``, to stop a frozen ps with ``stop-<task>`` (its
# text: why). See `PsWorkerRestarts`.
CONTROL_DIR_ENV = env.CONTROL_DIR
TASK_RESTART_ENV = env.TASK_RESTART


STOP_WAIT_SECONDS = 5.0  # for a ps killed at the chief's request to exit


def _wait_for_exit(task, seconds: float) -> None:
    """Waits up to ``seconds`` for ``task`` to exit (its exit time noted)."""
    deadline = time.monotonic() + seconds
    while task.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


class JobRestarts:
    """Restarts of the whole job: a failed task ends the attempt, then the job starts again.

    Subclasses restart single tasks, or go on without them, through the per-attempt
    hooks (`attempt`, `task_env`, `check`, `replace`, `is_lost`, `failure_note`), which
    do nothing here.

    Args:
        max_restarts: Restarts allowed, of the job and of single tasks together.
        log: Where restarts are announced.
    """

    def __init__(self, max_restarts: int, log):
        self.max_restarts = max_restarts
        self.log = log
        self.job_restarts = 0  # whole-job restarts so far

    @property
    def spent(self) -> int:
        """Restarts used so far."""
        return self.job_restarts

    def restart_job(self) -> int | None:
        """Counts one restart of the whole job: its number, or None when none is left."""
        if self.spent >= self.max_restarts:
            return None
        self.job_restarts += 1
        return self.spent

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around one attempt of the job (set up and clean up what its tasks use)."""
        yield

    def task_env(self, task_restart: int) -> dict[str, str]:
        """Variables a task gets; ``task_restart`` counts its restarts alone."""
        return {}

    def check(self, tasks: list) -> None:
        """Called with the attempt's running `TaskProcess` list on every poll."""

    def grow(self, tasks: list, cluster, start: Callable[..., object]) -> None:
        """Adds tasks to the running attempt: ``start(spec, 0, grown_cluster)`` appended
        to ``tasks`` (none here)."""

    def replace(self, tasks: list, failed, start: Callable[[TaskSpec, int], object]) -> bool:
        """Restarts ``failed`` alone in ``tasks`` with ``start(spec, n)``, or lets the job
        go on without it (`is_lost`); False if its failure ends the attempt."""
        return False

    def others_done(self, tasks: list) -> bool:
        """Whether the job's tasks elsewhere (other nodes of an elastic job) are done too:
        the attempt ends when they are and this node's have exited 0."""
        return True

    def is_lost(self, task) -> bool:
        """Whether the attempt goes on without ``task`` (its exit no longer counts)."""
        return False

    def failure_note(self, failed) -> str:
        """Words added to the error of ``failed``, the task that ended the attempt."""
        return ""


class PsWorkerRestarts(JobRestarts):
    """A parameter-server job's policy: a dead worker is restarted alone, or left out.

    In a cluster with a chief and ps tasks the chief's `ClusterCoordinator` reschedules
    a dead worker's steps on the others and takes a restarted worker back, so the job
    goes on. While ``max_restarts`` allow (shared with whole-job restarts), a dead
    worker is restarted alone, at its address. With none left the job carries on with
    the workers that remain, as TF's coordinator does; once every worker is gone the
    attempt fails, naming them all (the coordinator would wait for a worker forever).
    Either way the launcher says so. A worker the chief names in a restart request (a
    frozen one) is SIGKILLed first. The chief and ps tasks stay fatal: a ps the chief
    names in a stop request (a frozen one) is SIGKILLed, and its end fails the attempt,
    with the chief's reason.
    """

    _other_workers = 0  # workers of other nodes, counted as alive (`NodePsWorkers`)

    def __init__(self, max_restarts: int, log):
        super().__init__(max_restarts, log)
        self.used = 0  # worker restarts so far
        self.control_dir: str | None = None  # one per attempt
        self.lost: dict[str, str] = {}  # worker left out in this attempt -> how it ended
        self.last: str | None = None  # the worker whose death left none
        self.stopped: dict[str, str] = {}  # ps killed at the chief's request -> why

    @property
    def spent(self) -> int:
        return self.job_restarts + self.used

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        self.control_dir = tempfile.mkdtemp(prefix="tfdist-control-")
        self.lost, self.last, self.stopped = {}, None, {}
        try:
            yield
        finally:
            shutil.rmtree(self.control_dir, ignore_errors=True)

    def task_env(self, task_restart: int) -> dict[str, str]:
        return {CONTROL_DIR_ENV: self.control_dir, TASK_RESTART_ENV: str(task_restart)}

    def check(self, tasks: list) -> None:
        """SIGKILLs the running workers the chief asked to restart, and the ps tasks it
        asked to stop."""
        for name in os.listdir(self.control_dir):
            request, task = next(((r, t) for r in (env.RESTART_REQUEST, env.STOP_REQUEST)
                                  for t in tasks if f"{r}-{t.name}" == name), (None, None))
            path = os.path.join(self.control_dir, name)
            if task is None or task.poll() is not None:
                continue
            reason = Path(path).read_text(errors="replace").strip()
            if request == env.STOP_REQUEST:
                self.stopped[task.name] = reason
                print(f"tfdist launch: the chief found {task.name} not responding ({reason}); "
                      "killing it, which ends the job", file=self.log, flush=True)
            else:
                print(f"tfdist launch: the chief asked to restart {task.name} ({reason}); "
                      "killing it", file=self.log, flush=True)
            task.signal_group(signal.SIGKILL)
            if request == env.STOP_REQUEST:  # it exits first: the chief waits for this
                _wait_for_exit(task, STOP_WAIT_SECONDS)
            os.unlink(path)

    def replace(self, tasks: list, failed, start: Callable[[TaskSpec, int], object]) -> bool:
        if failed.spec.type != "worker" or not self._chief_runs(tasks) or \
                is_port_clash(failed.tail_text()):  # the job is retried on new ports
            return False
        left = len([t for t in tasks if t.spec.type == "worker" and t is not failed
                    and not self.is_lost(t)]) + self._other_workers
        spent, code = self.spent, failed.poll()
        if spent >= self.max_restarts and not left:
            self.last = failed.name  # every worker is gone: `failure_note` says so
            return False
        failed.signal_group(signal.SIGKILL)  # whatever it started goes too
        failed.finish_output()
        if spent < self.max_restarts:
            self.used += 1
            announce_restart(self.log, spent + 1, self.max_restarts,
                             f"{failed.name} exited with code {code}",
                             f"; restarting {failed.name} alone (parameter-server job)")
            tasks[tasks.index(failed)] = start(failed.spec, self.used)
            return True
        self.lost[failed.name] = exit_cause(failed.name, code)
        print(f"tfdist launch: {self.lost[failed.name]}; the parameter-server job carries "
              f"on with {left} worker{'s' if left > 1 else ''} "
              f"({self._none_left()})\n", end="", file=self.log, flush=True)
        return True

    def _chief_runs(self, tasks: list) -> bool:
        chief = next((t for t in tasks if t.spec.type == "chief"), None)
        return chief is not None and chief.poll() is None

    def is_lost(self, task) -> bool:
        return task.name in self.lost

    def failure_note(self, failed) -> str:
        if failed.name in self.stopped:
            return (f": {failed.name} was not responding ({self.stopped[failed.name]}), so "
                    "the chief had it killed; a ps holds the model's variables and the job "
                    "cannot go on without it (the workers were not at fault)")
        if failed.name != self.last:
            return ""
        earlier = f" ({', '.join(self.lost.values())} earlier)" if self.lost else ""
        return (f": every worker of the parameter-server job is gone{earlier}, with "
                f"{self._none_left()}, so nothing can run the chief's steps (TF's "
                "coordinator would wait for a worker forever)")

    def _none_left(self) -> str:
        if self.max_restarts == 0:
            return "no restarts left: --max-restarts 0"
        return f"no restarts left: {self.spent}/{self.max_restarts} used"


class NodePsWorkers(PsWorkerRestarts):
    """One node's share of a multi-node parameter-server job with no restart left.

    Node 0 counts a multi-node job's restarts, and each restarts the whole job, so no
    worker is restarted alone here. A dead worker is left out while workers remain,
    those of other nodes counted as alive, and this node carries on instead of stopping
    every node; the chief (on node 0) fails when it finds no worker running
    (`tfdist.ParameterServerStrategy`, ``startup_timeout``).

    Args:
        max_restarts: The job's ``max_restarts`` (for the words only).
        log: Where the launcher's messages go.
        restarts_done: The job's restarts so far (node 0's round).
        other_workers: Workers of the cluster that run on other nodes.
    """

    def __init__(self, max_restarts: int, log, *, restarts_done: int, other_workers: int):
        super().__init__(max_restarts, log)
        self.job_restarts = restarts_done
        self._other_workers = other_workers

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        self.lost, self.last = {}, None
        yield

    def task_env(self, task_restart: int) -> dict[str, str]:
        return {}  # no control directory: the chief's frozen workers may be elsewhere

    def check(self, tasks: list) -> None:
        pass

    def _chief_runs(self, tasks: list) -> bool:
        chief = next((t for t in tasks if t.spec.type == "chief"), None)
        return chief is None or chief.poll() is None  # elsewhere: node 0 says when it ends
