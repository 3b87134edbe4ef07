"""A node other than node 0 in a multi-node elastic job: beat, run what node 0 says.

The node's launcher beats to node 0 (`tfdist.launch.elastic_wire`) from a thread, gets
its workers' names and cluster, and starts them; they join the membership that node 0
publishes. How a worker exits goes into the next beat, and node 0 decides: it may order
a replacement (started here under the same name), or a kill (a frozen worker). A node
that node 0 dropped (it was silent too long, e.g. its network was cut), or that heard
nothing from node 0 for `NODE_TIMEOUT` seconds (node 0 drops it then too), stops its
workers and joins again as a new launcher, with new workers: a network cut that heals
within ``--join-timeout`` ends in a join. Its launcher ends when its workers exited 0,
or when node 0 says the job ended; it fails when node 0 does not take it back within
``--join-timeout`` (node 0 is lost).
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import threading
import time
import urllib.error

from tfdist import env
from tfdist.cluster import ClusterSpec, TaskSpec
from tfdist.launch.attempt import run_attempt
from tfdist.engines.horovod.membership import SCOPE
from tfdist.launch.elastic_wire import (ASSIGN_SCOPE, BEAT_SECONDS, NODE_SCOPE, NODE_TIMEOUT,
                                        get, outward_address, put, sign, verify)
from tfdist.launch.gpus import elastic_gpu_env
from tfdist.launch.network import find_free_ports
from tfdist.launch.options import LaunchOptions
from tfdist.launch.process import command_env
from tfdist.launch.rendezvous import parse_master, resolve_token
from tfdist.launch.restarts import JobRestarts
from tfdist.launch.results import LaunchError, LaunchResult, exit_cause, launch_result
from tfdist.launch.usr1 import IgnoredUsr1


class NodeBeats:
    """This node's heartbeat to node 0, and node 0's latest answer, in a daemon thread.

    Args:
        master: Node 0's ``HOST:PORT``.
        token: The job's shared secret.
        rank: This node's rank (1..nnodes-1).
        addr: This node's address as the other nodes reach it.
        workers: Workers this node runs.
    """

    def __init__(self, master: str, token: str, rank: int, addr: str, workers: int):
        self.master, self.token, self.rank = master, token, rank
        self.message = {"rank": rank, "addr": addr, "workers": workers,
                        "ports": find_free_ports(workers, "0.0.0.0"),
                        "incarnation": secrets.token_hex(8), "beat": 0, "exited": {},
                        "service": None, "ended": False}
        self.answer: dict | None = None
        self.contact = time.monotonic()  # last time node 0 answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tfdist-elastic-beat",
                                        daemon=True)
        self._thread.start()

    def exited(self, name: str, start: int, code: int) -> None:
        """Reports how the ``start``-th process of worker ``name`` ended."""
        self.message["exited"] = {**self.message["exited"], name: [start, code]}

    def _beat(self) -> None:
        """PUTs the next beat, signed for node 0's current service (read first)."""
        if self.message["service"] is None:
            state = json.loads(get(self.master, SCOPE, "state"))
            self.message["service"] = state["service"]
        self.message["beat"] += 1
        try:
            put(self.master, NODE_SCOPE, str(self.rank), sign(self.token, self.message))
        except urllib.error.HTTPError as error:
            if error.code == 403:  # node 0 serves anew (a restart): read its id again
                self.message["service"] = None
            raise

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat()
                answer = verify(self.token, get(self.master, ASSIGN_SCOPE, str(self.rank)))
                if answer is not None and \
                        answer.get("incarnation") == self.message["incarnation"]:
                    self.answer = answer
                    self.contact = time.monotonic()
            except (OSError, ValueError, KeyError):
                pass  # node 0 is busy, or has not answered this launcher yet
            self._stop.wait(BEAT_SECONDS)

    def wait_for_answer(self, timeout: float, rejoin: str | None = None) -> dict:
        """Node 0's first answer (this node's names and cluster).

        Args:
            timeout: Seconds to wait.
            rejoin: Why this node joins again (`_Dropped`), or None the first time.

        Raises:
            LaunchError: none came within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while self.answer is None:
            if time.monotonic() > deadline and rejoin is not None:
                raise LaunchError(
                    f"node {self.rank}: {rejoin}, and node 0 did not take this node back "
                    f"within --join-timeout {timeout:g}s: node 0 is lost (its launcher "
                    "ended, or the network stays cut); this node's workers were stopped")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"node {self.rank}: node 0 at {self.master} did not take this node "
                    f"into the elastic job within --join-timeout {timeout:g}s (is node 0's "
                    "launcher running, with the same --token, and below --max-workers? "
                    "Node 0's output says why it refused a node)")
            time.sleep(0.05)
        return self.answer

    def close(self) -> None:
        """Stops beating, after a last beat that carries the final exits and says this
        launcher ended (node 0 stops expecting it at once)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.message["ended"] = True
        try:
            self._beat()
        except (OSError, ValueError, KeyError):
            pass  # node 0 ended first


