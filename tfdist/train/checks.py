"""The main job's checks of what a valid config can still get wrong, before anything
starts: the strategy's option values, the environment of a task, horovodrun, Spark or
Ray, the model, the data."""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from tfdist import env
from tfdist.config import ConfigError, is_multi_process, replica_count
from tfdist.strategies import registry

# Where a process started by horovodrun or mpirun finds its rank.
HOROVOD_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
SLURM_PORT_ENV = env.SLURM_PORT


def slurm_port() -> int:
    """The first gRPC port of a node's Slurm tasks: ``$TFDIST_SLURM_PORT``, else 8470.

    Raises:
        ValueError: the variable is not a port number.
    """
    from tfdist.cluster import DEFAULT_SLURM_PORT

    text = os.environ.get(SLURM_PORT_ENV, "").strip()
    if not text:
        return DEFAULT_SLURM_PORT
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{SLURM_PORT_ENV} must be a port in 1..65535. Received: {text!r}")
    return int(text)


def find_horovodrun() -> str | None:
    """The ``horovodrun`` a local Horovod job starts: on PATH, or next to Python."""
    found = shutil.which("horovodrun")
    if found:
        return found
    sibling = Path(sys.executable).with_name("horovodrun")
    return str(sibling) if os.access(sibling, os.X_OK) else None


