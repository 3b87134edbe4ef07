"""``kill -USR1`` to a launcher that does not add workers: ignored, and said so.

Only node 0's launcher of an elastic job (``--min-workers``) adds a worker on SIGUSR1
(`tfdist.launch.elastic.ElasticRestarts`). Python's default for SIGUSR1 ends the
process, so any other launcher (a non-elastic job, or another node of an elastic one)
would die at once and leave its tasks behind. `IgnoredUsr1` takes the signal instead;
the launcher's poll says so in one line.
"""

from __future__ import annotations

import signal
import threading


class IgnoredUsr1:
    """Ignores SIGUSR1 while in use (main thread only); `say` reports one that came.

    Args:
        log: Where the launcher's messages go.
    """

    def __init__(self, log):
        self.log, self.received, self._said, self._previous = log, 0, 0, None

    def __enter__(self) -> "IgnoredUsr1":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGUSR1, self._note)
        return self

    def _note(self, *_) -> None:
        self.received += 1  # printed by `say`, outside the handler

    def say(self) -> None:
        """Says (once per signal received) that SIGUSR1 was ignored."""
        if self.received > self._said:
            self._said = self.received
            print("tfdist launch: SIGUSR1 ignored: only node 0's launcher of an elastic job "
                  "(--min-workers) adds a worker on it", file=self.log, flush=True)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)
            self._previous = None
