"""Every node's side of the rendezvous: join node 0, then follow its word for the job.

A node trusts nothing it reads before it is admitted: what it shows of node 0's words
is `printable`, and a ``--master`` that does not answer as a rendezvous (another
server, silent or not) fails the join within its timeout, saying what it did.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Sequence

from tfdist.cluster import ClusterSpec, TaskSpec
from tfdist.launch.options import DEFAULT_JOIN_TIMEOUT
from tfdist.launch.rendezvous.hello import HELLO_MAX_BYTES, MAX_NODES, MAX_RESTARTS, is_int
from tfdist.launch.rendezvous.wire import (Channel, RendezvousError, parse_master, printable,
                                           proof)


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
                    self.stop = _shown(message)  # (may come before `rejoin` wakes)
                elif message.get("type") == "end":
                    self.ended = True
                elif message.get("type") == "cluster":
                    self._next = message
                elif message.get("type") == "error":
                    self.error = printable(message.get("message"))
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
    deadline = time.monotonic() + timeout
    greeted = None
    while greeted is None:
        greeted = _greeted(master, rank, deadline, timeout)
        if greeted is None:
            time.sleep(0.5)
    channel, nonce = greeted
    channel.send({"type": "join", "rank": rank, "nnodes": nnodes, "addr": addr,
                  "counts": dict(counts), "ports": list(ports), "max_restarts": max_restarts,
                  "proof": proof(token, nonce)})
    # Node 0 answers by its own join deadline (it may have started later); a little
    # more is a backstop.
    channel.sock.settimeout(max(1.0, deadline - time.monotonic()) + 30)
    reply = channel.receive()
    channel.sock.settimeout(None)
    if reply is None or reply.get("type") != "cluster":
        channel.close()
        if reply is not None and reply.get("type") == "error":
            raise RendezvousError(printable(reply.get("message")))
        raise RendezvousError(f"node 0 at {master} hung up before the job started "
                              f"(node {rank} got no cluster)")
    return NodeLink(channel, reply, master)


def _greeted(master: str, rank: int, deadline: float,
             timeout: float) -> tuple[Channel, str] | None:
    """A connection to ``master`` and node 0's challenge nonce; None: try again later
    (unreachable, or node 0 busy with other connections).

    Raises:
        RendezvousError: the deadline passed, or ``master`` is not a tfdist rendezvous.
    """
    host, port = parse_master(master)
    try:
        sock = socket.create_connection(
            (host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic())))
    except OSError as error:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"node {rank} could not reach node 0's rendezvous at {master} within "
                f"{timeout:g}s ({error}). Is node 0 started, with the same --master, "
                "and is the port open in the firewall?") from None
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = Channel(sock)
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    challenge = channel.receive(HELLO_MAX_BYTES)
    kind = None if challenge is None else challenge.get("type")
    if kind == "challenge" and isinstance(challenge.get("nonce"), str):
        return channel, challenge["nonce"]
    channel.close()
    if kind == "busy" and time.monotonic() <= deadline:
        return None
    if kind == "busy":
        raise RendezvousError(
            f"node 0's rendezvous at {master} stayed busy with other connections waiting "
            f"to join for {timeout:g}s (node {rank} tried again until then): is something "
            "else connecting to --master?")
    if channel.problem == "timed out":
        what = f"sent nothing within {timeout:g}s"
    elif channel.problem == "closed":
        what = "closed the connection without a word"
    else:
        what = channel.problem or f"sent {printable(challenge, 200)} instead of a challenge"
    raise RendezvousError(
        f"{master} is not a tfdist rendezvous: node {rank} connected, but it {what}. Is "
        "--master node 0's address and port, and is node 0 a tfdist launch of this "
        "version?")


def _shown(stop: dict) -> dict:
    """Node 0's "stop" message with its words `printable` and its numbers checked."""
    task, restart = stop.get("task"), stop.get("restart")
    return {**stop, "task": None if task is None else printable(task, 40),
            "reason": printable(stop.get("reason"), 500),
            "node": stop.get("node") if is_int(stop.get("node"), 0, MAX_NODES) else None,
            "restart": restart if is_int(restart, 1, MAX_RESTARTS) else None,
            "max_restarts": stop.get("max_restarts") if is_int(
                stop.get("max_restarts"), 0, MAX_RESTARTS) else 0,
            "lost": bool(stop.get("lost"))}
