"""Whether the kernel's OOM killer ended a task, from its memory cgroup's counters.

When a task starts, `watch` notes its memory cgroup (``/proc/PID/cgroup``) and that
cgroup's count of OOM kills: cgroup v1 ``memory.oom_control`` (its ``oom_kill`` line;
``memory.failcnt`` on kernels without it), v2 ``memory.events`` (``oom_kill``). When the
task ends by SIGKILL and the count went up, `oom_cause` words it "out of memory", with
the memory limit that applies (``memory.limit_in_bytes`` / ``memory.max``, the lowest of
the cgroup and its parents). Without cgroups (or readable counters) it says nothing.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path, PurePosixPath

_UNLIMITED = 1 << 62  # v1 writes "no limit" as 2**63 rounded down to a page


@dataclasses.dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup: its path as ``/proc/PID/cgroup`` names it, where its files are."""

    path: str
    directory: Path
    mount: Path  # the hierarchy's mount point: the limit is looked for up to here
    version: int


def _mounts(mountinfo: Path) -> dict[int, tuple[str, Path]]:
    """{1: (root, mount point) of the v1 memory hierarchy, 2: ... of cgroup2}."""
    mounts: dict[int, tuple[str, Path]] = {}
    for line in mountinfo.read_text().splitlines():
        head, dash, tail = line.partition(" - ")
        if not dash or len(head.split()) < 5 or not tail.split():
            continue
        fields, fstype, options = head.split(), tail.split()[0], tail.split()[-1]
        if fstype == "cgroup" and "memory" in options.split(","):
            mounts.setdefault(1, (fields[3], Path(fields[4])))
        elif fstype == "cgroup2":
            mounts.setdefault(2, (fields[3], Path(fields[4])))
    return mounts


def find_cgroup(pid: int, proc: Path = Path("/proc")) -> MemoryCgroup | None:
    """The memory cgroup of process ``pid`` (v1 memory controller first, then v2), or
    None when there is none with readable counters."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
        mounts = _mounts(proc / "self" / "mountinfo")
    except OSError:
        return None
    for version in (1, 2):
        for line in lines:
            ident, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            if (version == 1 and "memory" not in controllers.split(",")) or \
                    (version == 2 and (ident != "0" or controllers)):
                continue
            if version not in mounts:
                continue
            root, mount = mounts[version]
            # Without a cgroup namespace, a bind-mounted hierarchy starts at ``root``.
            relative = path[len(root):] if root != "/" and path.startswith(root) else path
            directory = mount / relative.lstrip("/")
            group = MemoryCgroup(path, directory, mount, version)
            if oom_kills(group) is not None:
                return group
    return None


def _counter(text: str, key: str) -> int | None:
    """The value of ``key`` in ``key value`` lines."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def oom_kills(group: MemoryCgroup) -> int | None:
    """How many processes of ``group`` the OOM killer killed so far (v1 without an
    ``oom_kill`` line: how often the limit was hit), or None if it cannot be read."""
    try:
        if group.version == 2:
            return _counter((group.directory / "memory.events").read_text(), "oom_kill")
        kills = _counter((group.directory / "memory.oom_control").read_text(), "oom_kill")
        if kills is None:
            kills = int((group.directory / "memory.failcnt").read_text())
        return kills
    except (OSError, ValueError):
        return None


def memory_limit(group: MemoryCgroup) -> tuple[int, Path] | None:
    """The lowest memory limit of ``group`` and its parents (bytes), and the directory
    that sets it, or None when none has one."""
    name = "memory.max" if group.version == 2 else "memory.limit_in_bytes"
    lowest, directory = None, group.directory
    while True:
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) < _UNLIMITED and \
                (lowest is None or int(text) < lowest[0]):
            lowest = (int(text), directory)
        if directory == group.mount or directory == directory.parent:
            return lowest
        directory = directory.parent


def describe(name: str, group: MemoryCgroup) -> str:
    """``out of memory: worker-0 was killed by the kernel's OOM killer (memory limit
    190 MiB of cgroup /jobs/a)``."""
    limit = memory_limit(group)
    if limit is None:
        where = f"cgroup {group.path} has no memory limit: the host ran out"
    else:
        up = len(group.directory.relative_to(limit[1]).parts)  # the limit is a parent's
        shown = group.path if up == 0 else str(PurePosixPath(group.path).parents[up - 1])
        where = f"memory limit {limit[0] / 2**20:.0f} MiB of cgroup {shown}"
    return f"out of memory: {name} was killed by the kernel's OOM killer ({where})"


_lock = threading.Lock()
_watched: dict[str, tuple[MemoryCgroup, int]] = {}


def watch(name: str, pid: int) -> None:
    """Notes task ``name``'s memory cgroup and its OOM kills so far (at its start)."""
    group = find_cgroup(pid)
    kills = None if group is None else oom_kills(group)
    with _lock:
        if kills is None:
            _watched.pop(name, None)
        else:
            _watched[name] = (group, kills)


def oom_cause(name: str, code: int | None) -> str | None:
    """`describe` if task ``name`` ended by SIGKILL and its cgroup's OOM kills went up
    since `watch`, else None."""
    if code != -signal.SIGKILL:
        return None
    with _lock:
        group, kills = _watched.get(name, (None, None))
    if group is None:
        return None
    now = oom_kills(group)
    return describe(name, group) if now is not None and now > kills else None
