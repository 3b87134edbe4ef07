"""Node 0's side of the rendezvous: admits nodes, hands out the cluster, relays stops.

Anyone who can reach ``--master`` can connect. At most `MAX_PENDING` connections may
wait for their hello at once (more are told node 0 is busy, and closed), each for
`HELLO_SECONDS` at most; a hello is checked field by field (`hello`) before it is used,
and what is logged of it is quoted. A refused node ends a round that is forming: every
joined node fails at once with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import socket
import sys
import threading
import time
from typing import Any

from tfdist.cluster import ClusterSpec
from tfdist.launch.options import DEFAULT_JOIN_TIMEOUT
from tfdist.launch.rendezvous.hello import (HELLO_MAX_BYTES, TASK_TYPES, describe_node,
                                            field_problem, has_proof, port_problem)
from tfdist.launch.rendezvous.wire import (TOKEN_ENV, Channel, RendezvousError,
                                           describe_stop, printable)
from tfdist.wire import HELLO_SECONDS, MAX_PENDING  # shared with the membership service


@dataclasses.dataclass
class _Node:
    rank: int
    addr: str
    counts: dict[str, int]
    channel: Channel


class RendezvousServer:
    """Node 0's side: admits nodes, hands out the cluster, relays stops and restarts.

    The job runs in rounds: round 0 is its first start, round k its k-th restart. In
    each round every node joins (or rejoins, with fresh ports) within ``join_timeout``
    seconds, then node 0 sends the cluster. A failure on any node ends the round: node 0
    decides, once for every node, whether a restart is left (``max_restarts``), and
    says so in its "stop" message.

    Args:
        host: Address to listen on (the host part of ``--master``).
        port: Port to listen on.
        nnodes: How many nodes the job has.
        token: The shared secret every node must prove it knows.
        join_timeout: Seconds from `start` (and from each restart decision) until every
            node must have joined.
        log: Where refusals and stops are reported.
        max_restarts: Restarts of the whole job; every node must give the same number.
        hello_timeout: Seconds a connection has to send its hello before it is closed.
        max_pending: Connections that may wait for their hello at once; more are told
            node 0 is busy (a node retries) and closed.
    """

    def __init__(self, host: str, port: int, nnodes: int, token: str,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT, log=None, max_restarts: int = 0,
                 hello_timeout: float = HELLO_SECONDS, max_pending: int = MAX_PENDING):
        self.host, self.port, self.nnodes = host, port, nnodes
        self.token, self.join_timeout = token, join_timeout
        self.max_restarts = max_restarts
        self.hello_timeout, self.max_pending = hello_timeout, max_pending
        self._pending: dict[Channel, float] = {}  # connections before their hello: deadline
        self._failure: str | None = None  # why node 0 gave up on the job
        self.log = log or sys.stderr
        self._nodes: dict[int, _Node] = {}  # connected, admitted nodes
        self._lock = threading.Lock()
        self._state = "joining"  # then "running", and "joining" again on each restart
        self._round = 0  # restarts decided so far
        self._ports: dict[int, list[int]] = {}  # rank -> ports, of nodes in this round
        self._done: set[int] = set()  # nodes whose chief and workers exited 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None

    def start(self) -> "RendezvousServer":
        """Listens at host:port and admits nodes in the background.

        Raises:
            RendezvousError: the address cannot be listened on (another node 0?).
        """
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
        except OSError as error:
            listener.close()
            raise RendezvousError(
                f"node 0 cannot host the rendezvous at {self.host}:{self.port}: {error}. "
                "Is another node 0 already running there, or is the address not this "
                "host's?") from None
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self._deadline = time.monotonic() + self.join_timeout
        self._spawn(self._accept_loop)
        return self

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _say(self, text: str) -> None:
        # One write per line: the launcher's thread writes to the same log.
        print(f"tfdist launch: rendezvous: {text}\n", end="", file=self.log, flush=True)

    def _accept_loop(self) -> None:
        while not self._closed:
            if self._state == "joining" and time.monotonic() > self._deadline:
                self._join_timed_out()
            self._cut_off_overdue()
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = Channel(sock)
            with self._lock:
                admitted = len(self._pending) < self.max_pending
                if admitted:
                    self._pending[channel] = time.monotonic() + self.hello_timeout
            if admitted:
                self._spawn(self._admit, channel, peer[0])
            else:  # no thread for it: the connection is answered and closed here
                sock.settimeout(1.0)
                channel.send({"type": "busy", "message": f"node 0 has {self.max_pending} "
                              "connections waiting to join; try again"})
                channel.close()

    def _cut_off_overdue(self) -> None:
        """Closes the connections whose hello is overdue; their threads then end."""
        now = time.monotonic()
        with self._lock:
            overdue = [c for c, deadline in self._pending.items() if deadline < now]
            for channel in overdue:
                self._pending[channel] = math.inf  # closed once
        for channel in overdue:
            channel.close()

    def _join_timed_out(self) -> None:
        with self._lock:
            if self._state != "joining" or time.monotonic() <= self._deadline:
                return
            missing = ", ".join(str(r) for r in range(self.nnodes) if r not in self._ports)
            joined = sorted(self._ports) or "none"
            if self._round == 0:
                message = (f"node(s) {missing} did not join within {self.join_timeout:g}s "
                           f"(joined: {joined}); no task was started")
            else:
                message = (f"node(s) {missing} did not rejoin within {self.join_timeout:g}s "
                           f"for restart {self._round}/{self.max_restarts} (rejoined: "
                           f"{joined}); no task was restarted")
            self._give_up(message)
        self._say(message)

    def _give_up(self, message: str) -> None:
        """Ends the job while it forms: every joined node fails with ``message``. Locked."""
        self._broadcast({"type": "error", "message": message})
        self._state, self._failure = "finished", message

    def _admit(self, channel: Channel, peer: str) -> None:
        """Checks one node's hello; registers it, or tells it why not and hangs up."""
        nonce = secrets.token_hex(16)
        try:
            channel.sock.settimeout(self.hello_timeout)
            channel.send({"type": "challenge", "nonce": nonce})
            hello = channel.receive(HELLO_MAX_BYTES)
            channel.sock.settimeout(None)
        except OSError:  # closed as overdue
            hello = None
        finally:
            with self._lock:
                self._pending.pop(channel, None)
        if hello is None or hello.get("type") != "join":
            channel.close()  # not one of ours (a port scan, a dropped node)
            return
        with self._lock:
            reason = self._refusal(hello, nonce)
            if reason is None:
                rank = hello["rank"]
                node = _Node(rank, hello["addr"] or peer, dict(hello["counts"]), channel)
                self._nodes[rank] = node
                self._enter(rank, list(hello["ports"]))
                joined = f"{len(self._ports)}/{self.nnodes}"
            else:
                message = f"{describe_node(hello)} (connecting from {peer}) was refused: {reason}"
                if self._state == "joining":  # it would never join: the others fail now
                    self._give_up(f"{message}; {self._not_done()}")
        if reason is not None:
            self._say(message)
            channel.send({"type": "error", "message": message})
            channel.close()
            return
        self._say(f"node {rank} joined from {peer} ({joined})")
        self._serve(node)

    def _not_done(self) -> str:
        """What a round that forms no cluster leaves undone. Locked."""
        if self._round == 0:
            return "no task was started"
        return f"no task was restarted (restart {self._round}/{self.max_restarts})"

    def _refusal(self, hello: dict, nonce: str) -> str | None:
        """Why ``hello`` is not admitted, or None. Called with the lock held."""
        if not has_proof(hello, self.token, nonce):
            return ("its token does not match node 0's (give every node the same --token "
                    f"or {TOKEN_ENV})")
        problem = field_problem(hello)
        if problem is not None:
            return f"its hello is malformed: {problem}"
        rank, nnodes = hello["rank"], hello["nnodes"]
        if nnodes != self.nnodes:
            return f"it says --nnodes {nnodes}, node 0 says --nnodes {self.nnodes}"
        if hello.get("max_restarts", 0) != self.max_restarts:
            return (f"it says --max-restarts {hello.get('max_restarts', 0)}, node 0 says "
                    f"--max-restarts {self.max_restarts}")
        if rank >= self.nnodes:
            return f"node rank must be in 0..{self.nnodes - 1}. Received: {rank}"
        if rank in self._nodes:
            return f"node rank {rank} has already joined from {self._nodes[rank].addr}"
        if self._failure is not None:
            return f"node 0 has given up on this job ({self._failure})"
        if self._state != "joining":
            return ("the job is running (or over); a node joins only while the job starts "
                    "or restarts")
        if hello["counts"]["chief"] and rank != 0:
            return "only node 0 may run the chief (--chief)"
        return port_problem(hello["ports"], hello["counts"])

    def _enter(self, rank: int, ports: list[int]) -> None:
        """Adds node ``rank`` to this round; forms the cluster when all are in. Locked."""
        self._ports[rank] = ports
        if len(self._ports) == self.nnodes:
            self._form()

    def _form(self) -> None:
        """Builds the cluster from every node, in rank order; sends each its tasks."""
        jobs: dict[str, list[str]] = {t: [] for t in TASK_TYPES}
        assigned: dict[int, list[dict]] = {}
        for rank in range(self.nnodes):
            node, local, ports = self._nodes[rank], 0, iter(self._ports[rank])
            assigned[rank] = []
            for task_type in TASK_TYPES:
                for _ in range(node.counts[task_type]):
                    assigned[rank].append({"type": task_type, "index": len(jobs[task_type]),
                                           "local_rank": local})
                    jobs[task_type].append(f"{node.addr}:{next(ports)}")
                    local += 1
        try:
            cluster = ClusterSpec(**jobs).jobs()
        except ValueError as error:
            self._give_up(f"no valid cluster: {error}")
            return
        for rank, node in self._nodes.items():
            node.channel.send({"type": "cluster", "cluster": cluster, "tasks": assigned[rank],
                               "nnodes": self.nnodes, "round": self._round})
        self._state, self._done = "running", set()

    def _serve(self, node: _Node) -> None:
        """Reads one node's reports for the job's life."""
        while True:
            message = node.channel.receive()
            kind = None if message is None else message.get("type")
            said = None
            with self._lock:
                if message is None:
                    if self._nodes.get(node.rank) is node:
                        del self._nodes[node.rank]
                        self._ports.pop(node.rank, None)
                    if self._state == "joining":
                        said = (f"node {node.rank} left before the job "
                                f"{'restarted' if self._round else 'started'}")
                    elif self._state == "running":
                        said = self._stop(node.rank, None, "its launcher lost the connection "
                                          "to node 0 (it ended or its host went down)",
                                          lost=True)
                elif self._state == "finished" or message.get("round") != self._round:
                    pass  # late news of an earlier round
                elif kind == "failed" and self._state == "running":
                    task = message.get("task")
                    said = self._stop(node.rank, None if task is None else printable(task, 40),
                                      printable(message.get("reason"), 500))
                elif kind == "done" and self._state == "running":
                    self._done.add(node.rank)
                    if len(self._done) == self.nnodes:
                        self._broadcast({"type": "end"})
                        self._state = "finished"
                elif kind == "rejoin" and self._state == "joining" and \
                        node.rank not in self._ports:
                    refusal = port_problem(message.get("ports"), node.counts)
                    if refusal is None:
                        self._enter(node.rank, message["ports"])
                        said = f"node {node.rank} rejoined ({len(self._ports)}/{self.nnodes})"
                    else:
                        said = f"node {node.rank} could not rejoin: {refusal}"
            if said is not None:
                self._say(said)
            if message is None:
                return

    def _stop(self, rank: int, task: Any, reason: Any, lost: bool = False) -> str:
        """Ends the running round: a restart if one is left, else the job. Locked.

        Args:
            rank: The node that failed.
            task: Its failed task's name, or None.
            reason: What happened.
            lost: Whether that node's launcher is gone (it must join anew to restart).

        Returns:
            What to log.
        """
        stop = {"type": "stop", "node": rank, "task": None if task is None else str(task),
                "reason": str(reason), "round": self._round, "restart": None,
                "max_restarts": self.max_restarts, "lost": lost}
        if self._round < self.max_restarts:
            self._round += 1
            stop["restart"] = self._round
            self._state, self._ports = "joining", {}
            self._deadline = time.monotonic() + self.join_timeout
            said = (f"{describe_stop(stop)}; restart {self._round}/{self.max_restarts}: "
                    f"every node stops its tasks and rejoins within {self.join_timeout:g}s")
        else:
            self._state = "finished"
            said = f"{describe_stop(stop)}; stopping every node"
        self._broadcast(stop)
        return said

    def _broadcast(self, message: dict) -> None:
        for node in self._nodes.values():
            node.channel.send(message)

    def close(self, wait: float = 5.0) -> None:
        """Stops listening; gives the nodes ``wait`` seconds to read the last word."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            pending = list(self._pending)
        for channel in pending:
            channel.close()
        deadline = time.monotonic() + wait
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        for node in list(self._nodes.values()):
            node.channel.close()
