"""Every node's side of the rendezvous: join node 0, then follow its word for the job."""

from __future__ import annotations

import socket
import threading
import time
from typing import Sequence

from tfdist.cluster import ClusterSpec, TaskSpec
from tfdist.launch.options import DEFAULT_JOIN_TIMEOUT
from tfdist.launch.rendezvous.wire import Channel, RendezvousError, parse_master, proof


class NodeLink:
    """A node's open connection to node 0 during the job.

    Attributes:
        cluster: The whole cluster of this round (no task set).
        tasks: This node's tasks, as `TaskSpec`.
        local_ranks: Task name -> its rank among this node's tasks.
        round: The job's restarts so far (0 on its first start), as node 0 counts them.
        stop: node 0's "stop" message for this round (which task on which node failed,
            and ``restart``: the restart node 0 decided on, or None), or None.
        ended: True once node 0 said every node's chief and workers exited 0.
        error: node 0's error message (a node did not rejoin), or None.
    """

    def __init__(self, channel: Channel, reply: dict, master: str):
        self._channel, self.master = channel, master
        self._changed = threading.Condition()
        self._take_cluster(reply)
        self.stop: dict | None = None
        self.ended = False
        self.error: str | None = None
        self._closed = False  # node 0 hung up
        self._next: dict | None = None  # the next round's cluster
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _take_cluster(self, reply: dict) -> None:
        try:
            self.cluster = ClusterSpec.from_dict({"cluster": reply["cluster"]})
            self.tasks = [TaskSpec(t["type"], t["index"]) for t in reply["tasks"]]
            self.local_ranks = {TaskSpec(t["type"], t["index"]).name: t["local_rank"]
                                for t in reply["tasks"]}
            self.round = int(reply.get("round", 0))
        except (ValueError, KeyError, TypeError) as error:
            self._channel.close()
            raise RendezvousError(f"node 0 sent a cluster this node cannot use ({error}). "
                                  f"Received: {reply!r}") from None
        self._done_sent = False

    @property
    def lost(self) -> bool:
        """True if the connection to node 0 ended before node 0 ended or stopped the job."""
        return self._closed and not self.ended and self.stop is None

    def _read(self) -> None:
        while True:
            message = self._channel.receive()
            with self._changed:
                if message is None:
                    self._closed = True
                elif message.get("type") == "stop" and message.get("round") == (
                        self.round if self._next is None else self._next.get("round")):
                    self.stop = message  # (a new round's stop may come before `rejoin` wakes)
                elif message.get("type") == "end":
                    self.ended = True
                elif message.get("type") == "cluster":
                    self._next = message
                elif message.get("type") == "error":
                    self.error = str(message.get("message"))
                self._changed.notify_all()
            if message is None:
                return

    def report_failure(self, task: str | None, reason: str) -> None:
        """Tells node 0 that ``task`` failed (``reason``), so it stops every node."""
        self._channel.send({"type": "failed", "task": task, "reason": reason,
                            "round": self.round})

    def report_done(self) -> None:
        """Tells node 0 (once per round) that this node's chief and workers exited 0."""
        if not self._done_sent:
            self._done_sent = self._channel.send({"type": "done", "round": self.round})

    def should_stop(self) -> bool:
        """Whether this round is over for this node: ended, stopped, or node 0 is gone."""
        return self.ended or self.stop is not None or self._closed

    def wait_for_decision(self, timeout: float) -> None:
        """After this round's tasks stopped: waits (up to ``timeout`` s) for node 0's word.

        Node 0's "stop" says whether the job restarts; a node whose own task failed
        learns it here.
        """
        with self._changed:
            self._changed.wait_for(self.should_stop, timeout)

    @property
    def restart(self) -> int | None:
        """The restart node 0 decided on when it stopped this round, or None."""
        return None if self.stop is None else self.stop.get("restart")

    def rejoin(self, ports: Sequence[int], timeout: float) -> None:
        """Joins the restart node 0 decided on, with this node's fresh ``ports``.

        Returns when node 0 sent the new round's cluster (read `cluster`, `tasks`).

        Raises:
            RendezvousError: a node did not rejoin in time, or node 0 went away.
        """
        restart = self.restart
        if restart is None:
            raise RuntimeError("rejoin() needs node 0's decision to restart the job")
        with self._changed:
            self.stop, self._next = None, None
            self._channel.send({"type": "rejoin", "round": restart, "ports": list(ports)})
            self._changed.wait_for(
                lambda: self._next is not None or self.error is not None or self._closed,
                timeout)
            if self._next is not None and self._next.get("round") == restart:
                self._take_cluster(self._next)
                self._next = None
                return
        if self.error is not None:
            raise RendezvousError(self.error)
        raise RendezvousError(
            f"node 0 at {self.master} went away (or sent no cluster within {timeout:g}s) "
            f"while every node rejoined for restart {restart}")

    def close(self) -> None:
        self._channel.close()


def join(master: str, *, rank: int, nnodes: int, token: str, counts: dict[str, int],
         ports: Sequence[int], addr: str | None = None,
         timeout: float = DEFAULT_JOIN_TIMEOUT, max_restarts: int = 0) -> NodeLink:
    """Joins the rendezvous at ``master``; returns when node 0 sends the cluster.

    A node may also join a restart of a running job (its launcher was started again
    after it died): node 0 takes it in if its rank is missing from that restart.

    Raises:
        RendezvousError: node 0 was unreachable for ``timeout`` seconds, refused this
            node, or gave up waiting for other nodes.
    """
    host, port = parse_master(master)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError as error:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"node {rank} could not reach node 0's rendezvous at {master} within "
                    f"{timeout:g}s ({error}). Is node 0 started, with the same --master, "
                    "and is the port open in the firewall?") from None
            time.sleep(0.5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = Channel(sock)
    # Node 0 answers by its own join deadline; a little more is a backstop.
    sock.settimeout(max(1.0, deadline - time.monotonic()) + 30)
    challenge = channel.receive()
    if challenge is None or challenge.get("type") != "challenge":
        channel.close()
        raise RendezvousError(f"{master} did not answer as a tfdist rendezvous (node {rank})")
    channel.send({"type": "join", "rank": rank, "nnodes": nnodes, "addr": addr,
                  "counts": dict(counts), "ports": list(ports), "max_restarts": max_restarts,
                  "proof": proof(token, str(challenge.get("nonce")))})
    reply = channel.receive()
    sock.settimeout(None)
    if reply is None or reply.get("type") != "cluster":
        channel.close()
        if reply is not None and reply.get("type") == "error":
            raise RendezvousError(str(reply.get("message")))
        raise RendezvousError(f"node 0 at {master} hung up before the job started "
                              f"(node {rank} got no cluster)")
    return NodeLink(channel, reply, master)
