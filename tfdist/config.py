"""The main job's TOML config: schema, defaults, loading and validation.

Every error names the file and the key (``configs/x.toml: train.epochs must be an
integer >= 1. Received: 0``). No TensorFlow import here.
"""

from __future__ import annotations

import copy
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from tfdist.strategies import registry

STRATEGIES = tuple(registry.STRATEGIES)
# Strategies that need one process per task (launched, or from the environment).
MULTI_PROCESS_STRATEGIES = tuple(name for name, entry in registry.STRATEGIES.items()
                                 if entry.multi_process)
# local: tasks on this host; env: this process is a task the environment describes;
# nodes: this host's tasks of a multi-node job that meets at node 0's rendezvous.
# spark, ray: the tasks run on a Spark barrier stage / Ray actors (tfdist.spark, tfdist.ray).
CLUSTER_MODES = ("local", "env", "nodes", "spark", "ray")
ENGINE_MODES = ("spark", "ray")
# The Spark master URLs Spark itself accepts (SparkContext's master parsing).
_SPARK_MASTER = re.compile(r"local(\[(\*|\d+)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]|yarn"
                           r"|(spark|k8s|mesos)://\S+")
# Ray addresses: auto, local, HOST:PORT, ray://HOST:PORT.
_RAY_ADDRESS = re.compile(r"auto|local|(ray://)?\S+:\d{1,5}")

DEFAULTS: dict[str, dict[str, Any]] = {
    "strategy": {"name": "mirrored", "options": {}},
    "cluster": {"mode": "local", "workers": 2, "chief": False, "ps": 0, "logical_cpus": 2,
                "timeout": 1800.0, "max_restarts": 0, "nnodes": 1, "node_rank": 0,
                "master": "", "min_workers": 0, "max_workers": 0, "elastic_timeout": 600.0},
    "model": {"name": "mlp", "hidden": [64], "dropout": 0.0},
    "data": {"name": "digits", "path": "", "label": "label", "validation_split": 0.2,
             "limit": 0},
    "train": {"optimizer": "adam", "learning_rate": 0.005, "momentum": 0.0, "epochs": 5,
              "global_batch_size": 64, "steps_per_epoch": 0, "seed": 0,
              "output_dir": "runs/default", "verbose": 2},
}

