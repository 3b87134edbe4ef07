"""Who and where: cluster and task descriptions, TF_CONFIG, and resolvers.

This module does no TensorFlow work. `ClusterSpec` is the one description of a
job that the launcher writes, the strategies read, and TF_CONFIG carries.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import reprlib
import warnings
from typing import Any, Mapping

from tfdist import env
from tfdist.checks import check_int

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
# The tasks that train (run replicas); ps and evaluator tasks do not.
TRAINING_TASK_TYPES = ("chief", "worker")
DEFAULT_SLURM_PORT = 8470


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of a cluster: its role and its index within that role."""

    type: str
    index: int = 0

    def __post_init__(self):
        if self.type not in TASK_TYPES:
            raise ValueError(
                f"task type must be one of {list(TASK_TYPES)}. Received: type={self.type!r}")
        check_int("index", self.index, 0, field="task index")

    @property
    def name(self) -> str:
        """The task's display name, e.g. ``worker-1``."""
        return f"{self.type}-{self.index}"


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A whole job: the address of every task, and which task this process is.

    Attributes:
        chief: Address of the chief, at most one.
        worker: Addresses of the workers.
        ps: Addresses of the parameter servers.
        evaluator: Address of the evaluator, at most one.
        task: This process's task, or None for a description of the cluster only.
    """

    chief: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    ps: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()
    task: TaskSpec | None = None

    def __post_init__(self):
        for task_type in TASK_TYPES:
            addresses = getattr(self, task_type)
            if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
                raise ValueError(f"cluster.{task_type} must be a list of 'host:port' strings. "
                                 f"Received: {task_type}={addresses!r}")
            object.__setattr__(self, task_type, tuple(addresses))
            for address in addresses:
                validate_address(address, field=f"cluster.{task_type}")
        if len(self.chief) > 1:
            raise ValueError(f"a cluster has at most one chief. Received: chief={list(self.chief)}")
        if len(self.evaluator) > 1:
            raise ValueError("a cluster has at most one evaluator. "
                             f"Received: evaluator={list(self.evaluator)}")
        if not self.chief and not self.worker:
            raise ValueError("a cluster needs at least one worker (or a chief). "
                             f"Received: cluster={self.jobs()}")
        seen: dict[str, tuple[str, str]] = {}
        for task_type, index, address in self.addresses():
            key = _endpoint_key(address)
            if key in seen:
                first_task, first_address = seen[key]
                same = "" if first_address == address else f" (the same as {first_address!r})"
                raise ValueError(f"duplicate address {address!r}{same}: used by {first_task} "
                                 f"and {task_type}-{index}")
            seen[key] = (f"{task_type}-{index}", address)
        if self.task is not None:
            if isinstance(self.task, Mapping):
                object.__setattr__(self, "task", TaskSpec(**self.task))
            count = len(getattr(self, self.task.type))
            if self.task.index >= count:
                raise ValueError(
                    f"task index out of range: the cluster has {count} {self.task.type!r} "
                    f"task(s). Received: task={{'type': {self.task.type!r}, "
                    f"'index': {self.task.index}}}")

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ClusterSpec":
        """Builds a spec from a TF_CONFIG-shaped dict ``{"cluster": ..., "task": ...}``."""
        try:
            return cls._from_dict(config)
        except RecursionError:
            raise ValueError("TF_CONFIG is nested too deeply. Received: "
                             f"{reprlib.repr(config)}") from None

    @classmethod
    def _from_dict(cls, config: Mapping[str, Any]) -> "ClusterSpec":
        if not isinstance(config, Mapping):
            raise ValueError(f"TF_CONFIG must be a JSON object. Received: {config!r}")
        unknown = set(config) - {"cluster", "task", "environment", "rpc_layer"}
        if unknown:
            raise ValueError(f"TF_CONFIG has unknown field(s) {sorted(unknown)}. "
                             "Expected 'cluster' and 'task'.")
        cluster = config.get("cluster")
        if not isinstance(cluster, Mapping):
            raise ValueError(f"TF_CONFIG.cluster must be an object mapping task type to "
                             f"addresses. Received: cluster={cluster!r}")
        bad_types = [t for t in cluster if t not in TASK_TYPES]
        if bad_types:
            raise ValueError(f"unknown task type {bad_types[0]!r} in TF_CONFIG.cluster; "
                             f"expected one of {list(TASK_TYPES)}")
        task = config.get("task")
        task_spec = None
        if task is not None:
            if not isinstance(task, Mapping) or "type" not in task:
                raise ValueError("TF_CONFIG.task must be an object with 'type' and 'index'. "
                                 f"Received: task={task!r}")
            extra = set(task) - {"type", "index", "trial"}
            if extra:
                raise ValueError(f"TF_CONFIG.task has unknown field(s) {sorted(extra)}. "
                                 f"Received: task={dict(task)!r}")
            if task["type"] not in TASK_TYPES:
                raise ValueError(f"unknown task type in TF_CONFIG.task.type; expected one of "
                                 f"{list(TASK_TYPES)}. Received: type={task['type']!r}")
            task_spec = TaskSpec(task["type"], task.get("index", 0))
        jobs = {}
        for task_type, addresses in cluster.items():
            if isinstance(addresses, Mapping):  # TF's sparse form {index: address}
                addresses = _sparse_addresses(task_type, addresses)
            jobs[task_type] = addresses
        return cls(task=task_spec, **jobs)

    @classmethod
    def from_json(cls, text: str) -> "ClusterSpec":
        """Parses TF_CONFIG text."""
        shown = text if len(str(text)) <= 200 else str(text)[:200] + "..."
        try:
            config = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"TF_CONFIG is not valid JSON ({error}). Received: {shown!r}") from None
        except RecursionError:
            raise ValueError(f"TF_CONFIG is nested too deeply. Received: {shown!r}") from None
        return cls.from_dict(config)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClusterSpec":
        """Reads TF_CONFIG from the environment.

        Raises:
            ValueError: TF_CONFIG is not set, or is not a valid cluster.
        """
        environ = os.environ if environ is None else environ
        text = environ.get(env.TF_CONFIG)
        if not text:
            raise ValueError("TF_CONFIG is not set. Set it to a JSON object with 'cluster' and "
                             "'task', start the job with `tfdist launch`, or pass a cluster "
                             "explicitly. Received: TF_CONFIG=" + repr(text))
        return cls.from_json(text)

    @classmethod
    def local(cls, ports: Mapping[str, list[int]] | None = None, *, workers: int = 1,
              chief: bool = False, ps: int = 0, host: str = "127.0.0.1",
              task: TaskSpec | None = None, evaluator: bool = False) -> "ClusterSpec":
        """A cluster on one host, one port per task (``ports`` maps type to ports)."""
        counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
        ports = ports or {}
        jobs = {}
        for task_type, count in counts.items():
            if count:
                given = list(ports.get(task_type, []))
                if len(given) != count:
                    raise ValueError(f"need {count} port(s) for {task_type}. Received: {given}")
                jobs[task_type] = tuple(f"{host}:{p}" for p in given)
        return cls(task=task, **jobs)

    # ---- views ----------------------------------------------------------------------

    def jobs(self) -> dict[str, list[str]]:
        """The non-empty jobs as ``{task_type: [address, ...]}``."""
        return {t: list(getattr(self, t)) for t in TASK_TYPES if getattr(self, t)}

    def addresses(self):
        """Yields ``(task_type, index, address)`` for every task."""
        for task_type in TASK_TYPES:
            for index, address in enumerate(getattr(self, task_type)):
                yield task_type, index, address

    def tasks(self) -> list[TaskSpec]:
        """Every task, chief first."""
        return [TaskSpec(t, i) for t, i, _ in self.addresses()]

    def with_task(self, task: TaskSpec | str, index: int = 0) -> "ClusterSpec":
        """The same cluster seen from another task."""
        task = task if isinstance(task, TaskSpec) else TaskSpec(task, index)
        return dataclasses.replace(self, task=task)

    @property
    def num_workers(self) -> int:
        """Training tasks: the chief plus the workers."""
        return sum(len(getattr(self, t)) for t in TRAINING_TASK_TYPES)

    @property
    def task_address(self) -> str | None:
        if self.task is None:
            return None
        return getattr(self, self.task.type)[self.task.index]

    def is_chief(self) -> bool:
        """True on the task that writes checkpoints and reports (TF's rule)."""
        if self.task is None:
            return True
        if self.chief:
            return self.task.type == "chief"
        return self.task.type == "worker" and self.task.index == 0

    def to_dict(self) -> dict[str, Any]:
        config: dict[str, Any] = {"cluster": self.jobs()}
        if self.task is not None:
            config["task"] = {"type": self.task.type, "index": self.task.index}
        return config

    def to_tf_config(self) -> str:
        """The TF_CONFIG JSON text for this task."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_cluster_resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` for this spec."""
        import tensorflow as tf

        task = self.task or TaskSpec("chief" if self.chief else "worker", 0)
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.jobs()), task_type=task.type, task_id=task.index,
            rpc_layer="grpc")

    def warn_if_public(self) -> None:
        """Warns when an address is not loopback or private: TF's gRPC has no auth."""
        for task_type, index, address in self.addresses():
            if not is_private_host(address.rsplit(":", 1)[0]):
                warnings.warn(
                    f"{task_type}-{index} listens on {address}, which is not a private or "
                    "loopback address. TensorFlow's gRPC servers have no authentication: "
                    "run the job on a private network or behind a network policy.",
                    stacklevel=2)