class _Dropped(Exception):
    """Node 0 dropped this node, or was silent for `NODE_TIMEOUT` seconds (then it drops
    this node too): join again with a new launcher incarnation. Its text says which."""


class ElasticNode(JobRestarts):
    """The restart policy of a node's workers in a multi-node elastic job: node 0
    decides (see the module's words).

    Args:
        beats: This node's `NodeBeats`.
        log: Where the launcher's messages go.
        master: Node 0's ``HOST:PORT`` (the membership service the workers join).
        elastic_timeout: ``--elastic-timeout``, for the workers.
    """

    def __init__(self, beats: NodeBeats, log, master: str, elastic_timeout: float):
        super().__init__(0, log)
        self.beats, self.master, self.elastic_timeout = beats, master, elastic_timeout
        self.starts = {name: 0 for name in beats.answer["names"]}
        self.lost: set[int] = set()
        self.killed: list = []

    def task_env(self, task_restart: int) -> dict[str, str]:
        return {env.ELASTIC_ADDR: self.master, env.ENGINE: "horovod",
                env.TOKEN: self.beats.token, "HOROVOD_ELASTIC_TIMEOUT": f"{self.elastic_timeout:g}",
                env.TASK_RESTART: str(task_restart)}

    def check(self, tasks: list) -> None:
        answer = self.beats.answer
        self._note_finished(tasks)
        if answer["dropped"]:
            raise _Dropped(f"node 0 dropped node {self.beats.rank} (it was silent for over "
                           f"{NODE_TIMEOUT:g}s)")
        if answer["ended"] == "failed":
            raise LaunchError(f"node {self.beats.rank}: the elastic job failed on node 0 "
                              "(its output says why); this node's workers were stopped")
        silent = time.monotonic() - self.beats.contact
        if silent > NODE_TIMEOUT and answer["ended"] != "done":
            raise _Dropped(f"node {self.beats.rank} heard nothing from node 0 at "
                           f"{self.master} for {silent:.0f}s (the network was cut, or node "
                           f"0's launcher ended; node 0 drops a node silent for "
                           f"{NODE_TIMEOUT:g}s)")
        for name, start in answer["kill"]:
            for task in tasks:
                if task.name == name and self.starts[name] == start and \
                        [name, start] not in self.killed and task.poll() is None:
                    self.killed.append([name, start])
                    print(f"tfdist launch: node 0 found {name} frozen: killing it",
                          file=self.log, flush=True)
                    task.signal_group(signal.SIGKILL)

    def grow(self, tasks: list, cluster, start) -> None:
        """Starts the replacements node 0 ordered, under the same names."""
        answer = self.beats.answer
        grown = ClusterSpec.from_dict(answer["cluster"])
        for name, ordered in answer["starts"].items():
            if ordered > self.starts.get(name, 0):
                self.starts[name] = ordered
                old = next(t for t in tasks if t.name == name)
                print(f"tfdist launch: node 0 starts a replacement for {name} here",
                      file=self.log, flush=True)
                tasks[tasks.index(old)] = start(old.spec, ordered, grown)

    def replace(self, tasks: list, failed, start) -> bool:
        failed.finish_output()
        self.beats.exited(failed.name, self.starts[failed.name], failed.poll())
        self.lost.add(id(failed))
        print(f"tfdist launch: {exit_cause(failed.name, failed.poll())}; node 0 decides "
              "whether a replacement starts", file=self.log, flush=True)
        return True

    def is_lost(self, task) -> bool:
        return id(task) in self.lost

    def _note_finished(self, tasks: list) -> None:
        for task in tasks:
            if task.poll() == 0:
                self.beats.exited(task.name, self.starts[task.name], 0)

    def others_done(self, tasks: list) -> bool:
        """A node whose workers were lost waits for a replacement or the job's end."""
        self._note_finished(tasks)  # the last beat carries every exit
        return self.beats.answer["ended"] == "done" or \
            not any(self.is_lost(t) for t in tasks)


