"""Multi-node rendezvous for `tfdist launch --nnodes N`: node 0 hosts it, every node joins.

Every node runs the same ``tfdist launch`` command. Node 0 listens at ``--master``; each
node (node 0 too) connects, proves it knows the shared token (HMAC of a fresh nonce),
and sends its rank, its task counts, free ports of its own and, optionally, the address
the others should use (default: the address its connection came from). When every node
has joined, node 0 builds the whole cluster and sends it to each node, with the tasks
that node runs. The connections stay open for the job's life: a task that fails on any
node makes node 0 tell every node to stop (fail-fast), and a node that loses node 0
stops its tasks too. With ``max_restarts``, node 0's stop says whether a restart is
left; then every node rejoins with fresh ports (a new round) and gets a new cluster.

The wire format is JSON, one object per line. Nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib
import json
import os
import secrets
import socket
import subprocess
import shutil
import sys
import threading
import time
from typing import Any, Sequence

from tfdist.checks import check_int
from tfdist.cluster import ClusterSpec, TaskSpec

TOKEN_ENV = "TFDIST_TOKEN"
DEFAULT_JOIN_TIMEOUT = 120.0
_TASK_TYPES = ("chief", "worker", "ps")
_MAX_LINE = 1 << 20  # a longer message is refused
_DECISION_SECONDS = 30.0  # a node whose task failed waits this long for node 0's word


class RendezvousError(RuntimeError):
    """The nodes could not form a job: refused, missing, or node 0 went away."""


# ---- the wire: JSON lines ---------------------------------------------------------------

class _Channel:
    """One socket, JSON objects one per line, each way."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def send(self, message: dict) -> bool:
        """Sends ``message``; False if the peer is gone."""
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def receive(self) -> dict | None:
        """The next message, or None at EOF (or on a broken or oversized line)."""
        try:
            line = self._reader.readline(_MAX_LINE)
        except (OSError, ValueError):
            return None
        if not line.endswith(b"\n"):
            return None
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None

    def close(self) -> None:
        try:  # wakes a thread blocked reading (closing the reader first would wait for it)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for close in (self.sock.close, self._reader.close):
            try:
                close()
            except OSError:
                pass


def _describe(stop: dict) -> str:
    """A "stop" message in words: ``worker-1 exited with code 3 on node 1``."""
    if stop.get("task"):  # the reason starts with the task's name
        return f"{stop['reason']} on node {stop['node']}"
    return f"node {stop['node']}: {stop['reason']}"


def _proof(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def parse_master(master: str) -> tuple[str, int]:
    """``"10.0.0.1:29400"`` -> ``("10.0.0.1", 29400)``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in 1..65535.
    """
    host, _, port = str(master).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master must be HOST:PORT, e.g. 10.0.0.1:29400. "
                         f"Received: master={master!r}")
    return host, int(port)


# ---- node 0: the server -----------------------------------------------------------------

@dataclasses.dataclass
class _Node:
    rank: int
    addr: str
    counts: dict[str, int]
    channel: _Channel