# key -> (allowed types, check, description of the check)
_CHECKS = {
    ("strategy", "name"): (str, lambda v: v in STRATEGIES, f"one of {list(STRATEGIES)}"),
    ("strategy", "options"): (dict, None, "a table of strategy keyword arguments"),
    ("cluster", "mode"): (str, lambda v: v in CLUSTER_MODES,
                          "'local', 'env', 'nodes', 'spark' or 'ray'"),
    ("cluster", "workers"): (int, lambda v: v >= 1, "an integer >= 1"),
    ("cluster", "chief"): (bool, None, "true or false"),
    ("cluster", "ps"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("cluster", "logical_cpus"): (int, lambda v: v >= 1, "an integer >= 1"),
    ("cluster", "timeout"): ((int, float), lambda v: 0 < v < math.inf,
                             "a finite number of seconds > 0"),
    ("cluster", "max_restarts"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("cluster", "nnodes"): (int, lambda v: v >= 1, "an integer >= 1"),
    ("cluster", "min_workers"): (int, lambda v: v >= 0,
                                 "an integer >= 0 (0: not elastic; docs/elastic.md)"),
    ("cluster", "max_workers"): (int, lambda v: v >= 0,
                                 "an integer >= 0 (0: cluster.workers)"),
    ("cluster", "elastic_timeout"): ((int, float), lambda v: 0 < v < math.inf,
                                     "a finite number of seconds > 0"),
    ("cluster", "node_rank"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("cluster", "master"): (str, None, "'HOST:PORT' of node 0's rendezvous, a Spark "
                                       "master URL or a Ray address"),
    ("model", "name"): (str, lambda v: v in ("mlp", "cnn") or ":" in v,
                        "'mlp', 'cnn' or 'module:function'"),
    ("model", "hidden"): (list, lambda v: all(type(u) is int and u > 0 for u in v),
                          "a list of positive integers"),
    ("model", "dropout"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("data", "name"): (str, lambda v: v in ("digits", "npz", "csv", "tfrecord"),
                       "'digits', 'npz', 'csv' or 'tfrecord'"),
    ("data", "path"): (str, None, "a path"),
    ("data", "label"): (str, None, "a column / feature name"),
    ("data", "validation_split"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("data", "limit"): (int, lambda v: v >= 0, "an integer >= 0 (0: all samples)"),
    ("train", "optimizer"): (str, lambda v: v in ("sgd", "adam"), "'sgd' or 'adam'"),
    ("train", "learning_rate"): ((int, float), lambda v: 0 < v < math.inf,
                                 "a finite number > 0"),
    ("train", "momentum"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("train", "epochs"): (int, lambda v: v >= 1, "an integer >= 1"),
    ("train", "global_batch_size"): (int, lambda v: v >= 1, "an integer >= 1"),
    ("train", "steps_per_epoch"): (int, lambda v: v >= 0, "an integer >= 0 (0: whole data)"),
    # NumPy's and Keras' seeds (keras.utils.set_random_seed) are 32-bit.
    ("train", "seed"): (int, lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    ("train", "output_dir"): (str, lambda v: bool(v), "a non-empty path"),
    ("train", "verbose"): (int, lambda v: v in (0, 1, 2), "0, 1 or 2"),
}


# strategy.name -> (module in tfdist/strategies, class) for checking strategy.options.
STRATEGY_CLASSES = {name: (entry.module.rpartition(".")[2], entry.class_name)
                    for name, entry in registry.STRATEGIES.items() if entry.class_name}


class ConfigError(ValueError):
    """A config file is wrong; the message names the file and the key."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None
                ) -> dict[str, Any]:
    """Reads a TOML config over the defaults and validates it.

    Args:
        path: The TOML file; None for the embedded defaults.
        overrides: ``section.key=value`` strings (values parsed as TOML), applied last.

    Returns:
        The full config, every section and key present.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or value, impossible cluster.
    """
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{source}: config file does not exist")
        try:
            raw = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ConfigError(f"{source}: not valid TOML: {error}") from None
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set expects section.key=value. Received: {item!r}")
        section, name = key.strip().split(".", 1)
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare string
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        if name.startswith("options."):
            raw[section].setdefault("options", {})[name.split(".", 1)[1]] = parsed
        else:
            raw[section][name] = parsed
    return validate_config(raw, source)


def validate_config(raw: dict[str, Any], source: str = "<config>") -> dict[str, Any]:
    """Merges ``raw`` over `DEFAULTS` and checks every key (see `load_config`)."""
    config = copy.deepcopy(DEFAULTS)
    for section, values in raw.items():
        if section not in DEFAULTS:
            raise ConfigError(f"{source}: unknown section [{section}]; expected one of "
                              f"{list(DEFAULTS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table. Received: {values!r}")
        for key, value in values.items():
            if key not in DEFAULTS[section]:
                raise ConfigError(f"{source}: unknown key {section}.{key}; expected one of "
                                  f"{sorted(DEFAULTS[section])}")
            types, check, wanted = _CHECKS[(section, key)]
            ok_type = isinstance(value, types) and not (
                isinstance(value, bool) and types is not bool and bool not in (
                    types if isinstance(types, tuple) else (types,)))
            if not ok_type or (check is not None and not check(value)):
                raise ConfigError(f"{source}: {section}.{key} must be {wanted}. "
                                  f"Received: {value!r}")
            config[section][key] = value
    _check_combination(config, source)
    return config


def strategy_option_names(name: str) -> frozenset[str]:
    """The keyword arguments ``strategy.options`` may hold for a strategy name (from
    `tfdist.strategies.registry`); empty for an unknown name."""
    if name not in registry.STRATEGIES:
        return frozenset()
    return registry.option_names(name)


def _check_strategy_options(strategy: dict[str, Any], source: str) -> None:
    allowed = strategy_option_names(strategy["name"])
    for key, value in strategy["options"].items():
        if key in allowed:
            continue
        if not allowed:
            raise ConfigError(f"{source}: strategy.options.{key}: strategy.name="
                              f"{strategy['name']!r} takes no options. Received: "
                              f"{key}={value!r}")
        raise ConfigError(f"{source}: strategy.options.{key} is not an option of "
                          f"{STRATEGY_CLASSES[strategy['name']][1]}; expected one of "
                          f"{sorted(allowed)}. Received: {key}={value!r}")


def _check_output_dir(path: str, source: str) -> None:
    if "\0" in path:
        raise ConfigError(f"{source}: train.output_dir must be a path. Received: {path!r}")
    for parent in (Path(path), *Path(path).parents):
        try:
            exists, is_dir = parent.exists(), parent.is_dir()
        except (OSError, ValueError) as error:  # e.g. a name too long
            raise ConfigError(f"{source}: train.output_dir cannot be used: {error}. "
                              f"Received: {path!r}") from None
        if exists:
            if not is_dir:
                raise ConfigError(f"{source}: train.output_dir must be a directory, but "
                                  f"{str(parent)!r} is a file. Received: {path!r}")
            return


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a name too long, or not encodable
        return False


def _check_combination(config: dict[str, Any], source: str) -> None:
    strategy, cluster, data = config["strategy"], config["cluster"], config["data"]
    _check_strategy_options(strategy, source)
    _check_output_dir(config["train"]["output_dir"], source)
    if data["name"] != "digits" and not data["path"]:
        raise ConfigError(f"{source}: data.path is required for data.name="
                          f"{data['name']!r}")
    if data["path"] and ("\0" in data["path"] or not _exists(data["path"])):
        raise ConfigError(f"{source}: data.path does not exist. Received: {data['path']!r}")
    if cluster["mode"] == "nodes":
        _check_nodes(config, source)
    else:
        if cluster["mode"] in ENGINE_MODES:
            _check_engine(config, source)
        for key, default in (("nnodes", 1), ("node_rank", 0), ("master", "")):
            if key == "master" and cluster["mode"] in ENGINE_MODES:
                continue
            if cluster[key] != default:
                raise ConfigError(f"{source}: cluster.{key} applies only to cluster.mode = "
                                  f"'nodes'. Received: {key}={cluster[key]!r} with "
                                  f"mode={cluster['mode']!r}")
    entry = registry.get(strategy["name"])
    if entry.ps and (cluster["mode"] == "local" or cluster["mode"] == "nodes" and
                     cluster["node_rank"] == 0):
        if cluster["ps"] < 1:
            raise ConfigError(f"{source}: cluster.ps must be >= 1 for the {entry.name} "
                              f"strategy. Received: {cluster['ps']}")
        if entry.chief and not cluster["chief"]:
            raise ConfigError(f"{source}: cluster.chief must be true for the "
                              f"{entry.name} strategy (the chief runs fit)")
    elif cluster["ps"] and not entry.ps:
        raise ConfigError(f"{source}: cluster.ps={cluster['ps']} only makes sense with "
                          f"strategy.name={_quoted(_names_where('ps'))}. Received: "
                          f"{strategy['name']!r}")
    batch = config["train"]["global_batch_size"]
    replicas = _replicas(config)
    if batch % replicas:
        raise ConfigError(f"{source}: train.global_batch_size={batch} cannot be split "
                          f"evenly over {replicas} replicas")


def _check_nodes(config: dict[str, Any], source: str) -> None:
    """``cluster.mode = "nodes"``: a multi-process strategy, a master, a valid rank."""
    strategy, cluster = config["strategy"]["name"], config["cluster"]
    if not registry.get(strategy).runs_on_nodes:
        raise ConfigError(f"{source}: cluster.mode = 'nodes' needs strategy.name "
                          f"{_quoted(_names_where('runs_on_nodes'))}. Received: {strategy!r}")
    host, _, port = cluster["master"].rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{source}: cluster.master must be 'HOST:PORT' of node 0's "
                          f"rendezvous (port 1..65535) with cluster.mode = 'nodes'. "
                          f"Received: {cluster['master']!r}")
    if cluster["node_rank"] >= cluster["nnodes"]:
        raise ConfigError(f"{source}: cluster.node_rank must be < cluster.nnodes="
                          f"{cluster['nnodes']}. Received: {cluster['node_rank']}")
    if cluster["chief"] and cluster["node_rank"] != 0:
        raise ConfigError(f"{source}: cluster.chief = true is allowed only on node 0. "
                          f"Received: node_rank={cluster['node_rank']}")


def _check_engine(config: dict[str, Any], source: str) -> None:
    """``cluster.mode = "spark"`` / ``"ray"``: workers only, each a TensorFlow worker."""
    strategy, cluster = config["strategy"]["name"], config["cluster"]
    mode = cluster["mode"]
    if not registry.get(strategy).runs_on_engines:
        raise ConfigError(f"{source}: cluster.mode = {mode!r} needs strategy.name "
                          f"{_quoted(_names_where('runs_on_engines'))}. Received: "
                          f"{strategy!r}")
    for key in ("chief", "ps", "max_restarts"):
        if cluster[key]:
            raise ConfigError(f"{source}: cluster.{key} is not supported with cluster.mode = "
                              f"{mode!r} (its tasks are workers only, not restarted). "
                              f"Received: {key}={cluster[key]!r}")
    master = cluster["master"]
    if mode == "spark" and master and not _SPARK_MASTER.fullmatch(master):
        raise ConfigError(f"{source}: cluster.master must be a Spark master URL (local, "
                          f"local[N], local[*], spark://HOST:PORT, yarn, k8s://..., "
                          f"mesos://...) with cluster.mode = 'spark'. Received: {master!r}")
    if mode == "ray" and master and not _RAY_ADDRESS.fullmatch(master):
        raise ConfigError(f"{source}: cluster.master must be a Ray address (auto, "
                          f"HOST:PORT or ray://HOST:PORT) with cluster.mode = 'ray'. "
                          f"Received: {master!r}")


def _names_where(attribute: str) -> list[str]:
    """The strategy names whose registry entry has ``attribute`` true."""
    return [name for name, entry in registry.STRATEGIES.items() if getattr(entry, attribute)]


def _quoted(names: list[str]) -> str:
    """``'a'``, ``'a' or 'b'``, ``'a', 'b' or 'c'``."""
    quoted = [repr(name) for name in names]
    return " or ".join(filter(None, (", ".join(quoted[:-1]), quoted[-1])))


def _replicas(config: dict[str, Any]) -> int:
    entry, cluster = registry.get(config["strategy"]["name"]), config["cluster"]
    if entry.replicas == registry.REPLICA_PER_DEVICE:
        return cluster["logical_cpus"]
    if entry.replicas == registry.REPLICA_PER_TASK and cluster["mode"] in (
            "local", *ENGINE_MODES):
        return cluster["workers"] + int(cluster["chief"])
    if entry.replicas == registry.REPLICA_PER_TASK and entry.runs_on_nodes and \
            cluster["mode"] == "nodes":
        # Every node runs the same config (its own node_rank): the same workers each.
        return cluster["nnodes"] * cluster["workers"] + int(cluster["chief"])
    return 1


def replica_count(config: dict[str, Any]) -> int | None:
    """The replicas in sync of a config's job, or None when only the environment's
    cluster tells (``cluster.mode = "env"`` for a strategy with a replica per task)."""
    entry, cluster = registry.get(config["strategy"]["name"]), config["cluster"]
    devices = config["strategy"]["options"].get("devices")
    if entry.replicas == registry.REPLICA_PER_DEVICE and isinstance(devices, list) and devices:
        return len(devices)
    if entry.replicas == registry.REPLICA_PER_TASK and cluster["mode"] == "env":
        return None
    return _replicas(config)


def is_multi_process(config: dict[str, Any]) -> bool:
    """True when the job runs one process per task."""
    return registry.get(config["strategy"]["name"]).multi_process
