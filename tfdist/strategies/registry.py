"""The strategy registry: each ``strategy.name`` of a config, its class, and its needs.

One entry per mode says which public class it is, where that class lives, what a
launcher must give it (one process or one per task, a chief, parameter servers,
``horovodrun``), how the global batch is split, whether its ``fit`` is tfdist's own, and
the keyword options ``tfdist train``'s ``strategy.options`` may set. ``tfdist``'s lazy
names, the config schema (`tfdist.config`) and ``tfdist train`` read it; none of them
branches on a strategy's name.

This module is data only and imports nothing from tfdist or TensorFlow: the config check
reads it in a fraction of a second. ``tests/test_strategy_registry.py`` holds every
entry's options to its class's real ``__init__``.

A new mode is one strategy module plus one `StrategyEntry` here.
"""

from __future__ import annotations

from dataclasses import dataclass

# ``__init__`` arguments ``tfdist train`` sets itself, or that a TOML value cannot express.
NOT_FROM_CONFIG = ("cluster_resolver", "cross_device_ops", "variable_partitioner")

# How the global batch is split (`StrategyEntry.replicas`).
ONE_REPLICA = "one"  # not split by tfdist train (one replica, or a coordinator's batches)
REPLICA_PER_DEVICE = "device"  # one replica per logical CPU of this one process
REPLICA_PER_TASK = "task"  # one replica per training task (chief and workers)


@dataclass(frozen=True)
class StrategyEntry:
    """One mode: its public class and what it needs from a launcher.

    Attributes:
        name: The config's ``strategy.name``.
        class_name: The public class in ``tfdist``; None for TensorFlow's default strategy.
        module: The module that defines ``class_name``; None with it.
        options: The class's own keyword arguments ``strategy.options`` may set.
        kwargs_go_to: The entries whose options the class's ``**kwargs`` pass on to
            (`option_names` adds theirs).
        multi_process: Runs one process per task (launched, or from the environment).
        chief: Needs a chief task (it runs ``fit``).
        ps: Needs parameter-server tasks.
        horovodrun: Its processes are Horovod ranks that ``horovodrun`` starts, not
            TF_CONFIG tasks.
        replaces_fit: Its ``fit`` is tfdist's own, which takes numpy arrays and shards
            them over the workers itself.
        replicas: How the global batch is split: `ONE_REPLICA`, `REPLICA_PER_DEVICE` or
            `REPLICA_PER_TASK`.
        exports: Other public ``tfdist`` names its module defines.
    """

    name: str
    class_name: str | None
    module: str | None
    options: frozenset[str] = frozenset()
    kwargs_go_to: tuple[str, ...] = ()
    multi_process: bool = False
    chief: bool = False
    ps: bool = False
    horovodrun: bool = False
    replaces_fit: bool = False
    replicas: str = ONE_REPLICA
    exports: tuple[str, ...] = ()

    @property
    def runs_on_nodes(self) -> bool:
        """Whether ``cluster.mode = "nodes"`` can start it (TF_CONFIG tasks per node)."""
        return self.multi_process and not self.horovodrun

    @property
    def runs_on_engines(self) -> bool:
        """Whether Spark or Ray can run it: workers only, each a TF_CONFIG task."""
        return self.runs_on_nodes and not (self.chief or self.ps)


_SYNC_OPTIONS = frozenset({"accumulate_steps", "communication_options", "compression"})
_MULTI_WORKER_OPTIONS = _SYNC_OPTIONS | {"collective_timeout", "commit_every_steps", "engine",
                                         "heartbeat_timeout",
                                         "startup_timeout"}

_FSDP_OPTIONS = frozenset({"shard_parameters", "min_shard_elements", "shard_filter",
                           "reshard_after_forward"})

STRATEGIES: dict[str, StrategyEntry] = {entry.name: entry for entry in (
    StrategyEntry("none", None, None),
    StrategyEntry("mirrored", "MirroredStrategy", "tfdist.strategies.mirrored",
                  options=_SYNC_OPTIONS | {"devices", "shard_optimizer_state"} | _FSDP_OPTIONS,
                  replicas=REPLICA_PER_DEVICE),
    StrategyEntry("multi_worker", "MultiWorkerMirroredStrategy",
                  "tfdist.strategies.multi_worker",
                  options=_MULTI_WORKER_OPTIONS | {"shard_optimizer_state"} | _FSDP_OPTIONS,
                  multi_process=True, replicas=REPLICA_PER_TASK),
    StrategyEntry("parameter_server", "ParameterServerStrategy",
                  "tfdist.strategies.parameter_server",
                  options=frozenset({"chief_poll_seconds", "exactly_once", "mode",
                                     "startup_timeout", "step_timeout", "steps_per_dispatch",
                                     "update_block_bytes"}),
                  multi_process=True, chief=True, ps=True, replaces_fit=True,
                  exports=("StepTimeoutError",)),
    StrategyEntry("model_average", "ModelAverageStrategy",
                  "tfdist.strategies.averaging.model_average",
                  options=frozenset({"average_optimizer_state", "compression", "devices",
                                     "engine", "fragments", "mix", "outer_compression",
                                     "outer_optimizer", "period", "sync_delay",
                                     "warmup_steps"}),
                  kwargs_go_to=("multi_worker",), multi_process=True,
                  replicas=REPLICA_PER_TASK),
    StrategyEntry("model_parallel", "ModelParallelStrategy", "tfdist.strategies.model_parallel",
                  options=_SYNC_OPTIONS | {"devices", "layout_map", "model_parallel"},
                  replicas=REPLICA_PER_DEVICE),
    StrategyEntry("multi_worker_model_parallel", "MultiWorkerModelParallelStrategy",
                  "tfdist.strategies.model_parallel",
                  options=frozenset({"layout_map", "model_parallel"}),
                  kwargs_go_to=("multi_worker",), multi_process=True,
                  replicas=REPLICA_PER_TASK),
    StrategyEntry("horovod", "HorovodStrategy", "tfdist.strategies.horovod",
                  options=_SYNC_OPTIONS | {"devices"}, multi_process=True, horovodrun=True,
                  replicas=REPLICA_PER_TASK),
)}


def get(name: str) -> StrategyEntry:
    """The entry of a ``strategy.name``.

    Raises:
        ValueError: no such strategy.
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy name must be one of {list(STRATEGIES)}. "
                         f"Received: {name!r}") from None


def option_names(name: str) -> frozenset[str]:
    """The keyword arguments ``strategy.options`` may hold for a strategy name: the
    class's own, and those its ``**kwargs`` pass on."""
    entry = get(name)
    names = set(entry.options)
    for other in entry.kwargs_go_to:
        names |= option_names(other)
    return frozenset(names)


def public_names() -> dict[str, str]:
    """Every public ``tfdist`` name a strategy module defines -> that module."""
    names = {}
    for entry in STRATEGIES.values():
        if entry.class_name is not None:
            for name in (entry.class_name, *entry.exports):
                names[name] = entry.module
    return names