def _port_refusal(ports: Any, counts: dict[str, int]) -> str | None:
    """Why ``ports`` are not one valid port per task, or None."""
    if not isinstance(ports, list) or len(ports) != sum(counts.values()) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
        return f"needs one port per task. Received: ports={ports!r}"
    return None


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
    """

    def __init__(self, host: str, port: int, nnodes: int, token: str,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT, log=None, max_restarts: int = 0):
        self.host, self.port, self.nnodes = host, port, nnodes
        self.token, self.join_timeout = token, join_timeout
        self.max_restarts = max_restarts
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
        self._threads.append(thread)

    def _say(self, text: str) -> None:
        # One write per line: the launcher's thread writes to the same log.
        print(f"tfdist launch: rendezvous: {text}\n", end="", file=self.log, flush=True)

    def _accept_loop(self) -> None:
        while not self._closed:
            if self._state == "joining" and time.monotonic() > self._deadline:
                self._join_timed_out()
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._admit, _Channel(sock), peer[0])

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
            self._broadcast({"type": "error", "message": message})
            self._state = "finished"
        self._say(message)

    def _admit(self, channel: _Channel, peer: str) -> None:
        """Checks one node's hello; registers it, or tells it why not and hangs up."""
        nonce = secrets.token_hex(16)
        channel.send({"type": "challenge", "nonce": nonce})
        channel.sock.settimeout(30)
        hello = channel.receive()
        channel.sock.settimeout(None)
        if hello is None or hello.get("type") != "join":
            channel.close()  # not one of ours (a port scan, a dropped node)
            return
        rank = hello.get("rank")
        with self._lock:
            reason = self._refusal(hello, nonce)
            if reason is None:
                node = _Node(rank, hello.get("addr") or peer, dict(hello["counts"]), channel)
                self._nodes[rank] = node
                self._enter(rank, list(hello["ports"]))
                joined = f"{len(self._ports)}/{self.nnodes}"
        if reason is not None:
            message = f"node {rank} (connecting from {peer}) was refused: {reason}"
            self._say(message)
            channel.send({"type": "error", "message": message})
            channel.close()
            return
        self._say(f"node {rank} joined from {peer} ({joined})")
        self._serve(node)

    def _refusal(self, hello: dict, nonce: str) -> str | None:
        """Why ``hello`` is not admitted, or None. Called with the lock held."""
        proof = hello.get("proof")
        if not isinstance(proof, str) or not hmac.compare_digest(
                proof, _proof(self.token, nonce)):
            return ("its token does not match node 0's (give every node the same --token "
                    f"or {TOKEN_ENV})")
        rank, nnodes = hello.get("rank"), hello.get("nnodes")
        if nnodes != self.nnodes:
            return f"it says --nnodes {nnodes}, node 0 says --nnodes {self.nnodes}"
        if hello.get("max_restarts", 0) != self.max_restarts:
            return (f"it says --max-restarts {hello.get('max_restarts', 0)}, node 0 says "
                    f"--max-restarts {self.max_restarts}")
        if not isinstance(rank, int) or not 0 <= rank < self.nnodes:
            return f"node rank must be in 0..{self.nnodes - 1}. Received: {rank!r}"
        if rank in self._nodes:
            return f"node rank {rank} has already joined from {self._nodes[rank].addr}"
        if self._state != "joining":
            return ("the job is running (or over); a node joins only while the job starts "
                    "or restarts")
        counts = hello.get("counts")
        if not isinstance(counts, dict) or set(counts) != set(_TASK_TYPES) or not all(
                isinstance(counts[t], int) and counts[t] >= 0 for t in _TASK_TYPES):
            return f"bad task counts. Received: {counts!r}"
        if counts["chief"] and rank != 0:
            return "only node 0 may run the chief (--chief)"
        return _port_refusal(hello.get("ports"), counts)

    def _enter(self, rank: int, ports: list[int]) -> None:
        """Adds node ``rank`` to this round; forms the cluster when all are in. Locked."""
        self._ports[rank] = ports
        if len(self._ports) == self.nnodes:
            self._form()

    def _form(self) -> None:
        """Builds the cluster from every node, in rank order; sends each its tasks."""
        jobs: dict[str, list[str]] = {t: [] for t in _TASK_TYPES}
        assigned: dict[int, list[dict]] = {}
        for rank in range(self.nnodes):
            node, local, ports = self._nodes[rank], 0, iter(self._ports[rank])
            assigned[rank] = []
            for task_type in _TASK_TYPES:
                for _ in range(node.counts[task_type]):
                    assigned[rank].append({"type": task_type, "index": len(jobs[task_type]),
                                           "local_rank": local})
                    jobs[task_type].append(f"{node.addr}:{next(ports)}")
                    local += 1
        try:
            cluster = ClusterSpec(**jobs).jobs()
        except ValueError as error:
            self._broadcast({"type": "error", "message": f"no valid cluster: {error}"})
            self._state = "finished"
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
                    said = self._stop(node.rank, message.get("task"), message.get("reason"))
                elif kind == "done" and self._state == "running":
                    self._done.add(node.rank)
                    if len(self._done) == self.nnodes:
                        self._broadcast({"type": "end"})
                        self._state = "finished"
                elif kind == "rejoin" and self._state == "joining" and \
                        node.rank not in self._ports:
                    refusal = _port_refusal(message.get("ports"), node.counts)
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
            said = (f"{_describe(stop)}; restart {self._round}/{self.max_restarts}: every "
                    f"node stops its tasks and rejoins within {self.join_timeout:g}s")
        else:
            self._state = "finished"
            said = f"{_describe(stop)}; stopping every node"
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
        deadline = time.monotonic() + wait
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        for node in list(self._nodes.values()):
            node.channel.close()


