"""A worker's side of an elastic job: form Horovod from the launcher's membership, and
form it again when a member leaves or joins (`tfdist.engines.horovod.membership`).

As Horovod Elastic does, re-forming is ``hvd.shutdown()`` then ``hvd.init()`` with the
new rank and size, in the same process: with this engine every process's TensorFlow is
local, so nothing else restarts.
"""

from __future__ import annotations

import os

from tfdist.engines.horovod import membership, ops
from tfdist.engines.horovod.connections import Formation

# In Horovod's errors when a member died or froze (the op names as Horovod's elastic
# wrapper matches them, and the words of its background loop's shutdown).
_LOST_PEER_WORDS = ("Horovod has been shut down", "HorovodAllreduce", "HorovodBroadcast",
                    "HorovodAllgather", "Gloo", "gloo")


def is_lost_peer(error) -> bool:
    """Whether ``error`` (a TF ``OpError``) is Horovod's failure when a member is lost."""
    message = getattr(error, "message", None) or str(error)
    return any(words in message for words in _LOST_PEER_WORDS)


class ElasticMember:
    """This task's membership in an elastic job (the Horovod engine's ``membership()``).

    Besides forming Horovod, it is what elastic ``fit`` (`tfdist.strategies.elastic.fit`)
    calls to move state between members: `broadcast`, `allgather`, `rank`.

    Args:
        name: This task's name (e.g. ``worker-1``), as the launcher lists it.
        address: The membership service's ``HOST:PORT``.
        interface: The network interface Gloo binds to.
        timeout: Seconds to wait for a membership that lists this task (the launcher's
            ``--elastic-timeout``).
        gloo_timeout: Gloo's timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``): how long a
            member waits for a frozen or dead peer before Horovod fails.
    """

    HAS_BACKUP_WORDS = membership.HAS_BACKUP_WORDS
    NO_STATE_WORDS = membership.NO_STATE_WORDS

    def __init__(self, name: str, address: str, interface: str, timeout: float,
                 gloo_timeout: float):
        self.name = name
        self.address = address
        self.interface = interface
        self.timeout = timeout
        self.gloo_timeout = gloo_timeout
        self.state: dict = {"version": 0, "members": []}
        self.reforms = 0  # times Horovod was formed again
        # Formed first with a membership published after the job had formed (the
        # service's ``formed``): the members hold a state that this task takes in ``fit``.
        self.joined_running = False
        self.synced = False  # holds the job's training state (a joiner: once fit synced)
        # Has trained a step with the members (or started with them); False again while
        # a joiner that has not trained is a member: on-read variables stay local.
        self.training = False
        self.latest = 0  # the newest version seen by the watcher thread
        self.formation = Formation()  # the sockets of the current Horovod formation

    @property
    def version(self) -> int:
        return self.state["version"]

    @property
    def members(self) -> list[str]:
        """The member tasks' names, in rank order."""
        return [m["name"] for m in sorted(self.state["members"], key=lambda m: m["rank"])]

    @property
    def bounds(self) -> tuple[int, int]:
        """``(min_workers, max_workers)`` of the job."""
        return self.state.get("min_workers", 1), self.state.get("max_workers", 1)

    def form(self) -> None:
        """Starts Horovod as a member of the next membership that lists this task."""
        if self.version == 0:
            membership.report_ready(self.address, self.name)
        state = membership.wait_for_membership(self.address, self.name, self.version,
                                               self.timeout)
        os.environ.update(membership.slot_env(state, self.name, self.address))
        os.environ["HOROVOD_GLOO_IFACE"] = self.interface
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(max(self.gloo_timeout, 1)))
        first = self.version == 0
        self.state = state
        _say(f"{self.name}: {'joins' if first else 're-forms'} Horovod: membership "
             f"{state['version']}, rank {ops_rank(state, self.name)} of "
             f"{len(state['members'])} ({', '.join(self.members)})")
        self.latest = max(self.latest, state["version"])
        if first:  # a worker lost before any formation leaves starters, not joiners
            self.joined_running = bool(state.get("formed"))
            self.synced = self.training = not self.joined_running
            if self.joined_running:  # the members re-form at their next commit
                os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(max(self.timeout, 1)))
        self.formation.opening()
        (ops.init if first else ops.reinit)()
        self.formation.opened()
        if not state.get("formed"):  # this formation is the job's first
            membership.report_formed(self.address, self.name, state["version"])
        if first:
            ops.reset_op_names()
            os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(max(self.gloo_timeout, 1)))
            self._watch()

    def reform(self) -> None:
        """Shuts Horovod down and forms it again with the next membership."""
        membership.report_lost(self.address, self.name, self.version)
        self.formation.close()  # peers still waiting on this member fail over at once
        ops.shutdown()
        self.reforms += 1
        self.form()

    @staticmethod
    def is_lost_peer(error) -> bool:
        """Whether ``error`` is Horovod's failure when a member is lost."""
        return is_lost_peer(error)

    @staticmethod
    def say(text: str) -> None:
        """One line on stderr (the launcher prefixes it with the task's name)."""
        _say(text)

    @staticmethod
    def rank() -> int:
        """This member's rank in the current formation."""
        return ops.rank()

    @staticmethod
    def broadcast(value, root_rank: int):
        """``value`` as the member of rank ``root_rank`` holds it."""
        return ops.broadcast(value, root_rank=root_rank)

    @staticmethod
    def allgather(value):
        """Every member's ``value``, concatenated along the first axis in rank order."""
        return ops.allgather(value)

    def changed(self) -> bool:
        """Whether the launcher published a membership newer than this one (a joiner)."""
        return self.latest > self.version

    def _watch(self, every: float = 0.25) -> None:
        """Reads the newest version every ``every`` seconds, in a daemon thread."""
        import threading
        import time

        def watch():
            while True:
                try:
                    self.latest = max(self.latest,
                                      membership.fetch_state(self.address, timeout=2)["version"])
                except (OSError, ValueError):
                    pass
                time.sleep(every)

        threading.Thread(target=watch, name="tfdist-elastic-watch", daemon=True).start()


def ops_rank(state: dict, name: str) -> int:
    return next(m["rank"] for m in state["members"] if m["name"] == name)


def _say(text: str) -> None:
    """One line on stderr (the launcher prefixes it with the task's name)."""
    import sys

    print(f"tfdist elastic: {text}", file=sys.stderr, flush=True)


_member: ElasticMember | None = None


def member() -> ElasticMember | None:
    """This process's `ElasticMember`, or None outside an elastic job."""
    return _member


def join(name: str, interface: str, timeout: float, gloo_timeout: float) -> ElasticMember:
    """Forms Horovod for this task from the launcher's membership service (once)."""
    global _member
    if _member is None:
        _member = ElasticMember(name, membership.elastic_address(), interface, timeout,
                                gloo_timeout)
        _member.form()
    return _member
