"""Node 0 of a multi-node elastic job: its own workers, and the membership of every node's.

Node 0 runs `ElasticHub`, the one-host `ElasticRestarts` with the membership service at
``--master``, where the other nodes' launchers beat (`tfdist.launch.elastic_wire`). The
first membership waits for every node (up to ``--join-timeout``). Then:

- a worker that exits on another node is removed like a local one, and while
  ``max_restarts`` allow node 0 orders its node to start a replacement;
- a node silent for `NODE_TIMEOUT` seconds (its host lost, or cut off) is dropped with
  all its workers, and the others carry on while ``min_workers`` remain; a node whose
  launcher ended says so in its last beat, and is not waited for;
- a node that comes back (its launcher started again, or a dropped one that reconnects)
  joins the running job with its workers, up to ``max_workers``, under the names its
  rank had before when they are free.

Node 0 itself must stay: it hosts the membership and Gloo's rendezvous, as Horovod's
driver does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import time
from typing import Iterator

from tfdist.cluster import TRAINING_TASK_TYPES
from tfdist.launch.elastic import ElasticRestarts
from tfdist.launch.elastic_wire import (ASSIGN_SCOPE, BEAT_SECONDS, NODE_SCOPE, NODE_TIMEOUT,
                                        FreshBeats, sign, verify)
from tfdist.launch.results import LaunchError, exit_cause
from tfdist.wire import quote


@dataclasses.dataclass
class RemoteNode:
    """What node 0 knows of another node's launcher (one incarnation of it)."""

    rank: int
    incarnation: str
    addr: str
    names: list[str]
    beat: int = -1
    seen: float = dataclasses.field(default_factory=time.monotonic)
    exited: dict = dataclasses.field(default_factory=dict)  # name -> [start, code]
    starts: dict = dataclasses.field(default_factory=dict)  # name -> start ordered
    handled: set = dataclasses.field(default_factory=set)  # (name, start) exits acted on
    kill: list = dataclasses.field(default_factory=list)  # [name, start] to SIGKILL
    dropped: bool = False
    ended: bool = False  # its launcher said it ended (its last beat)

    def answer(self, cluster, ended: str | None) -> dict:
        """What node 0 tells this node (`tfdist.launch.elastic_node`)."""
        return {"incarnation": self.incarnation, "names": self.names,
                "cluster": cluster.to_dict(), "starts": self.starts, "kill": self.kill,
                "dropped": self.dropped, "ended": ended}