# ---- every node: the client ---------------------------------------------------------------

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

    def __init__(self, channel: _Channel, reply: dict, master: str):
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
    channel = _Channel(sock)
    # Node 0 answers by its own join deadline; a little more is a backstop.
    sock.settimeout(max(1.0, deadline - time.monotonic()) + 30)
    challenge = channel.receive()
    if challenge is None or challenge.get("type") != "challenge":
        channel.close()
        raise RendezvousError(f"{master} did not answer as a tfdist rendezvous (node {rank})")
    channel.send({"type": "join", "rank": rank, "nnodes": nnodes, "addr": addr,
                  "counts": dict(counts), "ports": list(ports), "max_restarts": max_restarts,
                  "proof": _proof(token, str(challenge.get("nonce")))})
    reply = channel.receive()
    sock.settimeout(None)
    if reply is None or reply.get("type") != "cluster":
        channel.close()
        if reply is not None and reply.get("type") == "error":
            raise RendezvousError(str(reply.get("message")))
        raise RendezvousError(f"node 0 at {master} hung up before the job started "
                              f"(node {rank} got no cluster)")
    return NodeLink(channel, reply, master)


def resolve_token(token: str | None, node_rank: int, log) -> str:
    """The shared token: ``token``, else $TFDIST_TOKEN, else (node 0) a new one, printed.

    Raises:
        ValueError: a node other than 0 has no token.
    """
    token = token or os.environ.get(TOKEN_ENV)
    if token:
        return token
    if node_rank != 0:
        raise ValueError(f"node {node_rank} needs the rendezvous token that node 0 printed: "
                         f"pass --token or set {TOKEN_ENV}. Received: no token")
    token = secrets.token_urlsafe(18)
    print(f"tfdist launch: rendezvous token: {token}  (give every other node --token "
          f"{token}, or set {TOKEN_ENV})", file=log, flush=True)
    return token


# ---- GPU pinning ----------------------------------------------------------------------------

def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The node's GPUs, by the ids CUDA_VISIBLE_DEVICES would use. Does not import TF.

    CUDA_VISIBLE_DEVICES, if set, is the list (empty or ``-1``: none); otherwise
    ``nvidia-smi -L`` counts them, if it is installed; otherwise there are none.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = [i.strip() for i in environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
        return [] if not ids or ids[0].startswith("-") else ids
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(
        l for l in listing.splitlines() if l.startswith("GPU "))]


