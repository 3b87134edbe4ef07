"""A worker's side of an elastic job: form Horovod from the launcher's membership, and
form it again when a member leaves or joins (`tfdist.engines.horovod.membership`).

As Horovod Elastic does, re-forming is ``hvd.shutdown()`` then ``hvd.init()`` with the
new rank and size, in the same process: with this engine every process's TensorFlow is
local, so nothing else restarts.
"""

from __future__ import annotations

import os

from tfdist.engines.horovod import membership, ops

# In Horovod's errors when a member died or froze (the op names as Horovod's elastic
# wrapper matches them, and the words of its background loop's shutdown).
_LOST_PEER_WORDS = ("Horovod has been shut down", "HorovodAllreduce", "HorovodBroadcast",
                    "HorovodAllgather", "Gloo", "gloo")


def is_lost_peer(error) -> bool:
    """Whether ``error`` (a TF ``OpError``) is Horovod's failure when a member is lost."""
    message = getattr(error, "message", None) or str(error)
    return any(words in message for words in _LOST_PEER_WORDS)


class ElasticMember:
    """This task's membership in an elastic job.

    Args:
        name: This task's name (e.g. ``worker-1``), as the launcher lists it.
        address: The membership service's ``HOST:PORT``.
        interface: The network interface Gloo binds to.
        timeout: Seconds to wait for a membership that lists this task (the launcher's
            ``--elastic-timeout``).
        gloo_timeout: Gloo's timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``): how long a
            member waits for a frozen or dead peer before Horovod fails.
    """

    def __init__(self, name: str, address: str, interface: str, timeout: float,
                 gloo_timeout: float):
        self.name = name
        self.address = address
        self.interface = interface
        self.timeout = timeout
        self.gloo_timeout = gloo_timeout
        self.state: dict = {"version": 0, "members": []}
        self.reforms = 0  # times Horovod was formed again

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
        state = membership.wait_for_membership(self.address, self.name, self.version,
                                               self.timeout)
        os.environ.update(membership.slot_env(state, self.name, self.address))
        os.environ["HOROVOD_GLOO_IFACE"] = self.interface
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(max(self.gloo_timeout, 1))))
        first = self.version == 0
        self.state = state
        if first:
            ops.init()
        else:
            ops.reinit()

    def reform(self) -> None:
        """Shuts Horovod down and forms it again with the next membership."""
        ops.shutdown()
        self.reforms += 1
        self.form()

    def changed(self) -> bool:
        """Whether the launcher published a membership newer than this one (a joiner)."""
        try:
            return membership.fetch_state(self.address, timeout=2)["version"] > self.version
        except OSError:
            return False


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