_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


# Names of this host's loopback interface that reach the same listening port.
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _endpoint_key(address: str) -> str:
    """``address`` with loopback spellings made one (``localhost:P`` = ``127.0.0.1:P``)."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]").lower()
    return f"{'loopback' if host in _LOOPBACK_NAMES else host}:{int(port)}"


def _sparse_addresses(task_type: str, addresses: Mapping) -> list:
    """TF's sparse form ``{"0": address, "1": address}`` as a list in index order."""
    by_index = {}
    for key, address in addresses.items():
        text = str(key)
        if not text.isdigit() or (len(text) > 1 and text[0] == "0"):
            raise ValueError(f"TF_CONFIG.cluster.{task_type} indices must be integers "
                             f"0..n-1 written plainly. Received: index {key!r} in "
                             f"{reprlib.repr(dict(addresses))}")
        if int(text) in by_index:
            raise ValueError(f"TF_CONFIG.cluster.{task_type} gives index {int(text)} twice. "
                             f"Received: {reprlib.repr(dict(addresses))}")
        by_index[int(text)] = address
    if sorted(by_index) != list(range(len(by_index))):
        raise ValueError(f"TF_CONFIG.cluster.{task_type} must number its tasks 0..n-1. "
                         f"Received: indices {sorted(by_index)}")
    return [by_index[i] for i in range(len(by_index))]