def assign_gpus(gpus: Sequence[str], ntasks: int,
                gpus_per_task: int | None = None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of ``ntasks`` tasks (None: leave it alone).

    Args:
        gpus: The node's GPU ids (`visible_gpus`); none means nothing is pinned.
        ntasks: Tasks on this node.
        gpus_per_task: GPUs each task gets, in order; default: ``len(gpus) // ntasks``
            (at least 1: with fewer GPUs than tasks, tasks share them round-robin).

    Raises:
        ValueError: ``gpus_per_task`` is not >= 1, or asks for more GPUs than the node has.
    """
    if gpus_per_task is not None:
        check_int("gpus_per_task", gpus_per_task, 1)
    if not gpus or ntasks < 1:
        return [None] * ntasks
    if gpus_per_task is None:
        if len(gpus) < ntasks:
            return [gpus[i % len(gpus)] for i in range(ntasks)]
        gpus_per_task = len(gpus) // ntasks
    if gpus_per_task * ntasks > len(gpus):
        raise ValueError(f"gpus_per_task={gpus_per_task} needs {gpus_per_task * ntasks} GPUs "
                         f"for {ntasks} task(s); this node has {len(gpus)} "
                         f"({','.join(gpus)})")
    return [",".join(gpus[i * gpus_per_task:(i + 1) * gpus_per_task]) for i in range(ntasks)]


def gpu_env(specs: Sequence[TaskSpec], environ: dict[str, str],
            gpus_per_task: int | None = None) -> dict[str, dict[str, str]]:
    """Task name -> ``{"CUDA_VISIBLE_DEVICES": ...}`` (empty without GPUs)."""
    pins = assign_gpus(visible_gpus(environ), len(specs), gpus_per_task)
    return {spec.name: ({} if pin is None else {"CUDA_VISIBLE_DEVICES": pin})
            for spec, pin in zip(specs, pins)}


# ---- one node's launcher ----------------------------------------------------------------------

def run_node(argv: Sequence[str], *, nnodes: int, node_rank: int, master: str,
             workers: int, chief: bool, ps: int, node_addr: str | None = None,
             token: str | None = None, join_timeout: float = DEFAULT_JOIN_TIMEOUT,
             timeout: float | None = None, max_restarts: int = 0, env: dict | None = None,
             backup_dir=None, grace_period: float, stream, log=None,
             gpus_per_task: int | None = None, wrap=None) -> Any:
    """Runs this node's share of a multi-node job (see `tfdist.launch.run`).

    With ``max_restarts``, a failure on any node restarts the whole job: node 0
    decides (the same restart count for every node), every node stops its tasks and
    rejoins with fresh ports within ``join_timeout``, and the tasks start again with a
    new TF_CONFIG (``TFDIST_RESTART`` counts the restarts; ``backup_dir`` is exported as
    ``TFDIST_BACKUP_DIR``, so a job with `BackupAndRestore` resumes).

    Returns:
        A `LaunchResult` (this node's tasks; the whole cluster).

    Raises:
        LaunchError: a task failed on some node (named, with its node) and no restart
            was left, node 0 went away, or the timeout passed.
        RendezvousError: the job could not form (refused, a node missing), at its start
            or at a restart.
        ValueError: bad arguments.
    """
    # The module (``tfdist.launch`` the attribute is the function); imported late, as
    # it imports this one.
    launcher = importlib.import_module("tfdist.launch")

    log = log or sys.stderr
    _validate(nnodes, node_rank, chief, join_timeout)
    parse_master(master)
    token = resolve_token(token, node_rank, log)
    counts = {"chief": int(chief), "worker": workers, "ps": ps}
    server = None
    if node_rank == 0:
        host, port = parse_master(master)
        server = RendezvousServer(host, port, nnodes, token, join_timeout, log,
                                  max_restarts).start()

    def free_ports() -> list[int]:
        # TF's servers listen on 0.0.0.0 whatever the cluster says: pick ports free there.
        return launcher.find_free_ports(sum(counts.values()), "0.0.0.0")

    link = None
    try:
        link = join(master, rank=node_rank, nnodes=nnodes, token=token, counts=counts,
                    ports=free_ports(), addr=node_addr, timeout=join_timeout,
                    max_restarts=max_restarts)
        while True:
            print(f"tfdist launch: node {node_rank}/{nnodes}: running "
                  f"{', '.join(s.name for s in link.tasks) or 'no task'} of "
                  f"{link.cluster.jobs()}\n", end="", file=log, flush=True)
            pins = gpu_env(link.tasks, launcher._command_env(env), gpus_per_task)

            def extra_env(spec: TaskSpec) -> dict[str, str]:
                return {"TFDIST_NODE_RANK": str(node_rank), "TFDIST_NNODES": str(nnodes),
                        "TFDIST_LOCAL_RANK": str(link.local_ranks[spec.name]),
                        **pins[spec.name]}

            started = time.monotonic()
            tasks, failed, timed_out = launcher._run_once(
                list(argv), link.cluster, env, timeout, grace_period, stream, link.round,
                backup_dir, wrap, None, specs=link.tasks, extra_env=extra_env, peers=link)
            if failed is not None or timed_out:
                link.wait_for_decision(_DECISION_SECONDS)  # our own failure: node 0 decides
            if link.restart is None:
                return _outcome(launcher, link, tasks, failed, timed_out, node_rank,
                                time.monotonic() - started, timeout, max_restarts)
            note = "; restarting every task on every node"
            if link.stop.get("lost"):
                note += (f" once node {link.stop['node']} rejoins (start its launcher again "
                         f"within {join_timeout:g}s)")
            launcher.announce_restart(log, link.restart, link.stop["max_restarts"],
                                      _restart_cause(link.stop), note)
            link.rejoin(free_ports(), join_timeout + 30)  # node 0 gives up at join_timeout
    finally:
        if link is not None:
            link.close()
        if server is not None:
            server.close()


def _restart_cause(stop: dict) -> str:
    """``worker-1 on node 1 exited with code 3`` (or `_describe` when no task failed)."""
    task, reason = stop.get("task"), str(stop.get("reason"))
    if task and reason.startswith(task):
        return f"{task} on node {stop['node']}{reason[len(task):]}"
    return _describe(stop)


def _validate(nnodes, node_rank, chief, join_timeout) -> None:
    check_int("nnodes", nnodes, 1)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or \
            not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} for nnodes={nnodes}. "
                         f"Received: node_rank={node_rank!r}")
    if chief and node_rank != 0:
        raise ValueError(f"only node 0 may run the chief (--chief). "
                         f"Received: chief=True on node_rank={node_rank}")
    if not join_timeout > 0:
        raise ValueError(f"join_timeout must be > 0 seconds. "
                         f"Received: join_timeout={join_timeout!r}")


def _outcome(launcher, link: NodeLink, tasks, failed, timed_out, node_rank, spent, timeout,
             max_restarts):
    """This node's `LaunchResult`, or the `LaunchError` that names what failed where."""
    def error(message, task=None, code=None, tail=""):
        return launcher.LaunchError(message, task=task, returncode=code, output_tail=tail,
                                    attempts=link.round + 1)

    stopped = "every task on every node was stopped"
    spent_all = f"; no restart left ({link.round}/{max_restarts} used)" if max_restarts else ""
    if failed is not None:
        code = failed.poll()
        reason = launcher.exit_cause(failed.name, code)
        raise error(f"{reason} on node {node_rank} after {spent:.1f}s; {stopped}{spent_all}. "
                    f"Last output of {failed.name}:\n{failed.tail_text()}",
                    failed.name, code, failed.tail_text())
    if timed_out:
        raise error(f"job timed out on node {node_rank} after {timeout:g}s; {stopped}"
                    f"{spent_all}")
    if link.stop is not None:
        raise error(f"{_describe(link.stop)}; {stopped} (this is node {node_rank})"
                    f"{spent_all}", link.stop.get("task"))
    if link.lost:
        raise error(f"node {node_rank} lost its connection to node 0 at {link.master} (its "
                    "launcher ended, or the network failed); this node's tasks were stopped")
    return launcher.launch_result(tasks, link.round + 1, link.cluster)
