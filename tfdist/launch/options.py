"""The options of a launch, in one frozen dataclass whose defaults live here only.

`tfdist.launch`, `tfdist.launch.run`, the ``tfdist launch`` flags and a node of a
multi-node job all read their defaults from `LaunchOptions`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Sequence

from tfdist.checks import check_int, check_seconds
from tfdist.cluster import ClusterSpec, TaskSpec

DEFAULT_GRACE_SECONDS = 5.0
# Seconds an evaluator task may go on after training ended before it is stopped.
DEFAULT_EVALUATOR_WAIT_SECONDS = 120.0
DEFAULT_JOIN_TIMEOUT = 120.0
DEFAULT_ELASTIC_TIMEOUT = 600.0  # seconds, as Horovod's HOROVOD_ELASTIC_TIMEOUT


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How to run a job: its tasks, deadlines, restarts, environment and nodes.

    Attributes:
        workers: Number of ``worker`` tasks, >= 1 (multi-node: this node's).
        chief: Whether to add a ``chief`` task.
        ps: Number of ``ps`` tasks.
        evaluator: Whether to add an ``evaluator`` task (TF's role for side-car
            evaluation, e.g. `tfdist.keras.SidecarEvaluator`). It does not train: the
            job's outcome is the chief's and workers'. Single-node jobs only.
        evaluator_wait: Seconds the evaluator may run on after training ended (to
            evaluate the last checkpoints) before it is stopped like a ps task.
        timeout: Seconds before every task is killed; None for no deadline.
        max_restarts: How often a failed job is stopped and started again. In a
            multi-node job every node stops and rejoins node 0, which counts the
            restarts for all (every node must give the same number). In a
            parameter-server job a dead worker is restarted alone while restarts are
            left, and left out once none is (`tfdist.launch.restarts.PsWorkerRestarts`).
        env: Extra environment variables for every task.
        backup_dir: Exported as ``TFDIST_BACKUP_DIR`` so restarts resume from it.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping tasks.
        host: Address every task binds to.
        stream: Where prefixed task output goes (None: keep only the tails).
        log: Where the launcher's own messages go (None: stderr).
        cluster: A prebuilt `ClusterSpec` (addresses only) to use instead of free
            ports on ``host``; ``workers``, ``chief``, ``ps`` and ``evaluator`` are then
            read from it, and a port clash is not retried. For tasks on other
            interfaces, e.g. network namespaces.
        wrap: Called with each task's `TaskSpec`; returns an argv prefix for that
            task, e.g. ``["ip", "netns", "exec", "ns0"]`` to run it in a namespace.
        isolate_network: Run the job in a private network namespace where only its
            own loopback exists (`tfdist.launch.network.private_network`; needs root).
            TF's servers listen on 0.0.0.0: without this, other hosts can reach them.
        gpus_per_task: GPUs each task gets in ``CUDA_VISIBLE_DEVICES``; default: the
            node's GPUs (CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``) divided by its
            tasks. Without GPUs nothing is set.
        nnodes: Nodes (hosts) in the job.
        node_rank: This node's rank, 0..nnodes-1. Node 0 hosts the rendezvous.
        master: ``HOST:PORT`` of node 0's rendezvous; needed when ``nnodes`` > 1.
        node_addr: The address other nodes reach this node's tasks at (default: the
            address node 0 sees this node's connection come from).
        token: Shared rendezvous secret (default: $TFDIST_TOKEN; node 0 makes one and
            prints it when neither is set).
        join_timeout: Seconds for every node to join before each joined node fails,
            naming the missing ones.
        min_workers: Makes the job elastic (docs/elastic.md): a worker that dies is
            removed and the others train on while at least this many remain; each
            ``max_restarts`` starts a replacement that joins the running job. None: a
            failure stops the job (or restarts it whole). On several nodes it counts
            the whole job's workers, a lost host may leave and come back, and node 0
            hosts the membership at ``master`` (docs/elastic.md).
        max_workers: The most workers an elastic job may have (default: ``workers``;
            on several nodes ``nnodes`` x ``workers``); up to it, SIGUSR1 to the
            launcher adds a worker to the running job, or a node's launcher joins.
        elastic_timeout: Seconds an elastic job may stay below ``min_workers``
            before it fails, naming the missing workers.
    """

    workers: int = 1
    chief: bool = False
    ps: int = 0
    evaluator: bool = False
    evaluator_wait: float = DEFAULT_EVALUATOR_WAIT_SECONDS
    timeout: float | None = None
    max_restarts: int = 0
    env: dict | None = None
    backup_dir: str | os.PathLike | None = None
    grace_period: float = DEFAULT_GRACE_SECONDS
    host: str = "127.0.0.1"
    stream: Any = sys.stdout
    log: Any = None
    cluster: ClusterSpec | None = None
    wrap: Callable[[TaskSpec], Sequence[str]] | None = None
    isolate_network: bool = False
    gpus_per_task: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None
    node_addr: str | None = None
    token: str | None = None
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    min_workers: int | None = None
    max_workers: int | None = None
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT

    @property
    def is_elastic(self) -> bool:
        """Whether the job is elastic (``min_workers`` given)."""
        return self.min_workers is not None

    @property
    def is_multi_node(self) -> bool:
        """Whether this is one node of a multi-node job (``master`` or ``nnodes`` > 1)."""
        return self.master is not None or self.nnodes != 1

    def with_cluster_counts(self) -> "LaunchOptions":
        """These options with the task counts read from ``cluster`` (if one is given).

        Raises:
            ValueError: ``cluster`` is not a `ClusterSpec`.
        """
        if self.cluster is None:
            return self
        if not isinstance(self.cluster, ClusterSpec):
            raise ValueError(f"cluster must be a tfdist.ClusterSpec. Received: {self.cluster!r}")
        cluster = dataclasses.replace(self.cluster, task=None)
        return dataclasses.replace(self, cluster=cluster, workers=len(cluster.worker),
                                   chief=bool(cluster.chief), ps=len(cluster.ps),
                                   evaluator=bool(cluster.evaluator))

    def check(self) -> None:
        """Checks the task counts and the deadlines.

        Raises:
            ValueError: one is out of range, named with what was received.
        """
        check_int("workers", self.workers, 1)
        check_int("ps", self.ps, 0)
        check_seconds("timeout", self.timeout, allow_none=True)
        check_int("max_restarts", self.max_restarts, 0)
        check_seconds("evaluator_wait", self.evaluator_wait)
        if self.max_workers is not None and self.min_workers is None:
            raise ValueError("max_workers is for elastic jobs: give min_workers too. "
                             f"Received: max_workers={self.max_workers}, min_workers=None")
        if self.min_workers is not None:
            check_int("min_workers", self.min_workers, 1)
            # On several nodes ``workers`` counts this node's; the bounds count the job's.
            nodes = f" x nnodes={self.nnodes}" if self.nnodes > 1 else ""
            total = self.workers * max(self.nnodes, 1)
            if self.min_workers > total:
                raise ValueError(f"min_workers must be <= workers{nodes}. Received: "
                                 f"min_workers={self.min_workers}, workers={self.workers}")
            if self.max_workers is not None and self.max_workers < self.workers:
                raise ValueError(f"max_workers must be >= workers. Received: max_workers="
                                 f"{self.max_workers}, workers={self.workers}")
            check_seconds("elastic_timeout", self.elastic_timeout)
            if self.ps or self.evaluator:
                raise ValueError("an elastic job (min_workers) trains with workers (and a "
                                 "chief) only, through engine='horovod'. Received: "
                                 f"ps={self.ps}, evaluator={self.evaluator}")


DEFAULTS = LaunchOptions()


def resolve_options(options: LaunchOptions | None, fields: dict) -> LaunchOptions:
    """``options`` (default: `DEFAULTS`) with ``fields`` replaced, counts read from its
    cluster, and checked.

    Raises:
        ValueError: an option is out of range.
        TypeError: a field is not a `LaunchOptions` field.
    """
    options = dataclasses.replace(options or DEFAULTS, **fields).with_cluster_counts()
    options.check()
    return options