def validate_address(address: Any, field: str = "address") -> None:
    """Checks one ``host:port`` string."""
    if not isinstance(address, str):
        raise ValueError(f"{field} entries must be 'host:port' strings. Received: {address!r}")
    match = _ADDRESS.match(address)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{field} entries must be 'host:port' with a port in 1..65535. "
                         f"Received: {address!r}")


def is_private_host(host: str) -> bool:
    """True for loopback, private-range and link-local addresses and bare names."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        # A DNS name: cluster-internal names (pods, Slurm nodes) are normally private.
        return "." not in host or host.endswith((".local", ".internal", ".svc",
                                                 ".cluster.local"))
    return ip.is_loopback or ip.is_private or ip.is_link_local


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm host list such as ``node[01-03,7],gpu1``."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                for number in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{number:0{len(lo)}d}{suffix}")
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def from_slurm(environ: Mapping[str, str] | None = None, port: int = DEFAULT_SLURM_PORT,
               ps: int = 0, chief: bool = False) -> ClusterSpec:
    """Builds the cluster of a Slurm job step: one task per Slurm task.

    Tasks on the same node get consecutive ports from ``port``. The first ``chief`` task
    is the chief, the next ``ps`` tasks are parameter servers, the rest are workers.
    """
    environ = os.environ if environ is None else environ
    missing = [k for k in ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
               if k not in environ and k.replace("STEP", "JOB") not in environ]
    if missing:
        raise ValueError(f"not inside a Slurm job step: {missing[0]} is not set")
    nodes = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
    per_node = _expand_tasks_per_node(
        environ.get("SLURM_STEP_TASKS_PER_NODE") or environ["SLURM_JOB_TASKS_PER_NODE"])
    if len(per_node) != len(nodes):
        raise ValueError(f"Slurm tasks-per-node {per_node} does not match nodes {nodes}")
    addresses = [f"{node}:{port + i}" for node, count in zip(nodes, per_node)
                 for i in range(count)]
    rank = int(environ["SLURM_PROCID"])
    roles = ["chief"] * int(chief) + ["ps"] * ps
    roles += ["worker"] * (len(addresses) - len(roles))
    if rank >= len(addresses):
        raise ValueError(f"SLURM_PROCID={rank} is out of range for {len(addresses)} tasks")
    jobs: dict[str, list[str]] = {}
    for role, address in zip(roles, addresses):
        jobs.setdefault(role, []).append(address)
    role = roles[rank]
    return ClusterSpec(task=TaskSpec(role, roles[:rank].count(role)), **jobs)


def _expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item.strip())
        if not match:
            raise ValueError(f"cannot parse Slurm tasks-per-node {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def resolve_cluster(source: Any = None) -> ClusterSpec | None:
    """Turns what a user passed as ``cluster_resolver`` into a `ClusterSpec`.

    Args:
        source: None or ``"env"`` (TF_CONFIG), ``"slurm"``, a `ClusterSpec`, a
            TF_CONFIG-shaped dict, or any TF ``ClusterResolver`` (Slurm, Kubernetes, ...).

    Returns:
        The spec, with this process's task.
    """
    spec = _spec_from_source(source)
    if spec is not None:
        spec.warn_if_public()
        return spec
    raise ValueError("cluster_resolver must be None, 'env', 'slurm', a tfdist.ClusterSpec, a "
                     f"TF_CONFIG dict or a TF ClusterResolver. Received: {source!r}")


def _spec_from_source(source: Any) -> ClusterSpec | None:
    if source is None or source == "env":
        return ClusterSpec.from_env()
    if isinstance(source, ClusterSpec):
        return source
    if isinstance(source, Mapping):
        return ClusterSpec.from_dict(source)
    if source == "slurm":
        return from_slurm()
    if hasattr(source, "cluster_spec") and hasattr(source, "task_type"):
        jobs = source.cluster_spec().as_dict()
        task = None
        if source.task_type is not None:
            task = {"type": source.task_type, "index": int(source.task_id or 0)}
        return ClusterSpec.from_dict({"cluster": jobs, "task": task})
    return None