class ElasticHub(ElasticRestarts):
    """`ElasticRestarts` on node 0 of a multi-node job (see the module's words).

    Args:
        max_restarts: Replacement workers allowed over the whole job (every node).
        log: Where the launcher's messages go.
        host: Node 0's address: the membership service listens there, and node 0's
            workers use it.
        port: The membership service's port (``--master``'s).
        token: The shared secret of every node's messages.
        nnodes: Nodes the first membership waits for.
        join_timeout: Seconds the first membership waits for every node.
        **bounds: ``min_workers``, ``max_workers``, ``elastic_timeout`` (of the job).
    """

    def __init__(self, max_restarts: int, log, *, host: str, port: int, token: str,
                 nnodes: int, join_timeout: float, **bounds):
        super().__init__(max_restarts, log, host=host, port=port, **bounds)
        self.token, self.nnodes, self.join_timeout = token, nnodes, join_timeout
        self.nodes: dict[int, RemoteNode] = {}
        self.names_of: dict[int, list[str]] = {}  # names each rank held, for its return
        self.refused: dict[int, str] = {}  # rank -> why its newest launcher was refused
        self.started = time.monotonic()
        self.ended: str | None = None  # "done" or "failed", once node 0's attempt ended
        self.tasks: list = []

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        with super().attempt():
            self.nodes, self.started, self.ended = {}, time.monotonic(), None
            try:
                yield
            finally:  # tell every node how the job ended before the service closes
                trained = all(t.poll() == 0 for t in self.tasks if not self.is_lost(t)
                              and t.spec.type in TRAINING_TASK_TYPES)
                self.ended = "done" if trained and self.others_done(self.tasks) else "failed"
                self._answer()
                time.sleep(2 * BEAT_SECONDS)

    def check(self, tasks: list) -> None:
        self.tasks = tasks
        if self.server.version == 0:
            self._form(tasks)
            return
        self.take_in_joiners()
        self._kill_frozen(tasks)
        self._check_size()

    def signed_scopes(self) -> dict:
        """The nodes' heartbeats: signed, and fresh (`FreshBeats`)."""
        return {NODE_SCOPE: FreshBeats()}

    def grow(self, tasks: list, cluster, start) -> None:
        self.grown = self.grown or cluster
        super().grow(tasks, cluster, start)
        self._read_beats()
        if self.server.version > 0:
            for node in self.nodes.values():
                if node.ended and not node.dropped and not self._finished(node):
                    self._drop(node, f"node {node.rank}'s launcher ended")
                elif not node.dropped and not node.ended and not self._finished(node) and \
                        time.monotonic() - node.seen > NODE_TIMEOUT:
                    self._drop(node, f"node {node.rank} ({node.addr}) sent no heartbeat "
                                     f"for {NODE_TIMEOUT:g}s: its host is lost or cut off")
        self._answer()

    def others_done(self, tasks: list) -> bool:
        """Whether every member on another node exited 0."""
        return all(self._finished(node) for node in self.nodes.values() if not node.dropped)

    def _finished(self, node: RemoteNode) -> bool:
        """Whether every member on ``node`` exited 0."""
        members = {name for name, _ in self.members}
        return all(node.exited.get(name) == [node.starts[name], 0]
                   for name in node.names if name in members)

    # ---- forming ---------------------------------------------------------------------
    def _form(self, tasks: list) -> None:
        """Publishes the first membership once every node joined (or, after the join
        timeout, enough of them)."""
        joined = sorted(rank for rank, node in self.nodes.items() if not node.dropped)
        local = [(t.name, self.host) for t in tasks if t.spec.type in TRAINING_TASK_TYPES]
        remote = [(name, self.nodes[rank].addr) for rank in joined
                  for name in self.nodes[rank].names]
        waited = time.monotonic() - self.started
        if len(joined) < self.nnodes - 1 and waited < self.join_timeout:
            return
        missing = sorted(set(range(1, self.nnodes)) - set(joined))
        if missing and len(local) + len(remote) < self.min_workers:
            why = "; ".join(f"node {r}: {self.refused[r]}" for r in missing
                            if r in self.refused)
            raise LaunchError(
                f"node(s) {', '.join(map(str, missing))} of the elastic job did not join "
                f"within --join-timeout {self.join_timeout:g}s, and the others have "
                f"{len(local) + len(remote)} worker(s), below --min-workers "
                f"{self.min_workers}" + (f" ({why})" if why else ""))
        if missing:
            print(f"tfdist launch: node(s) {', '.join(map(str, missing))} did not join "
                  f"within --join-timeout {self.join_timeout:g}s: the elastic job starts "
                  "without them (they join when their launchers reach node 0)",
                  file=self.log, flush=True)
        self.members = local + remote
        self.server.publish(self.members)

    # ---- heartbeats ------------------------------------------------------------------
    def _read_beats(self) -> None:
        for key, raw in self.server.read(NODE_SCOPE).items():
            beat = verify(self.token, raw)
            problem = _beat_problem(beat, key, self.nnodes)
            if problem:
                if self.refused.get(key) != problem:
                    self.refused[key] = problem
                    print(f"tfdist launch: ignored a heartbeat at /{NODE_SCOPE}/"
                          f"{quote(key, 20)}: {problem}", file=self.log, flush=True)
                continue
            node = self.nodes.get(beat["rank"])
            if node is None or node.incarnation != beat["incarnation"]:
                if node is not None and not node.dropped:
                    self._drop(node, f"node {node.rank}'s launcher was started again")
                node = self._admit(beat)
                if node is None:
                    continue
            if beat["beat"] > node.beat:
                node.beat, node.seen, node.exited = beat["beat"], time.monotonic(), \
                    beat["exited"]
                node.ended = beat.get("ended") is True
            if not node.dropped:
                self._note_exits(node, beat["exited"])

    def _admit(self, beat: dict) -> RemoteNode | None:
        """Takes in a node's (new) launcher: names its workers, publishes them (once the
        job has formed) as the youngest members."""
        rank, wanted = beat["rank"], beat["workers"]
        members = {name for name, _ in self.members}
        cluster = self.grown
        taken = len(self.members) if self.server.version else \
            len(cluster.worker) + len(cluster.chief or ())  # every name given out so far
        room = self.max_workers - taken
        if room < 1:
            self.refused[rank] = (f"the elastic job already has --max-workers "
                                  f"{self.max_workers} workers")
            print(f"tfdist launch: node {rank} ({beat['addr']}) asked to join, but "
                  f"{self.refused[rank]}: none added", file=self.log, flush=True)
            return None
        names = [n for n in self.names_of.get(rank, []) if n not in members]
        names = names[:min(wanted, room)]
        workers = list(cluster.worker)
        for port in beat["ports"][len(names):min(wanted, room)]:
            names.append(f"worker-{len(workers)}")
            workers.append(f"{beat['addr']}:{port}")
        for name, port in zip(names, beat["ports"]):
            workers[int(name.split("-")[1])] = f"{beat['addr']}:{port}"
        self.grown = dataclasses.replace(cluster, worker=tuple(workers))
        node = RemoteNode(rank, beat["incarnation"], beat["addr"], names,
                          starts={name: 0 for name in names})
        self.nodes[rank] = node
        self.names_of[rank] = sorted(set(self.names_of.get(rank, [])) | set(names))
        self.refused.pop(rank, None)
        if self.server.version:
            self._publish(self.members + [(name, node.addr) for name in names])
            print(f"tfdist launch: node {rank} ({node.addr}) joins the running elastic job "
                  f"with {', '.join(names)} ({len(self.members)} workers)",
                  file=self.log, flush=True)
        return node

    def _note_exits(self, node: RemoteNode, exited: dict) -> None:
        """Acts on the exits a node reported: a non-zero one removes the worker."""
        members = {name for name, _ in self.members}
        for name, (start, code) in exited.items():
            if name not in node.starts or start != node.starts[name] or \
                    (name, start) in node.handled or code == 0:
                continue
            node.handled.add((name, start))
            if name not in members:
                continue
            outcome = self.lose(name, node.addr, f"{exit_cause(name, code)} on node "
                                                 f"{node.rank}")
            if outcome is None:
                raise LaunchError(f"{self.removed[-1]}; no worker is left and no restart "
                                  f"({self.spent}/{self.max_restarts} used)",
                                  task=name, returncode=code)
            if outcome:
                node.starts[name] += 1

    def _drop(self, node: RemoteNode, cause: str) -> None:
        """Removes a node's workers from the job, in one membership."""
        node.dropped = True
        members = [(n, h) for n, h in self.members if n not in node.names]
        gone = [n for n, _ in self.members if n in node.names]
        self.removed.append(f"{cause} ({', '.join(gone) or 'no member'})")
        if not members and self.server.version:
            self.below_since = self.below_since or time.monotonic()
        self._carry_on(members, f"{cause}: {', '.join(gone) or 'none of its workers'} "
                                "removed", "a lost host's workers start again when "
                                           "its launcher does")

    def _kill_member(self, name: str, tasks: list) -> bool:
        for node in self.nodes.values():
            if name in node.names and not node.dropped:
                order = [name, node.starts[name]]
                if order not in node.kill:
                    node.kill.append(order)
                return True
        return super()._kill_member(name, tasks)

    def _answer(self) -> None:
        """Serves every node its answer (again: each membership clears the store)."""
        for rank, node in self.nodes.items():
            self.server.put(ASSIGN_SCOPE, str(rank),
                            sign(self.token, node.answer(self.grown, self.ended)))


def _beat_problem(beat: dict | None, key: str, nnodes: int) -> str | None:
    """Why ``beat`` (PUT at ``key``) cannot be used, or None."""
    if beat is None:
        return "its signature is not the job's token (--token / TFDIST_TOKEN)"
    rank = beat.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or str(rank) != key or \
            not 0 < rank < nnodes:
        return f"its rank must be 1..{nnodes - 1} and match its key"
    workers, ports = beat.get("workers"), beat.get("ports")
    if not isinstance(workers, int) or not 0 < workers <= 1024 or \
            not isinstance(ports, list) or len(ports) != workers or \
            not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        return "it needs a worker count and as many ports"
    try:
        ipaddress.ip_address(beat.get("addr"))
    except ValueError:
        return f"its address must be an IP address. Received: {quote(beat.get('addr'), 40)}"
    if not isinstance(beat.get("incarnation"), str) or not isinstance(beat.get("beat"), int):
        return "it needs an incarnation and a beat count"
    if not isinstance(beat.get("ended", False), bool):
        return "its ended must be true or false"
    exited = beat.get("exited")
    if not isinstance(exited, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(i, int) for i in v)
            for v in exited.values()):
        return "its exits must map names to [start, code]"
    return None