def strategy_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``strategy.options`` as keyword arguments of the strategy's class.

    A table in ``outer_optimizer`` (``{name = "sgd", learning_rate = 0.7, ...}``) becomes
    a function making that Keras optimizer (multi-worker strategies must exist before
    an optimizer is created; the check imports Keras, not TensorFlow's runtime), and
    one in ``communication_options`` a `tfdist.CommunicationOptions`.

    Raises:
        ConfigError: a table that makes no optimizer or options; names the key.
    """
    options = dict(config["strategy"]["options"])
    table = options.get("communication_options")
    if isinstance(table, dict):
        from tfdist.comm.options import CommunicationOptions

        try:
            options["communication_options"] = CommunicationOptions(**table)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"strategy.options.communication_options: {error}") from None
    if isinstance(options.get("outer_optimizer"), dict):
        options["outer_optimizer"] = _optimizer_from_table(options["outer_optimizer"])
    return options


def _optimizer_from_table(table: dict[str, Any]):
    import keras

    table = dict(table)
    name = table.pop("name", "sgd")
    cls = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}.get(
        name.lower() if isinstance(name, str) else name)
    if cls is None:
        raise ConfigError(f"strategy.options.outer_optimizer.name must be 'sgd' or 'adam'. "
                          f"Received: {name!r}")
    # Keras optimizers pass **kwargs to their bases, which refuse unknown names.
    known = {name for klass in cls.__mro__ if "__init__" in vars(klass)
             for name, p in inspect.signature(klass.__init__).parameters.items()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"strategy.options.outer_optimizer: {cls.__name__} takes no "
                          f"argument {unknown[0]!r}; expected some of {sorted(known)}. "
                          f"Received: {unknown[0]}={table[unknown[0]]!r}")
    return lambda: cls(**table)


def check_strategy_options(config: dict[str, Any], source: str = "<config>") -> None:
    """Checks ``strategy.options`` with the strategy class's own argument checks
    (`tfdist.strategies.options.arguments`), without TensorFlow's runtime: before any process.

    Raises:
        ConfigError: naming ``source``, the option and what was received.
    """
    from tfdist.strategies.options import arguments

    name, cluster = config["strategy"]["name"], config["cluster"]
    try:
        options = strategy_kwargs(config)
        arguments.check_options(name, options)
        if registry.get(name).class_name is not None:
            arguments.check_pairs(name, getattr(arguments, f"check_{name}"), options,
                                  launch_modes(cluster))
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{source}: strategy.options: {error}") from None


def launch_modes(cluster: dict[str, Any]) -> tuple[str, ...]:
    """The launch modes (`tfdist.strategies.options.pairs.MODES`) of a config's ``cluster``."""
    from tfdist.strategies.options import pairs

    modes = {pairs.ELASTIC: bool(cluster["min_workers"]),
             pairs.MULTI_NODE: cluster["mode"] == "nodes" or cluster["nnodes"] > 1,
             pairs.SPARK: cluster["mode"] == "spark", pairs.RAY: cluster["mode"] == "ray",
             pairs.MAX_RESTARTS: cluster["max_restarts"] > 0}
    return tuple(mode for mode in pairs.MODES if modes[mode])


def check_job(config: dict[str, Any], source: str = "<config>") -> None:
    """Checks what a valid config can still get wrong, before any process or TF op.

    The strategy's option values (`check_strategy_options`), that ``model_parallel``
    divides the replicas, the environment of ``cluster.mode = "env"``, ``horovodrun``
    for a local Horovod job, that ``model.name`` can be loaded, the whole data set (see
    `tfdist.data.split_data`), a global batch no larger than its training split, and a
    ``layout_map`` against a built-in model's variables (`tfdist.train.layouts`). Runs no
    TensorFlow op, so it is safe before a strategy.

    Raises:
        ConfigError: naming ``source`` and the key.
    """
    from tfdist.data import DataError, split_data
    from tfdist.models import check_model_name
    from tfdist.train.layouts import check_layout_map

    entry, cluster = registry.get(config["strategy"]["name"]), config["cluster"]
    check_strategy_options(config, source)
    _check_mesh(config, source)
    if is_multi_process(config) and cluster["mode"] == "env":
        _check_environment(config, source)
    if cluster["mode"] == "nodes" and cluster["node_rank"] != 0:
        from tfdist.launch.rendezvous import TOKEN_ENV

        if not os.environ.get(TOKEN_ENV):
            raise ConfigError(
                f"{source}: cluster.mode = 'nodes': node {cluster['node_rank']} needs the "
                f"rendezvous token of node 0 in ${TOKEN_ENV}. Received: {TOKEN_ENV} unset")
    if entry.horovodrun and cluster["mode"] == "local":
        if find_horovodrun() is None or importlib.util.find_spec("horovod") is None:
            raise ConfigError(
                f"{source}: strategy.name = {entry.name!r} with cluster.mode = 'local' starts "
                f"its ranks with horovodrun, and horovod is not installed here (no horovodrun on "
                f"PATH or next to {sys.executable}). Install it (docs/horovod.md) or choose "
                "another strategy.name")
    if cluster["min_workers"]:
        _check_elastic(config, source)
    engine = {"spark": "pyspark", "ray": "ray"}.get(cluster["mode"])
    if engine is not None and importlib.util.find_spec(engine) is None:
        raise ConfigError(f"{source}: cluster.mode = {cluster['mode']!r} needs {engine}, which "
                          f"is not installed here: pip install 'tfdist[{cluster['mode']}]'")
    try:
        check_model_name(config["model"]["name"])
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
    try:
        data = split_data(config["data"], config["train"]["seed"])
    except DataError as error:
        raise ConfigError(f"{source}: {error.key}: {error}") from None
    batch, samples = config["train"]["global_batch_size"], len(data.x_train)
    if batch > samples:  # TF: "Inputs to operation AddN ... must have the same size"
        raise ConfigError(
            f"{source}: train.global_batch_size must be at most the {samples} samples of the "
            f"training split (data.limit = {config['data']['limit']}, data.validation_split = "
            f"{config['data']['validation_split']}). Received: {batch}")
    if config["model"]["name"] == "cnn":
        size = math.prod(data.x_train.shape[1:])
        if math.isqrt(size) ** 2 != size:
            raise ConfigError(f"{source}: model.name = 'cnn' needs square images; a sample "
                              f"has {size} features. Received shape "
                              f"{data.x_train.shape[1:]}")
    check_layout_map(config, data.x_train.shape[1:], data.num_classes, source)
    _check_last_batches(config, data, source)


def _check_last_batches(config: dict[str, Any], data, source: str) -> None:
    """On a tensor-parallel strategy every batch, a split's last one included, splits
    evenly over the replicas: a split layer's collectives exchange equal blocks of rows."""
    if "layout_map" not in registry.get(config["strategy"]["name"]).options:
        return
    n, batch = replica_count(config), config["train"]["global_batch_size"]
    if not n or n == 1:
        return
    for split, rows in (("training", len(data.x_train)), ("validation", len(data.x_val))):
        last = rows % batch
        if last % n:
            raise ConfigError(
                f"{source}: the {split} split's last batch of {last} rows ({rows} samples in "
                f"batches of train.global_batch_size = {batch}) does not split evenly over "
                f"the {n} replicas of {config['strategy']['name']!r}. Change data.limit or "
                f"data.validation_split so that it does. Received: {rows} {split} samples")


def _check_mesh(config: dict[str, Any], source: str) -> None:
    """``strategy.options.model_parallel`` divides the replicas (a ``n // m x m`` mesh)."""
    m = config["strategy"]["options"].get("model_parallel")
    n = replica_count(config)
    if m is None or n is None or n % m == 0:
        return
    cluster = config["cluster"]
    if registry.get(config["strategy"]["name"]).replicas == registry.REPLICA_PER_DEVICE:
        how = ("strategy.options.devices" if config["strategy"]["options"].get("devices")
               else f"cluster.logical_cpus = {cluster['logical_cpus']}")
    else:
        how = " x ".join(filter(None, (
            f"cluster.nnodes = {cluster['nnodes']}" if cluster["mode"] == "nodes" else "",
            f"cluster.workers = {cluster['workers']}"))) + (
            " + the chief" if cluster["chief"] else "")
    raise ConfigError(f"{source}: strategy.options.model_parallel must divide the {n} "
                      f"replicas ({how}), which form an n // m x m mesh. Received: "
                      f"model_parallel={m}")


def _check_elastic(config: dict[str, Any], source: str) -> None:
    """An elastic launch (``cluster.min_workers``) runs Horovod workers (synchronous or
    model averaging; ``engine="auto"`` picks Horovod there), started by tfdist's
    launcher on one host or several (docs/elastic.md)."""
    strategy, cluster = config["strategy"], config["cluster"]
    if cluster["mode"] not in ("local", "nodes"):
        raise ConfigError(f"{source}: cluster.min_workers needs cluster.mode = 'local' or "
                          "'nodes' (tfdist's launcher runs the elastic job). Received: "
                          f"cluster.mode = {cluster['mode']!r}")
    from tfdist.strategies.options.pairs import ELASTIC_STRATEGIES

    if strategy["name"] not in ELASTIC_STRATEGIES:  # the engine: `pairs.check_modes`
        raise ConfigError(
            f"{source}: cluster.min_workers needs strategy.name = 'multi_worker' or "
            "'model_average' (with options.engine = 'horovod' or 'auto', the default: "
            "docs/elastic.md). Received: strategy.name = "
            f"{strategy['name']!r}")


def _check_environment(config: dict[str, Any], source: str) -> None:
    """``cluster.mode = "env"``: the environment must say who is who."""
    entry = registry.get(config["strategy"]["name"])
    if entry.horovodrun:
        if not any(v in os.environ for v in HOROVOD_RANK_VARIABLES):
            raise ConfigError(
                f"{source}: cluster.mode = 'env' with strategy.name = {entry.name!r} runs "
                "under horovodrun (or mpirun), but HOROVOD_RANK is not set. Start it with "
                "`horovodrun -np N tfdist train ...`, or use cluster.mode = 'local'")
        return
    from tfdist.cluster import ClusterSpec, from_slurm

    try:
        if os.environ.get(env.TF_CONFIG):
            ClusterSpec.from_env()
        elif "SLURM_PROCID" in os.environ:
            from_slurm(port=slurm_port(), chief=config["cluster"]["chief"],
                       ps=config["cluster"]["ps"])
        else:
            raise ConfigError(
                f"{source}: cluster.mode = 'env' needs TF_CONFIG (e.g. a Kubernetes TFJob) "
                "or a Slurm job step (SLURM_PROCID); neither is set. Use cluster.mode = "
                "'local' to start the tasks on this host")
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{source}: cluster.mode = 'env': the environment does not "
                          f"describe a cluster: {error}") from None
