"""Multi-node rendezvous for `tfdist launch --nnodes N`: node 0 hosts it, every node joins.

Every node runs the same ``tfdist launch`` command. Node 0 listens at ``--master``; each
node (node 0 too) connects, proves it knows the shared token (HMAC of a fresh nonce),
and sends its rank, its task counts, free ports of its own and, optionally, the address
the others should use (default: the address its connection came from). When every node
has joined, node 0 builds the whole cluster and sends it to each node, with the tasks
that node runs. The connections stay open for the job's life: a task that fails on any
node makes node 0 tell every node to stop (fail-fast), and a node that loses node 0
stops its tasks too.

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
    ports: list[int]
    channel: _Channel
    done: bool = False


class RendezvousServer:
    """Node 0's side: admits nodes, hands out the cluster, relays fail-fast stops.

    Args:
        host: Address to listen on (the host part of ``--master``).
        port: Port to listen on.
        nnodes: How many nodes the job has.
        token: The shared secret every node must prove it knows.
        join_timeout: Seconds from `start` until every node must have joined.
        log: Where refusals and stops are reported.
    """

    def __init__(self, host: str, port: int, nnodes: int, token: str,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT, log=None):
        self.host, self.port, self.nnodes = host, port, nnodes
        self.token, self.join_timeout = token, join_timeout
        self.log = log or sys.stderr
        self._nodes: dict[int, _Node] = {}
        self._lock = threading.Lock()
        self._formed = threading.Event()
        self._finished = threading.Event()  # "end" or "stop" was sent
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
        print(f"tfdist launch: rendezvous: {text}", file=self.log, flush=True)

    def _accept_loop(self) -> None:
        while not self._closed:
            if not self._formed.is_set() and time.monotonic() > self._deadline:
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
            if self._formed.is_set() or self._finished.is_set():
                return
            missing = [r for r in range(self.nnodes) if r not in self._nodes]
            message = (f"node(s) {', '.join(map(str, missing))} did not join within "
                       f"{self.join_timeout:g}s (joined: "
                       f"{sorted(self._nodes) or 'none'}); no task was started")
            self._broadcast({"type": "error", "message": message})
            self._finished.set()
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
                node = _Node(rank, hello.get("addr") or peer, dict(hello["counts"]),
                             list(hello["ports"]), channel)
                self._nodes[rank] = node
                if len(self._nodes) == self.nnodes:
                    self._form()
        if reason is not None:
            message = f"node {rank} (connecting from {peer}) was refused: {reason}"
            self._say(message)
            channel.send({"type": "error", "message": message})
            channel.close()
            return
        self._say(f"node {rank} joined from {peer} ({len(self._nodes)}/{self.nnodes})")
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
        if not isinstance(rank, int) or not 0 <= rank < self.nnodes:
            return f"node rank must be in 0..{self.nnodes - 1}. Received: {rank!r}"
        if rank in self._nodes:
            return f"node rank {rank} has already joined from {self._nodes[rank].addr}"
        if self._formed.is_set() or self._finished.is_set():
            return "the job has already started (or ended)"
        counts, ports = hello.get("counts"), hello.get("ports")
        if not isinstance(counts, dict) or set(counts) != set(_TASK_TYPES) or not all(
                isinstance(counts[t], int) and counts[t] >= 0 for t in _TASK_TYPES):
            return f"bad task counts. Received: {counts!r}"
        if counts["chief"] and rank != 0:
            return "only node 0 may run the chief (--chief)"
        if not isinstance(ports, list) or len(ports) != sum(counts.values()) or not all(
                isinstance(p, int) and 0 < p < 65536 for p in ports):
            return f"needs one port per task. Received: ports={ports!r}"
        return None

    def _form(self) -> None:
        """Builds the cluster from every node, in rank order; sends each its tasks."""
        jobs: dict[str, list[str]] = {t: [] for t in _TASK_TYPES}
        assigned: dict[int, list[dict]] = {}
        for rank in range(self.nnodes):
            node, local, ports = self._nodes[rank], 0, iter(self._nodes[rank].ports)
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
            self._finished.set()
            return
        for rank, node in self._nodes.items():
            node.channel.send({"type": "cluster", "cluster": cluster, "tasks": assigned[rank],
                               "nnodes": self.nnodes})
        self._formed.set()

    def _serve(self, node: _Node) -> None:
        """Reads one node's reports for the job's life."""
        while True:
            message = node.channel.receive()
            kind = None if message is None else message.get("type")
            with self._lock:
                if self._finished.is_set():
                    if message is None:
                        return
                    continue
                if kind == "failed":
                    stop = {"type": "stop", "node": node.rank,
                            "task": str(message.get("task")), "reason": str(
                                message.get("reason"))}
                elif kind == "done":
                    node.done = True
                    if self._formed.is_set() and all(n.done for n in self._nodes.values()):
                        self._broadcast({"type": "end"})
                        self._finished.set()
                    continue
                elif message is None:
                    if not self._formed.is_set():  # left before the job started
                        del self._nodes[node.rank]
                        self._say(f"node {node.rank} left before the job started")
                        return
                    stop = {"type": "stop", "node": node.rank, "task": None,
                            "reason": "its launcher lost the connection to node 0 (it ended "
                                      "or its host went down)"}
                else:
                    continue
                self._broadcast(stop)
                self._finished.set()
            self._say(f"{_describe(stop)}; stopping every node")
            if message is None:
                return

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
        cluster: The whole cluster (no task set).
        tasks: This node's tasks, as `TaskSpec`.
        local_ranks: Task name -> its rank among this node's tasks.
        stop: node 0's "stop" message (which task on which node failed), or None.
        lost: True if the connection to node 0 ended before the job did.
    """

    def __init__(self, channel: _Channel, reply: dict, master: str):
        self._channel, self.master = channel, master
        try:
            self.cluster = ClusterSpec.from_dict({"cluster": reply["cluster"]})
        except (ValueError, KeyError, TypeError) as error:
            channel.close()
            raise RendezvousError(f"node 0 sent a cluster this node cannot use ({error}). "
                                  f"Received: {reply!r}") from None
        self.tasks = [TaskSpec(t["type"], t["index"]) for t in reply["tasks"]]
        self.local_ranks = {TaskSpec(t["type"], t["index"]).name: t["local_rank"]
                            for t in reply["tasks"]}
        self.stop: dict | None = None
        self.ended = False
        self.lost = False
        self._done_sent = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            message = self._channel.receive()
            if message is None:
                self.lost = not (self.ended or self.stop)
                return
            if message.get("type") == "stop":
                self.stop = message
            elif message.get("type") == "end":
                self.ended = True

    def report_failure(self, task: str | None, reason: str) -> None:
        """Tells node 0 that ``task`` failed (``reason``), so it stops every node."""
        self._channel.send({"type": "failed", "task": task, "reason": reason})

    def report_done(self) -> None:
        """Tells node 0 (once) that this node's chief and workers all exited 0."""
        if not self._done_sent:
            self._done_sent = self._channel.send({"type": "done"})

    def should_stop(self) -> bool:
        """Whether the job is over for this node: ended, stopped, or node 0 is gone."""
        return self.ended or self.stop is not None or self.lost

    def close(self) -> None:
        self._channel.close()


