"""The launcher's policy for an elastic job (``--min-workers``): lose a worker, carry on.

The launcher hosts the job's membership service and Gloo's rendezvous
(`tfdist.engines.horovod.membership`), so they outlive any worker. A worker that exits
non-zero (or is killed) is removed from the membership and the others re-form Horovod
without it, inside ``fit`` (`tfdist.strategies.elastic.fit`); while ``max_restarts``
allow, a replacement starts and joins the running job. Below ``min_workers`` for
longer than ``elastic_timeout`` seconds the job fails, naming who is missing.

A worker is added to the running job, up to ``max_workers``, by ``kill -USR1`` to the
launcher's PID (printed when the job starts), or by `ElasticRestarts.add_worker`: the
new worker joins like a replacement, under the next free name (``worker-N``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from typing import Callable, Iterator

from tfdist import env
from tfdist.cluster import TRAINING_TASK_TYPES, TaskSpec
from tfdist.launch.network import find_free_ports
from tfdist.launch.restarts import JobRestarts
from tfdist.launch.results import LaunchError, announce_restart, exit_cause
from tfdist.wire import new_token



# Seconds after the first member reported a lost peer by which every live member has
# reported too (they all wait on the same collective): the silent ones are frozen.
REPORT_GRACE = 10.0
# Seconds a lost worker's removal waits at most for every running member to report the
# loss (each does at once when its Horovod fails): a member dying at the same moment
# exits meanwhile, and every worker lost at once leaves in one membership.
LOSS_SETTLE = 0.5


class ElasticRestarts(JobRestarts):
    """Restart policy of an elastic job on one host (see the module's words).

    Args:
        max_restarts: Replacement workers allowed over the whole job.
        log: Where the launcher's messages go.
        host: The address the membership service listens on (the tasks' host).
        min_workers: The fewest workers the job trains with.
        max_workers: The most workers the job may have.
        elastic_timeout: Seconds the job may stay below ``min_workers``.
        port: The membership service's port (0: any free one).
        token: The job's token, which signs what changes the membership (default:
            ``TFDIST_TOKEN``, else a new one); every task gets it in ``TFDIST_TOKEN``.
    """

    def __init__(self, max_restarts: int, log, *, host: str, min_workers: int,
                 max_workers: int, elastic_timeout: float, port: int = 0,
                 token: str | None = None):
        super().__init__(max_restarts, log)
        self.token = token or os.environ.get(env.TOKEN) or new_token()
        self.host = host
        self.port = port
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.elastic_timeout = elastic_timeout
        self.used = 0  # replacements so far
        self.server = None
        self.lost: set[int] = set()  # ids of the TaskProcess objects left out
        self.removed: list[str] = []  # how each lost worker ended, in order
        self.below_since: float | None = None
        self.first_report: tuple[int, float] | None = None  # (version, when)
        self.requested = 0  # workers asked for (SIGUSR1, add_worker) and not yet added
        self.grown = None  # the cluster with the added workers' addresses
        self._deferred = None  # while `replace` removes several: the memberships made
        self._dying: set[str] = set()  # workers found dead and not removed yet
        self.stateless: str | None = None  # "backup" / "none": no member held the state
        # Workers added (`grow`) and not yet ready to form Horovod: {name: (host, the
        # version published when it started)}; `check` publishes each once it is.
        self.joining: dict[str, tuple[str, int]] = {}

    def add_worker(self) -> None:
        """Asks for one more worker; the launcher adds it at its next poll (up to
        ``max_workers``). Safe from a signal handler or another thread."""
        self.requested += 1

    @property
    def spent(self) -> int:
        return self.job_restarts + self.used

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        from tfdist.engines.horovod.membership import MembershipServer

        self.server = MembershipServer(self.host, self.min_workers, self.max_workers,
                                       self.port, token=self.token, log=self.log,
                                       signed=self.signed_scopes())
        self.lost, self.below_since, self.grown = set(), None, None
        self.stateless = None
        self.joining = {}
        self.members: list[tuple[str, str]] = []  # oldest first; published once >= min
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGUSR1, lambda *_: self.add_worker())
            print(f"tfdist launch: elastic job: `kill -USR1 {os.getpid()}` adds a worker "
                  f"(up to --max-workers {self.max_workers})", file=self.log, flush=True)
        try:
            yield
        finally:
            if previous is not None:
                signal.signal(signal.SIGUSR1, previous)
            self.server.close()

    def signed_scopes(self) -> dict:
        """The membership service's signed scopes besides lost reports (none here)."""
        return {}

    def grow(self, tasks: list, cluster, start) -> None:
        """Starts the workers asked for (`add_worker`); each joins the running job."""
        while self.requested > 0:
            self.requested -= 1
            if len(self.members) + len(self.joining) >= self.max_workers:
                print(f"tfdist launch: a worker was asked for, but the elastic job already "
                      f"has --max-workers {self.max_workers} "
                      f"({len(self.members) + len(self.joining)}): none added",
                      file=self.log, flush=True)
                continue
            base = self.grown or cluster
            (port,) = find_free_ports(1, self.host)
            self.grown = dataclasses.replace(
                base, worker=base.worker + (f"{self.host}:{port}",))
            spec = TaskSpec("worker", len(base.worker))
            tasks.append(start(spec, 0, self.grown))
            self._await_ready(spec.name, self.host)
            print(f"tfdist launch: adding {spec.name}, which joins the running elastic job "
                  f"({len(self.members) + len(self.joining)} workers)", file=self.log,
                  flush=True)

    def _await_ready(self, name: str, host: str) -> None:
        """Lists ``name`` (just started on ``host``) once it reports ready."""
        self.server.forget_ready(name)  # an earlier task of that name said so
        self.joining[name] = (host, self.server.version)

    def take_in_joiners(self) -> None:
        """Publishes each added worker that is ready to form Horovod (it reported so:
        `membership.report_ready`). Published any earlier, the members would re-form at
        once and wait in Gloo's rendezvous, up to Gloo's timeout, for a joiner still
        importing TensorFlow."""
        if not self.joining or self._deferred is not None:
            return
        ready = [name for name, (_, since) in self.joining.items()
                 if name in self.server.ready(since)]
        if ready:
            self._publish(self.members + [(name, self.joining.pop(name)[0])
                                          for name in ready])
            print(f"tfdist launch: {', '.join(ready)} ready: membership "
                  f"{self.server.version} takes {'it' if len(ready) == 1 else 'them'} in "
                  f"({len(self.members)} workers)", file=self.log, flush=True)

    def _publish(self, members: list[tuple[str, str]]) -> None:
        """Makes ``members`` the job's; publishes them if they are at least
        ``min_workers`` (below, the survivors wait for a joiner)."""
        self.members = members
        if self._deferred is not None:
            self._deferred.append(members)  # `replace` publishes the last one
            return
        if len(members) >= self.min_workers:
            self.below_since = None
            self.server.publish(members)

    def task_env(self, task_restart: int) -> dict[str, str]:
        return {env.ELASTIC_ADDR: self.server.address, env.ENGINE: "horovod",
                env.TOKEN: self.token, "HOROVOD_ELASTIC_TIMEOUT": f"{self.elastic_timeout:g}",
                env.TASK_RESTART: str(task_restart)}

    def check(self, tasks: list) -> None:
        """Publishes the first membership; kills frozen members; fails the job once it
        stayed too small."""
        if self.server.version == 0:
            self.members = [(t.name, self.host) for t in tasks
                            if t.spec.type in TRAINING_TASK_TYPES]
            self.server.publish(self.members)
        self.take_in_joiners()
        self._kill_frozen(tasks)
        self._check_size()

    def _check_size(self) -> None:
        """Fails the job once it stayed below ``min_workers`` for ``elastic_timeout``."""
        if self.below_since is not None and \
                time.monotonic() - self.below_since > self.elastic_timeout:
            members = [name for name, _ in self.members]
            raise LaunchError(
                f"the elastic job stayed below --min-workers {self.min_workers} for more "
                f"than --elastic-timeout {self.elastic_timeout:g}s: {len(members)} "
                f"worker(s) left ({', '.join(members) or 'none'}); missing: "
                f"{'; '.join(self.removed)}", attempts=self.job_restarts + 1)

    def _kill_frozen(self, tasks: list) -> None:
        """SIGKILLs the members that stayed silent while the others reported a lost peer.

        A frozen (e.g. SIGSTOPped) worker neither exits nor answers: its peers' Horovod
        fails after Gloo's timeout and each reports it (`membership.report_lost`). Members
        that did not report within `REPORT_GRACE` seconds of the first report are killed;
        their exit then removes them like any other lost worker.
        """
        reported = self.server.reports()
        if not reported:
            return
        version = self.server.version
        if self.first_report is None or self.first_report[0] != version:
            self.first_report = (version, time.monotonic())
        if time.monotonic() - self.first_report[1] < REPORT_GRACE:
            return
        for name, _ in self.server.members:
            if name not in reported and self._kill_member(name, tasks):
                print(f"tfdist launch: {name} stopped answering Horovod: "
                      f"{', '.join(sorted(reported))} reported a lost peer in membership "
                      f"{version} and {name} did not within {REPORT_GRACE:g}s; it is "
                      "frozen (e.g. SIGSTOP) or hung: killing it", file=self.log, flush=True)
        self.first_report = (version, float("inf"))  # once per membership

    def _kill_member(self, name: str, tasks: list) -> bool:
        """SIGKILLs member ``name`` if it still runs here; whether it did."""
        for task in tasks:
            if task.name == name and task.poll() is None:
                task.signal_group(signal.SIGKILL)
                return True
        return False

    def replace(self, tasks: list, failed, start: Callable[[TaskSpec, int], object]) -> bool:
        """Removes ``failed`` and every other worker that failed by now, in one
        membership (a membership that lists a dead worker would hold the survivors in
        Gloo's rendezvous until it aborts them)."""
        if failed.spec.type not in TRAINING_TASK_TYPES:
            return False
        dead = self._settle(tasks)
        for task in dead:
            task.finish_output()
        if self._no_state_left(dead):
            return False  # the attempt ends: `failure_note` and `restart_job` say how
        self._deferred, self._dying = [], {t.name for t in dead}
        try:
            for task in dead:
                self._dying.discard(task.name)  # its replacement takes its name
                outcome = self.lose(task.name, self.host, exit_cause(task.name, task.poll()))
                if outcome is None:
                    return False  # nobody is left to carry on: the job fails on ``failed``
                if outcome:
                    tasks[tasks.index(task)] = start(task.spec, self.used, self.grown)
                else:
                    self.lost.add(id(task))
        finally:
            deferred, self._deferred, self._dying = self._deferred, None, set()
            if deferred:
                self._publish(deferred[-1])
        return True

    def _no_state_left(self, dead: list) -> bool:
        """Whether a worker of ``dead`` failed because every member holding the
        training state was lost (its replacements have nothing to take: `stateless`)."""
        from tfdist.engines.horovod.membership import HAS_BACKUP_WORDS, NO_STATE_WORDS

        for task in dead:
            tail = task.tail_text()
            if NO_STATE_WORDS in tail:
                self.stateless = "backup" if HAS_BACKUP_WORDS in tail else "none"
                return True
        return False

    def restart_job(self) -> int | None:
        """A whole-job restart, only from a backup once every member holding the
        training state was lost: without one it would train from scratch."""
        if self.stateless == "none":
            return None
        return super().restart_job()

    def failure_note(self, failed) -> str:
        if self.stateless is None:
            return ""
        if self.stateless == "none":
            then = ("; there is no backup to resume from, so the job fails rather than "
                    "train from scratch")
        elif self.spent < self.max_restarts:  # `restart_job` counts one
            then = "; the job starts again from fit's backup"
        else:
            then = (f"; fit has a backup{_backup_dir(failed.tail_text())}, but no restart "
                    f"is left ({self.spent}/{self.max_restarts} used): the job fails and "
                    "does not start again; run the same command again to resume from the "
                    "backup")
        return (f": every member holding the elastic job's training state was lost "
                f"({'; '.join(self.removed)}), and its replacements had no member to take "
                f"it from{then}")

    def _dead(self, tasks: list) -> list:
        """The workers that exited non-zero and are not removed yet, first failed first."""
        return sorted((t for t in tasks if t.spec.type in TRAINING_TASK_TYPES and
                       not self.is_lost(t) and t.poll() not in (None, 0)),
                      key=lambda t: t.exited_at)

    def _settle(self, tasks: list) -> list:
        """`_dead`, once every running member reported the loss (`LOSS_SETTLE` at most)."""
        deadline = time.monotonic() + LOSS_SETTLE
        while True:
            dead = self._dead(tasks)
            members = {name for name, _ in self.server.members}
            running = {t.name for t in tasks if t.poll() is None and t.name in members}
            if running <= self.server.reports() or time.monotonic() > deadline:
                return dead
            time.sleep(0.01)

    def lose(self, name: str, host: str, cause: str, *, replaceable: bool = True
             ) -> bool | None:
        """Removes member ``name`` (``cause``: how it ended) and publishes the rest.

        Returns:
            True when a replacement is due (one of ``max_restarts`` is counted; it joins
            as the youngest member), False when the job carries on (or waits) without
            it, None when nobody is left and no restart either: the job fails.
        """
        self.removed.append(cause)
        was_joining = self.joining.pop(name, None) is not None
        members = [(n, h) for n, h in self.members if n != name and n not in self._dying]
        if not members and (self.spent >= self.max_restarts or not replaceable):
            return None
        if was_joining:  # never listed: the members train on as they are
            if replaceable and self.spent < self.max_restarts:
                self.used += 1
                announce_restart(self.log, self.spent, self.max_restarts, cause,
                                 f"; starting a replacement for {name}, which joins the "
                                 "running elastic job")
                self._await_ready(name, host)
                return True
            print(f"tfdist launch: {cause} before it joined; the elastic job carries on "
                  f"with {len(members)} worker(s)", file=self.log, flush=True)
            return False
        if replaceable and self.spent < self.max_restarts:
            self.used += 1
            announce_restart(self.log, self.spent, self.max_restarts, cause,
                             f"; starting a replacement for {name}, which " + (
                                 "joins the running elastic job" if self.server.formed
                                 else "starts the job with the others (none has formed "
                                      "Horovod yet)"))
            # One membership without the lost worker and with its replacement (the
            # youngest member): two versions in a row could split the survivors.
            self._publish(members + [(name, host)])
            return True
        self._carry_on(members, cause, None if replaceable else "it is not replaced")
        return False

    def _carry_on(self, members: list[tuple[str, str]], cause: str,
                  none_left: str | None = None) -> None:
        """Publishes ``members`` (the job without what ``cause`` says) and says so
        (``none_left``: why no replacement starts)."""
        self._publish(members)
        left = ", ".join(name for name, _ in members)
        none_left = none_left or f"no restarts left ({self.spent}/{self.max_restarts} used)"
        if len(members) >= self.min_workers:
            print(f"tfdist launch: {cause}; the elastic job carries on with {len(members)} "
                  f"worker(s) ({left}): {none_left}", file=self.log, flush=True)
        else:
            self.below_since = self.below_since or time.monotonic()
            print(f"tfdist launch: {cause}; {len(members)} worker(s) left ({left}), below "
                  f"--min-workers {self.min_workers}, and {none_left}: the job waits up to "
                  f"--elastic-timeout {self.elastic_timeout:g}s for workers to join",
                  file=self.log, flush=True)

    def is_lost(self, task) -> bool:
        return id(task) in self.lost


def _backup_dir(tail: str) -> str:
    """`` in DIR`` of the backup a worker's `NO_STATE_WORDS` line names, or ``""``."""
    from tfdist.engines.horovod.membership import HAS_BACKUP_WORDS

    found = re.search(re.escape(HAS_BACKUP_WORDS) + r" (.+?): the launcher", tail)
    return f" in {found.group(1)}" if found else ""
