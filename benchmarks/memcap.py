"""Per-task memory caps: one cgroup v1 memory group per task of a launched job (root).

    caps = MemoryCaps(limit_bytes=1 << 30)
    try:
        run_tasks(fn, workers=4, wrap=caps.wrap)  # each task joins its own group
        caps.peak("worker-0"), caps.oom_killed("worker-0")
    finally:
        caps.remove()

Each group sits below this process's own memory group, is named after this process and
the task, and is removed by `MemoryCaps.remove` once its processes have ended. A task
joins its group before it executes Python (``sh -c 'echo $$ > cgroup.procs; exec ...'``),
so everything it allocates counts: ``memory.max_usage_in_bytes`` is its peak.
"""

from __future__ import annotations

import os
import select
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")


def own_memory_cgroup() -> Path:
    """This process's cgroup v1 memory group directory."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1_ROOT / path.lstrip("/")
    raise RuntimeError("no cgroup v1 memory controller: per-task memory caps need one")


def cannot_cap() -> str | None:
    """Why this machine cannot cap tasks' memory, or None."""
    if os.geteuid() != 0:
        return "memory caps create cgroups: run as root"
    try:
        own_memory_cgroup()
    except RuntimeError as error:
        return str(error)
    return None


class MemoryCaps:
    """One memory group per task, each limited to ``limit_bytes`` (see the module).

    Args:
        limit_bytes: Each task's memory limit (``memory.limit_in_bytes``).
        tag: Part of the groups' names.
    """

    def __init__(self, limit_bytes: int, tag: str = "tfdist-cap"):
        self.limit_bytes = int(limit_bytes)
        self._parent = own_memory_cgroup()
        self._prefix = f"{tag}-{os.getpid()}-"
        self._groups: dict[str, Path] = {}

    def group(self, task: str) -> Path:
        """``task``'s group directory, made (and limited) on first use."""
        if task not in self._groups:
            path = self._parent / f"{self._prefix}{task}"
            path.mkdir(exist_ok=True)
            (path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            self._groups[task] = path
        return self._groups[task]

    def wrap(self, spec) -> list[str]:
        """The argv prefix that puts the task of ``spec`` (a `TaskSpec`) in its group
        (``tfdist.launch.run``'s ``wrap``)."""
        procs = self.group(spec.name) / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "memcap"]

    def peak(self, task: str) -> int:
        """The task's peak memory so far (bytes; ``memory.max_usage_in_bytes``)."""
        return int((self.group(task) / "memory.max_usage_in_bytes").read_text())

    def oom_killed(self, task: str) -> bool:
        """Whether the kernel's OOM killer killed a process of the task's group."""
        text = (self.group(task) / "memory.oom_control").read_text()
        counts = dict(line.split() for line in text.splitlines() if line.strip())
        if "oom_kill" in counts:
            return int(counts["oom_kill"]) > 0
        return int((self.group(task) / "memory.failcnt").read_text()) > 0

    def remove(self, timeout: float = 30.0) -> None:
        """Waits for each group's processes to end, then removes the groups."""
        for path in self._groups.values():
            if not path.exists():
                continue
            for pid in map(int, (path / "cgroup.procs").read_text().split()):
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                try:
                    select.select([fd], [], [], timeout)
                finally:
                    os.close(fd)
            path.rmdir()
        self._groups.clear()
