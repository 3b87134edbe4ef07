"""A multi-node run: this node's tasks of a job that meets at node 0's rendezvous.

Every node runs the same call with its own ``node_rank``; node 0 also hosts the
rendezvous (`tfdist.launch.rendezvous`). A failure on any node stops every node; with
``max_restarts`` node 0 decides a restart for all, and every node rejoins.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

from tfdist import env
from tfdist.checks import check_int
from tfdist.cluster import TaskSpec
from tfdist.launch.attempt import run_attempt
from tfdist.launch.gpus import gpu_env
from tfdist.launch.network import find_free_ports
from tfdist.launch.options import LaunchOptions
from tfdist.launch.process import command_env
from tfdist.launch.rendezvous import (NodeLink, RendezvousServer, join, parse_master,
                                      resolve_token)
from tfdist.launch.rendezvous.wire import describe_stop
from tfdist.launch.restarts import NodePsWorkers
from tfdist.launch.results import (LaunchError, LaunchResult, announce_restart,
                                   failure_cause, launch_result)

_DECISION_SECONDS = 30.0  # a node whose task failed waits this long for node 0's word


def run_node(argv: Sequence[str], options: LaunchOptions) -> LaunchResult:
    """Runs this node's share of a multi-node job (``options.nnodes`` > 1 or ``master``).

    ``options.workers``, ``chief`` and ``ps`` count this node's tasks. With
    ``max_restarts``, a failure on any node restarts the whole job: node 0 decides (the
    same restart count for every node), every node stops its tasks and rejoins with
    fresh ports within ``join_timeout``, and the tasks start again with a new TF_CONFIG
    (``TFDIST_RESTART`` counts the restarts; ``backup_dir`` is exported as
    ``TFDIST_BACKUP_DIR``, so a job with `BackupAndRestore` resumes).

    Returns:
        A `LaunchResult` (this node's tasks; the whole cluster).

    Raises:
        LaunchError: a task failed on some node (named, with its node) and no restart
            was left, node 0 went away, or the timeout passed.
        RendezvousError: the job could not form (refused, a node missing), at its start
            or at a restart.
        ValueError: bad options.
    """
    _check(options)
    if options.is_elastic:
        return _run_elastic(argv, options)
    nnodes, node_rank, master = options.nnodes, options.node_rank, options.master
    log = options.log or sys.stderr
    token = resolve_token(options.token, node_rank, log)
    counts = {"chief": int(options.chief), "worker": options.workers, "ps": options.ps}
    server = None
    if node_rank == 0:
        host, port = parse_master(master)
        server = RendezvousServer(host, port, nnodes, token, options.join_timeout, log,
                                  options.max_restarts).start()

    def free_ports() -> list[int]:
        # TF's servers listen on 0.0.0.0 whatever the cluster says: pick ports free there.
        return find_free_ports(sum(counts.values()), "0.0.0.0")

    link = None
    try:
        link = join(master, rank=node_rank, nnodes=nnodes, token=token, counts=counts,
                    ports=free_ports(), addr=options.node_addr, timeout=options.join_timeout,
                    max_restarts=options.max_restarts)
        while True:
            print(f"tfdist launch: node {node_rank}/{nnodes}: running "
                  f"{', '.join(s.name for s in link.tasks) or 'no task'} of "
                  f"{link.cluster.jobs()}\n", end="", file=log, flush=True)
            pins = gpu_env(link.tasks, command_env(options.env), options.gpus_per_task)

            def extra_env(spec: TaskSpec) -> dict[str, str]:
                return {env.NODE_RANK: str(node_rank), env.NNODES: str(nnodes),
                        env.LOCAL_RANK: str(link.local_ranks[spec.name]),
                        **pins[spec.name]}

            started = time.monotonic()
            policy = _ps_policy(link, options, log)
            tasks, failed, timed_out = run_attempt(
                list(argv), link.cluster, options, link.round, policy, specs=link.tasks,
                extra_env=extra_env, peers=link)
            if failed is not None or timed_out:
                link.wait_for_decision(_DECISION_SECONDS)  # our own failure: node 0 decides
            if link.restart is None:
                note = "" if policy is None or failed is None else policy.failure_note(failed)
                return _outcome(link, tasks, failed, timed_out, node_rank,
                                time.monotonic() - started, options, note)
            note = "; restarting every task on every node"
            if link.stop.get("lost"):
                note += (f" once node {link.stop['node']} rejoins (start its launcher again "
                         f"within {options.join_timeout:g}s)")
            announce_restart(log, link.restart, link.stop["max_restarts"],
                             _restart_cause(link.stop), note)
            # node 0 gives up at join_timeout
            link.rejoin(free_ports(), options.join_timeout + 30)
    finally:
        if link is not None:
            link.close()
        if server is not None:
            server.close()


def _run_elastic(argv: Sequence[str], options: LaunchOptions) -> LaunchResult:
    """A node of a multi-node elastic job: node 0 hosts the membership at ``master``
    (`tfdist.launch.elastic_hub`), the others beat to it (`tfdist.launch.elastic_node`)."""
    if options.node_rank > 0:
        from tfdist.launch.elastic_node import run_elastic_node

        return run_elastic_node(argv, options)
    from tfdist.launch.elastic_hub import ElasticHub
    from tfdist.launch.local import run as run_local

    log = options.log or sys.stderr
    host, port = parse_master(options.master)
    addr = options.node_addr or host
    policy = ElasticHub(
        options.max_restarts, log, host=addr, port=port,
        token=resolve_token(options.token, 0, log), nnodes=options.nnodes,
        join_timeout=options.join_timeout, min_workers=options.min_workers,
        max_workers=options.max_workers or options.nnodes * options.workers + options.chief,
        elastic_timeout=options.elastic_timeout)
    return run_local(argv, dataclasses.replace(options, host=addr), policy=policy)


def _ps_policy(link: NodeLink, options: LaunchOptions, log) -> NodePsWorkers | None:
    """A parameter-server job with no restart left carries on without a dead worker
    (`NodePsWorkers`); otherwise (None) any failure stops every node, as node 0 decides."""
    cluster = link.cluster
    if not (cluster.chief and cluster.ps) or link.round < options.max_restarts:
        return None
    here = sum(spec.type == "worker" for spec in link.tasks)
    return NodePsWorkers(options.max_restarts, log, restarts_done=link.round,
                         other_workers=len(cluster.worker) - here)


def _restart_cause(stop: dict) -> str:
    """``worker-1 on node 1 exited with code 3`` (or `describe_stop` when no task failed)."""
    task, reason = stop.get("task"), str(stop.get("reason"))
    if task and reason.startswith(task):
        return f"{task} on node {stop['node']}{reason[len(task):]}"
    return describe_stop(stop)


def _check(options: LaunchOptions) -> None:
    """Checks what a multi-node job needs, naming what was received.

    Raises:
        ValueError: no master, an unsupported option, or a bad rank or join timeout.
    """
    nnodes, node_rank = options.nnodes, options.node_rank
    if options.evaluator:
        raise ValueError("an evaluator task runs in single-node jobs only; run it as "
                         "a job of its own (or in the chief's process) on a multi-node "
                         f"job. Received: evaluator=True, nnodes={nnodes!r}")
    if options.master is None:
        raise ValueError(f"a multi-node job needs master='HOST:PORT' (node 0's rendezvous). "
                         f"Received: nnodes={nnodes!r}, master=None")
    unsupported = {"cluster": options.cluster, "isolate_network": options.isolate_network}
    given = {k: v for k, v in unsupported.items() if v}
    if given:
        raise ValueError(f"a multi-node job does not support {', '.join(given)} yet. "
                         f"Received: {given}")
    check_int("nnodes", nnodes, 1)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or \
            not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} for nnodes={nnodes}. "
                         f"Received: node_rank={node_rank!r}")
    if options.chief and node_rank != 0:
        raise ValueError(f"only node 0 may run the chief (--chief). "
                         f"Received: chief=True on node_rank={node_rank}")
    if not options.join_timeout > 0:
        raise ValueError(f"join_timeout must be > 0 seconds. "
                         f"Received: join_timeout={options.join_timeout!r}")
    parse_master(options.master)


def _outcome(link: NodeLink, tasks, failed, timed_out, node_rank, spent,
             options: LaunchOptions, note: str = "") -> LaunchResult:
    """This node's `LaunchResult`, or the `LaunchError` that names what failed where."""
    def error(message, task=None, code=None, tail=""):
        return LaunchError(message, task=task, returncode=code, output_tail=tail,
                           attempts=link.round + 1)

    max_restarts = options.max_restarts
    stopped = "every task on every node was stopped"
    spent_all = f"; no restart left ({link.round}/{max_restarts} used)" if max_restarts else ""
    if failed is not None:
        code = failed.poll()
        reason = failure_cause(failed.name, code, failed.tail_text()) + note
        raise error(f"{reason} on node {node_rank} after {spent:.1f}s; {stopped}{spent_all}. "
                    f"Last output of {failed.name}:\n{failed.tail_text()}",
                    failed.name, code, failed.tail_text())
    if timed_out:
        raise error(f"job timed out on node {node_rank} after {options.timeout:g}s; {stopped}"
                    f"{spent_all}")
    if link.stop is not None:
        raise error(f"{describe_stop(link.stop)}; {stopped} (this is node {node_rank})"
                    f"{spent_all}", link.stop.get("task"))
    if link.lost:
        raise error(f"node {node_rank} lost its connection to node 0 at {link.master} (its "
                    "launcher ended, or the network failed); this node's tasks were stopped")
    return launch_result(tasks, link.round + 1, link.cluster)
