"""Watching the peers of a data x model mesh while ``fit`` runs, so a frozen one is named.

On a mesh Horovod runs collectives within process sets. When a peer freezes, Gloo's
timeout fails one of them, and Horovod's shutdown then negotiates with every rank,
the frozen one too: Gloo throws again, outside any handler, and the process aborts
(SIGABRT) before a Python error can name the peer (`HorovodEngine.peer_error` does
that with one model group). So on a mesh each task probes its peers' liveness servers
(`tfdist.engines.horovod.rendezvous.peer_addresses`) every few seconds during ``fit``,
and says once, on stderr, which one stopped answering, well before Gloo's timeout:
``tfdist: worker-0: worker-1 is not responding: ...``. The launcher quotes that line
when the task ends (`tfdist.launch.results.failure_cause`).
"""

from __future__ import annotations

import sys
import threading

from tfdist.comm import liveness
from tfdist.engines import peers as peer_probes


class PeerWatch:
    """A thread that probes the peers every ``interval`` seconds, from `start` to `stop`.

    A peer is named once it stays silent (or unreachable) through two probes in a row,
    each given ``probe_timeout`` seconds; a refused probe (a peer that exited) is left
    to the launcher, which sees that task end.

    Args:
        task_name: This task, e.g. ``"worker-0"``.
        addresses: ``{task name: "host:port"}`` of the peers' liveness servers.
        timeout_text: Gloo's timeout as set, e.g. ``"heartbeat_timeout=10s"``.
        seconds: That timeout in seconds; the probes run every fifth of it (at most
            2 s), each waiting a quarter of it (at most `peer_probes.PROBE_TIMEOUT`), so
            a frozen peer is named within about 7/10 of it.
        stream: Where the line goes (default: stderr).
    """

    def __init__(self, task_name: str, addresses: dict[str, str], timeout_text: str,
                 seconds: float, stream=None):
        self.task_name, self.addresses, self.timeout_text = task_name, dict(addresses), \
            timeout_text
        self.interval = min(seconds / 5, 2.0)
        self.probe_timeout = min(seconds / 4, peer_probes.PROBE_TIMEOUT)
        self.stream = stream
        self.named: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeerWatch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Starts probing (a daemon thread)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tfdist-peer-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops probing (the thread ends after its current probe)."""
        self._stop.set()

    def check(self) -> list[str]:
        """Probes every peer not named yet; probes the silent ones again; names those
        silent twice (one line each). Returns the peers named now."""
        waiting = {n: a for n, a in self.addresses.items() if n not in self.named}
        if not waiting:
            return []
        silent = self._silent(waiting)
        if silent:
            silent = self._silent({n: waiting[n] for n in silent})
        for name, detail in silent.items():
            self.named.add(name)
            print(f"tfdist: {self.task_name}: {name} is not responding: two liveness "
                  f"probes in a row at {self.addresses[name]} failed ({detail}): it is "
                  "frozen (e.g. SIGSTOP), overloaded or unreachable; Gloo's timeout "
                  f"({self.timeout_text}) ends the job unless it answers again",
                  file=self.stream or sys.stderr, flush=True)
        return sorted(silent)

    def _silent(self, addresses: dict[str, str]) -> dict[str, str]:
        found = peer_probes.probe_all(addresses, self.probe_timeout)
        return {name: detail for state in (liveness.SILENT, liveness.UNREACHABLE)
                for name, detail in found[state]}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()