def run_elastic_node(argv, options: LaunchOptions) -> LaunchResult:
    """Runs this node's workers of a multi-node elastic job (``node_rank`` > 0).

    Returns:
        A `LaunchResult` of this node's workers (its last incarnation's).

    Raises:
        LaunchError: node 0 did not take the node in within ``join_timeout``, went
            silent, or the job failed there; or the timeout passed.
    """
    log = options.log or sys.stderr
    host, port = parse_master(options.master)
    token = resolve_token(options.token, options.node_rank, log)
    addr = options.node_addr or outward_address(host, port)
    with IgnoredUsr1(log):  # while it waits for node 0 too (`run_attempt` says it)
        return _run_node(argv, options, log, token, addr)


def _run_node(argv, options: LaunchOptions, log, token: str, addr: str) -> LaunchResult:
    """`run_elastic_node` after its checks: joins, runs, and joins again when dropped."""
    rejoin = None  # why this node joins again, after the first time
    while True:
        beats = NodeBeats(options.master, token, options.node_rank, addr, options.workers)
        try:
            answer = beats.wait_for_answer(options.join_timeout, rejoin)
            cluster = ClusterSpec.from_dict(answer["cluster"])
            specs = [TaskSpec("worker", int(name.split("-")[1])) for name in answer["names"]]
            print(f"tfdist launch: node {options.node_rank} ({addr}): running "
                  f"{', '.join(answer['names'])} of the elastic job at {options.master}",
                  file=log, flush=True)
            pins = elastic_gpu_env(options.workers, command_env(options.env),
                                   options.gpus_per_task)
            local = {spec.name: i for i, spec in enumerate(specs)}

            def extra_env(spec: TaskSpec) -> dict[str, str]:
                return {env.NODE_RANK: str(options.node_rank), env.NNODES: str(options.nnodes),
                        env.LOCAL_RANK: str(local[spec.name]),
                        **pins(TaskSpec("worker", local[spec.name]))}

            policy = ElasticNode(beats, log, options.master, options.elastic_timeout)
            try:
                tasks, failed, timed_out = run_attempt(list(argv), cluster, options, 0, policy,
                                                       specs=specs, extra_env=extra_env)
            except _Dropped as dropped:
                rejoin = str(dropped)
                print(f"tfdist launch: {rejoin}; its workers were stopped, and it joins the "
                      f"job again (node 0 must take it back within --join-timeout "
                      f"{options.join_timeout:g}s)", file=log, flush=True)
                continue
        finally:
            beats.close()
        if timed_out:
            raise LaunchError(f"job timed out on node {options.node_rank} after "
                              f"{options.timeout:g}s; this node's workers were stopped")
        return launch_result(tasks, 1, cluster)
