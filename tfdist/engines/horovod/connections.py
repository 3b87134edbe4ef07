"""The sockets one Horovod formation opened, so a member can close them when it leaves.

When a member dies, only the ranks that receive from it see its connection reset; a
rank waiting on a live peer that has already failed waits for Gloo's timeout
(``heartbeat_timeout``), because Horovod's shutdown does not close that peer's Gloo
pairs at once. A member that re-forms therefore shuts its formation's sockets down
first: each peer still waiting on it sees the reset at once and fails over too, so a
kill costs the re-forming instead of Gloo's timeout (docs/elastic.md, Guarantees).

The sockets are found as the socket descriptors that appeared while Horovod formed
(``/proc/self/fd``, Linux); anything else this process has open is left alone.
"""

from __future__ import annotations

import contextlib
import os
import socket

_FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: ``{fd: "socket:[inode]"}``."""
    found = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:  # not Linux: nothing is found, nothing is closed
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(os.path.join(_FD_DIR, name))
            if target.startswith("socket:["):
                found[int(name)] = target
    return found


class Formation:
    """The sockets opened between `opening` and `opened` (one Horovod formation)."""

    def __init__(self):
        self._before: dict[int, str] = {}
        self.sockets: dict[int, str] = {}

    def opening(self) -> None:
        """Notes the sockets open before Horovod forms."""
        self._before = _sockets()

    def opened(self) -> None:
        """Keeps the sockets that appeared since `opening` (Gloo's pairs and device)."""
        self.sockets = {fd: inode for fd, inode in _sockets().items()
                        if self._before.get(fd) != inode}

    def close(self) -> int:
        """Shuts down (both ways) each kept socket still open; returns how many.

        The descriptors stay Horovod's: its own shutdown closes them."""
        closed = 0
        for fd, inode in self.sockets.items():
            with contextlib.suppress(OSError):
                if os.readlink(os.path.join(_FD_DIR, str(fd))) != inode:
                    continue  # closed since, and the number reused
                with socket.socket(fileno=os.dup(fd)) as duplicate:
                    duplicate.shutdown(socket.SHUT_RDWR)
                closed += 1
        self.sockets = {}
        return closed
