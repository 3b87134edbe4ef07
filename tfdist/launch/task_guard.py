"""Kills a launcher's tasks when the launcher dies, however it dies.

Started by `tfdist.launch.process` as ``python -I -S task_guard.py`` (by path, so it imports
nothing of tfdist), in a session of its own. It reads one process-group ID per line
from stdin, a pipe whose write end only the launcher holds. EOF on stdin means the
launcher has ended (a clean exit, or SIGKILL: the kernel closes the pipe either way),
and every group still alive gets SIGKILL. Groups that have emptied are dropped every
second, so an ID the system hands out again later is never signalled.
"""

import os
import select
import signal
import sys


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):  # only EOF ends the watch
        signal.signal(signum, signal.SIG_IGN)
    fd, groups, partial = sys.stdin.fileno(), set(), b""
    while True:
        if select.select([fd], [], [], 1.0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            *lines, partial = (partial + chunk).split(b"\n")
            groups.update(int(line) for line in lines if line.strip())
        groups = {pgid for pgid in groups if _alive(pgid)}
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    main()
