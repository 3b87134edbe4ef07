"""Restart policies: what a failed task costs, given to the launcher by its caller.

`JobRestarts` stops every task and starts the whole job again, while ``max_restarts``
allow. `PsWorkerRestarts` also restarts a dead parameter-server worker alone, at its
address, while the chief runs. The launcher calls a policy's hooks; it does not know
which strategy the tasks run: `tfdist.launch` and ``tfdist train`` choose the policy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from tfdist import env
from tfdist.cluster import TaskSpec
from tfdist.launch.results import announce_restart

# A parameter-server chief asks the launcher to restart a worker by creating the file
# ``<TFDIST_CONTROL_DIR>/restart-<task>`` (its text: why). See `PsWorkerRestarts`.
CONTROL_DIR_ENV = env.CONTROL_DIR
TASK_RESTART_ENV = env.TASK_RESTART


class JobRestarts:
    """Restarts of the whole job: a failed task ends the attempt, then the job starts again.

    Subclasses restart single tasks through the per-attempt hooks (`attempt`,
    `task_env`, `check`, `replace`), which do nothing here.

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

    def replace(self, tasks: list, failed, start: Callable[[TaskSpec, int], object]) -> bool:
        """Restarts ``failed`` alone in ``tasks`` with ``start(spec, n)``; False if not."""
        return False


class PsWorkerRestarts(JobRestarts):
    """Restarts a dead parameter-server worker alone, at its address, while the chief runs.

    In a cluster with a chief and ps tasks the chief's `ClusterCoordinator` reschedules
    a dead worker's steps and takes a restarted worker back, so the job goes on. Each
    restart uses one of ``max_restarts`` (shared with whole-job restarts); when none
    is left, the worker's death fails the job as before. A worker the chief names in a
    restart request (a frozen one) is SIGKILLed first.
    """

    def __init__(self, max_restarts: int, log):
        super().__init__(max_restarts, log)
        self.used = 0  # worker restarts so far
        self.control_dir: str | None = None  # one per attempt

    @property
    def spent(self) -> int:
        return self.job_restarts + self.used

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        self.control_dir = tempfile.mkdtemp(prefix="tfdist-control-")
        try:
            yield
        finally:
            shutil.rmtree(self.control_dir, ignore_errors=True)

    def task_env(self, task_restart: int) -> dict[str, str]:
        return {CONTROL_DIR_ENV: self.control_dir, TASK_RESTART_ENV: str(task_restart)}

    def check(self, tasks: list) -> None:
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

    def replace(self, tasks: list, failed, start: Callable[[TaskSpec, int], object]) -> bool:
        chief = next((t for t in tasks if t.spec.type == "chief"), None)
        spent = self.spent
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