def join(master: str, *, rank: int, nnodes: int, token: str, counts: dict[str, int],
         ports: Sequence[int], addr: str | None = None,
         timeout: float = DEFAULT_JOIN_TIMEOUT) -> NodeLink:
    """Joins the rendezvous at ``master``; returns when node 0 sends the cluster.

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
                  "counts": dict(counts), "ports": list(ports),
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
             timeout: float | None = None, env: dict | None = None, backup_dir=None,
             grace_period: float, stream, log=None, gpus_per_task: int | None = None,
             wrap=None) -> Any:
    """Runs this node's share of a multi-node job (see `tfdist.launch.run`).

    Returns:
        A `LaunchResult` (this node's tasks; the whole cluster).

    Raises:
        LaunchError: a task failed on some node (named, with its node), node 0 went
            away, or the timeout passed.
        RendezvousError: the job could not form (refused, a node missing).
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
        server = RendezvousServer(host, port, nnodes, token, join_timeout, log).start()
    link = None
    try:
        # TF's servers listen on 0.0.0.0 whatever the cluster says: pick ports free there.
        ports = launcher.find_free_ports(sum(counts.values()), "0.0.0.0")
        link = join(master, rank=node_rank, nnodes=nnodes, token=token, counts=counts,
                    ports=ports, addr=node_addr, timeout=join_timeout)
        print(f"tfdist launch: node {node_rank}/{nnodes}: running "
              f"{', '.join(s.name for s in link.tasks) or 'no task'} of "
              f"{link.cluster.jobs()}", file=log, flush=True)
        pins = gpu_env(link.tasks, launcher._command_env(env), gpus_per_task)

        def extra_env(spec: TaskSpec) -> dict[str, str]:
            return {"TFDIST_NODE_RANK": str(node_rank), "TFDIST_NNODES": str(nnodes),
                    "TFDIST_LOCAL_RANK": str(link.local_ranks[spec.name]), **pins[spec.name]}

        started = time.monotonic()
        tasks, failed, timed_out = launcher._run_once(
            list(argv), link.cluster, env, timeout, grace_period, stream, 0, backup_dir,
            wrap, None, specs=link.tasks, extra_env=extra_env, peers=link)
        return _outcome(launcher, link, tasks, failed, timed_out, node_rank,
                        time.monotonic() - started, timeout)
    finally:
        if link is not None:
            link.close()
        if server is not None:
            server.close()


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


def _outcome(launcher, link: NodeLink, tasks, failed, timed_out, node_rank, spent, timeout):
    """This node's `LaunchResult`, or the `LaunchError` that names what failed where."""
    def error(message, task=None, code=None, tail=""):
        return launcher.LaunchError(message, task=task, returncode=code, output_tail=tail)

    if failed is not None:
        code = failed.poll()
        reason = launcher._exit_cause(failed.name, code)
        raise error(f"{reason} on node {node_rank} after {spent:.1f}s; every task on every "
                    f"node was stopped. Last output of {failed.name}:\n{failed.tail_text()}",
                    failed.name, code, failed.tail_text())
    if timed_out:
        raise error(f"job timed out on node {node_rank} after {timeout:g}s; every task on "
                    "every node was stopped")
    if link.stop is not None:
        raise error(f"{_describe(link.stop)}; every task on every node was stopped "
                    f"(this is node {node_rank})", link.stop.get("task"))
    if link.lost:
        raise error(f"node {node_rank} lost its connection to node 0 at {link.master} (its "
                    "launcher ended, or the network failed); this node's tasks were stopped")
    return launcher.LaunchResult(
        tuple(launcher.TaskResult(t.name, t.poll(), t.tail_text()) for t in tasks), 1,
        link.cluster)
