"""The main job: ``tfdist train CONFIG`` and ``tfdist compare CONFIG...``.

``tfdist train`` reads a TOML config (`tfdist.config`) and checks everything it can
before anything starts (`check_job`: strategy options, the model, the data, the
environment). It then takes a lock on the output directory, and either runs the job in
this process (no strategy, mirrored, or a task of a cluster that the environment
describes) or launches one local process per task through `tfdist.launch`. Every task
runs `run_task`, which resumes from the backup of an interrupted run of the same
config; the chief prints the per-epoch progress and a final table, and writes
``report.json``, ``report.png`` and ``model.keras`` into the output directory, each
atomically (a temporary file, fsync, rename).
"""

from __future__ import annotations

import fcntl
import importlib.util
import inspect
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from tfdist.config import ConfigError, is_multi_process, load_config

LOCK_FILE = ".tfdist.lock"
# In OUTPUT_DIR/backup: the config a backup belongs to, and the per-epoch history.
BACKUP_CONFIG_FILE = "tfdist_config.json"
BACKUP_HISTORY_FILE = "tfdist_history.json"
# Test hook: "TASK:K" or "K" makes that task SIGKILL itself after epoch K (after its
# backup is written), on the first attempt only. For tests of resuming.
KILL_AFTER_EPOCH_ENV = "TFDIST_TEST_KILL_AFTER_EPOCH"


def build_strategy(config: dict[str, Any]):
    """The strategy a config names, built with its options. Call before other TF work."""
    import tensorflow as tf

    import tfdist

    name, options = config["strategy"]["name"], dict(config["strategy"]["options"])
    if isinstance(options.get("outer_optimizer"), dict):
        options["outer_optimizer"] = _optimizer_from_table(options["outer_optimizer"])
    try:
        if name == "none":
            return tf.distribute.get_strategy()
        if name == "mirrored":
            tfdist.devices.use_logical_cpus(config["cluster"]["logical_cpus"])
            return tfdist.MirroredStrategy(**options)
        classes = {"multi_worker": "MultiWorkerMirroredStrategy",
                   "parameter_server": "ParameterServerStrategy",
                   "model_average": "ModelAverageStrategy", "horovod": "HorovodStrategy"}
        return getattr(tfdist, classes[name])(**options)
    except TypeError as error:
        raise ConfigError(f"strategy.options do not fit strategy {name!r}: {error}") from None


def _optimizer_from_table(table: dict[str, Any]):
    """``{name = "sgd", learning_rate = 0.7, ...}`` -> a function making that Keras
    optimizer (multi-worker strategies must exist before the optimizer is created)."""
    import keras

    table = dict(table)
    name = table.pop("name", "sgd")
    cls = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}.get(name.lower())
    if cls is None:
        raise ConfigError(f"strategy.options.outer_optimizer.name must be 'sgd' or 'adam'. "
                          f"Received: {name!r}")
    try:
        inspect.signature(cls).bind(**table)
    except TypeError as error:
        raise ConfigError(f"strategy.options.outer_optimizer: {error}") from None
    return lambda: cls(**table)


SLURM_PORT_ENV = "TFDIST_SLURM_PORT"


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


def export_slurm_cluster(config: dict[str, Any]) -> None:
    """In a Slurm job step without TF_CONFIG, writes the TF_CONFIG Slurm implies."""
    if config["cluster"]["mode"] != "env" or os.environ.get("TF_CONFIG"):
        return
    if "SLURM_PROCID" in os.environ and config["strategy"]["name"] != "horovod":
        from tfdist.cluster import from_slurm

        spec = from_slurm(port=slurm_port(), chief=config["cluster"]["chief"],
                          ps=config["cluster"]["ps"])
        os.environ["TF_CONFIG"] = spec.to_tf_config()


def is_chief_task(config: dict[str, Any]) -> bool:
    """True on the task that reports and writes the model."""
    if config["strategy"]["name"] == "horovod":
        from tfdist.engines.horovod import ops as horovod

        return horovod.rank() == 0
    if os.environ.get("TF_CONFIG"):
        from tfdist.cluster import ClusterSpec

        return ClusterSpec.from_env().is_chief()
    return True


# ---- checks before anything starts ------------------------------------------------------

_HOROVOD_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def find_horovodrun() -> str | None:
    """The ``horovodrun`` a local Horovod job starts: on PATH, or next to Python."""
    found = shutil.which("horovodrun")
    if found:
        return found
    sibling = Path(sys.executable).with_name("horovodrun")
    return str(sibling) if os.access(sibling, os.X_OK) else None


def check_job(config: dict[str, Any], source: str = "<config>") -> None:
    """Checks what a valid config can still get wrong, before any process or TF op.

    The environment of ``cluster.mode = "env"``, ``horovodrun`` for a local Horovod
    job, that ``model.name`` can be loaded, and the whole data set (see
    `tfdist.data.split_data`). Runs no TensorFlow op, so it is safe before a strategy.

    Raises:
        ConfigError: naming ``source`` and the key.
    """
    from tfdist.data import DataError, split_data
    from tfdist.models import check_model_name

    strategy, cluster = config["strategy"]["name"], config["cluster"]
    if is_multi_process(config) and cluster["mode"] == "env":
        _check_environment(config, source)
    if cluster["mode"] == "nodes" and cluster["node_rank"] != 0:
        from tfdist.launch.rendezvous import TOKEN_ENV

        if not os.environ.get(TOKEN_ENV):
            raise ConfigError(
                f"{source}: cluster.mode = 'nodes': node {cluster['node_rank']} needs the "
                f"rendezvous token of node 0 in ${TOKEN_ENV}. Received: {TOKEN_ENV} unset")
    if strategy == "horovod" and cluster["mode"] == "local":
        if find_horovodrun() is None or importlib.util.find_spec("horovod") is None:
            raise ConfigError(
                f"{source}: strategy.name = 'horovod' with cluster.mode = 'local' starts its "
                f"ranks with horovodrun, and horovod is not installed here (no horovodrun on "
                f"PATH or next to {sys.executable}). Install it (docs/horovod.md) or choose "
                "another strategy.name")
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
    if config["model"]["name"] == "cnn":
        size = math.prod(data.x_train.shape[1:])
        if math.isqrt(size) ** 2 != size:
            raise ConfigError(f"{source}: model.name = 'cnn' needs square images; a sample "
                              f"has {size} features. Received shape "
                              f"{data.x_train.shape[1:]}")


def _check_environment(config: dict[str, Any], source: str) -> None:
    """``cluster.mode = "env"``: the environment must say who is who."""
    name = config["strategy"]["name"]
    if name == "horovod":
        if not any(v in os.environ for v in _HOROVOD_RANK_VARIABLES):
            raise ConfigError(
                f"{source}: cluster.mode = 'env' with strategy.name = 'horovod' runs under "
                "horovodrun (or mpirun), but HOROVOD_RANK is not set. Start it with "
                "`horovodrun -np N tfdist train ...`, or use cluster.mode = 'local'")
        return
    from tfdist.cluster import ClusterSpec, from_slurm

    try:
        if os.environ.get("TF_CONFIG"):
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


# ---- the output directory: lock, backup, atomic writes ----------------------------------


def lock_output_dir(out: Path) -> int:
    """Takes this job's lock on ``out``; returns the file descriptor that holds it.

    The lock is an ``flock`` on ``out/.tfdist.lock``, which names the holder (PID and
    host). The kernel drops it when the holder exits, however it dies, so a lock left by
    a dead job is never in the way. Close the descriptor to release it.

    Raises:
        ConfigError: another live job holds the lock; names it.
    """
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"train.output_dir {str(out)!r} is in use by another tfdist train "
                          f"job ({holder}); wait for it to end or choose another "
                          "train.output_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


def _holds_lock(config: dict[str, Any]) -> bool:
    """Whether this process locks the output directory: the launcher of a local job,
    or the chief of a job the environment describes (the other tasks write nothing)."""
    if config["cluster"]["mode"] in ("local", "spark", "ray") or not is_multi_process(config):
        return True
    if config["cluster"]["mode"] == "nodes":  # node 0's launcher: its host has the chief
        return config["cluster"]["node_rank"] == 0
    if config["strategy"]["name"] == "horovod":
        return next((os.environ[v] for v in _HOROVOD_RANK_VARIABLES if v in os.environ),
                    "0") == "0"
    if os.environ.get("TF_CONFIG"):
        from tfdist.cluster import ClusterSpec

        return ClusterSpec.from_env().is_chief()
    return os.environ.get("SLURM_PROCID", "0") == "0"


def backup_dir(config: dict[str, Any]) -> Path:
    """Where a task backs up and resumes: ``$TFDIST_BACKUP_DIR`` or ``OUTPUT_DIR/backup``."""
    from_launcher = os.environ.get("TFDIST_BACKUP_DIR")
    return Path(from_launcher) if from_launcher else Path(config["train"]["output_dir"]) / "backup"


def _backup_key(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config a backup depends on (not how long, how loud, or where)."""
    key = json.loads(json.dumps(config))
    for section, name in (("train", "epochs"), ("train", "verbose"), ("train", "output_dir"),
                          ("cluster", "timeout"), ("cluster", "max_restarts"),
                          ("cluster", "mode"), ("cluster", "node_rank"),
                          ("cluster", "master")):
        key[section].pop(name, None)
    return key


def prepare_backup(config: dict[str, Any], directory: Path, log=None) -> None:
    """Keeps a backup in ``directory`` only if it belongs to this config, then marks it.

    A backup left by an interrupted job of the same config is resumed; one of another
    config (or of no ``tfdist train`` job) cannot be, and is removed, saying so.
    """
    log = log or sys.stdout
    marker = directory / BACKUP_CONFIG_FILE
    if directory.exists():
        try:
            saved = json.loads(marker.read_text())
        except (OSError, ValueError):
            saved = None
        if saved == _backup_key(config):
            if any(p.name != BACKUP_CONFIG_FILE for p in directory.iterdir()):
                print(f"tfdist train: {directory} holds a backup of this config; the job "
                      "resumes from it", file=log, flush=True)
            return
        shutil.rmtree(directory)
        print(f"tfdist train: removed {directory}: a backup of another config", file=log,
              flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, lambda tmp: tmp.write_text(json.dumps(_backup_key(config))))


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Writes ``path`` so that a reader sees the old file or the whole new one.

    ``write(tmp)`` writes a temporary file in the same directory (same suffix, so Keras
    and matplotlib recognise the format); it is fsynced and renamed over ``path``
    (`tfdist.files.atomic_path`). A kill at any point leaves the previous file intact.
    """
    from tfdist.files import atomic_path

    with atomic_path(path) as tmp:
        write(Path(tmp))


# ---- one task ---------------------------------------------------------------------------


def _task_callbacks(history_path: Path, start_epoch: int, write_history: bool):
    """The history keeper (before the backup) and the kill hook (after it)."""
    import keras

    class KeepHistory(keras.callbacks.Callback):
        """Every epoch's logs, kept next to the backup so a resumed job reports them all.

        Written before the backup of the same epoch: a resumed job drops what follows
        its start epoch."""

        def __init__(self):
            super().__init__()
            try:
                saved = json.loads(history_path.read_text())
            except (OSError, ValueError):
                saved = {}
            self.history = {k: list(v)[:start_epoch] for k, v in saved.items()
                            if isinstance(v, list)} if start_epoch else {}

        def on_epoch_end(self, epoch, logs=None):
            for key, value in (logs or {}).items():
                self.history.setdefault(key, []).append(float(value))
            if write_history and history_path.parent.is_dir():
                write_atomic(history_path, lambda tmp: tmp.write_text(json.dumps(self.history)))

    callbacks = [KeepHistory()]
    spec = os.environ.get(KILL_AFTER_EPOCH_ENV, "")
    task, _, epoch = spec.rpartition(":")
    if spec and os.environ.get("TFDIST_RESTART", "0") == "0" and \
            task in ("", os.environ.get("TFDIST_TASK", "worker-0")):

        class KillAfterEpoch(keras.callbacks.Callback):
            def on_epoch_end(self, index, logs=None):
                if index + 1 == int(epoch):
                    print(f"tfdist train: {KILL_AFTER_EPOCH_ENV}: killing this task after "
                          f"epoch {epoch}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(KillAfterEpoch())
    return callbacks


def _topology(config: dict[str, Any]) -> dict[str, int]:
    """``{"workers": ..., "ps": ...}``: the training processes and parameter servers."""
    name = config["strategy"]["name"]
    if name == "horovod":
        from tfdist.engines.horovod import ops as horovod

        return {"workers": horovod.size(), "ps": 0}
    if os.environ.get("TF_CONFIG") and is_multi_process(config):
        from tfdist.cluster import ClusterSpec

        spec = ClusterSpec.from_env()
        if name == "parameter_server":
            return {"workers": len(spec.worker), "ps": len(spec.ps)}
        return {"workers": spec.num_workers, "ps": 0}
    return {"workers": 1, "ps": 0}


def run_task(config: dict[str, Any], name: str | None = None) -> dict[str, Any] | None:
    """Trains as one task of the job. Returns the report on the chief, else None.

    Resumes from the backup in `backup_dir` when there is one (a restarted task). Every
    mode but ``parameter_server`` feeds ``fit`` batches whose order depends only on the
    seed and the step (`tfdist.data.make_train_dataset`), so a resumed job ends at the
    weights of an uninterrupted one.

    Args:
        config: A validated config.
        name: The config's name for the report (its file name without ``.toml``).
    """
    export_slurm_cluster(config)
    strategy = build_strategy(config)  # first: multi-worker TF must start before any op
    import keras

    from tfdist._hooks.keras_trainer import keras_initial_epoch
    from tfdist.data import DataError, make_train_dataset, split_data
    from tfdist.keras.callbacks import BackupAndRestore
    from tfdist.keras.guards import StopOnNaN
    from tfdist.models import build_model, build_optimizer

    train_cfg = config["train"]
    chief = is_chief_task(config)
    keras.utils.set_random_seed(train_cfg["seed"])
    try:
        data = split_data(config["data"], seed=train_cfg["seed"])
    except DataError as error:
        raise ConfigError(f"{error.key}: {error}") from None
    x, y, x_val, y_val = data.x_train, data.y_train, data.x_val, data.y_val
    batch, epochs = train_cfg["global_batch_size"], train_cfg["epochs"]
    with strategy.scope():
        model = build_model(config["model"], x.shape[1:], data.num_classes)
        model.compile(build_optimizer(train_cfg),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    backup = BackupAndRestore(backup_dir(config))
    backup.set_model(model)
    with strategy.scope():  # as in fit, which restores again
        backup.on_train_begin()  # restores the last backup, if any
    start_epoch = keras_initial_epoch(model, 0)
    if start_epoch >= epochs and chief:
        print(f"tfdist train: the backup in {backup.backup_dir} already holds all {epochs} "
              "epochs; nothing to train", flush=True)
    elif start_epoch and chief:
        print(f"tfdist train: resuming at epoch {start_epoch + 1} from the backup in "
              f"{backup.backup_dir}", flush=True)
    keep_history, *hooks = _task_callbacks(Path(backup.backup_dir) / BACKUP_HISTORY_FILE,
                                           start_epoch, chief)
    fit_kwargs: dict[str, Any] = dict(
        epochs=epochs, initial_epoch=start_epoch, verbose=train_cfg["verbose"] if chief else 0,
        callbacks=[StopOnNaN(), keep_history, backup, *hooks])
    if config["strategy"]["name"] == "parameter_server":
        # The PS driver shards numpy arrays over its workers itself.
        inputs: tuple = (x, y)
        fit_kwargs["batch_size"] = batch
        if train_cfg["steps_per_epoch"]:
            fit_kwargs["steps_per_epoch"] = train_cfg["steps_per_epoch"]
    else:
        steps = train_cfg["steps_per_epoch"] or math.ceil(len(x) / batch)
        inputs = (make_train_dataset(x, y, batch, train_cfg["seed"],
                                     start_batch=start_epoch * steps),)
        fit_kwargs.update(steps_per_epoch=steps, validation_batch_size=batch, shuffle=False)
    if len(x_val):
        fit_kwargs["validation_data"] = (x_val, y_val)
    started = time.monotonic()
    model.fit(*inputs, **fit_kwargs)
    wall = time.monotonic() - started
    history = keep_history.history
    final = {}
    if len(x_val):
        values = model.evaluate(x_val, y_val, batch_size=batch, verbose=0, return_dict=True)
        final = {f"val_{k}": float(v) for k, v in values.items()}
    final.update({k: v[-1] for k, v in history.items() if not k.startswith("val_") and v})
    if not chief:
        return None
    report = {
        "config": config,
        "name": name or "config",
        "strategy": type(strategy).__name__,
        "num_replicas": int(strategy.num_replicas_in_sync),
        **_topology(config),
        "epochs": len(history.get("loss", [])),
        "resumed_from_epoch": start_epoch,
        "history": history,
        "final": final,
        "wall_time_seconds": wall,
        "bytes_communicated": int(getattr(strategy, "bytes_communicated", 0) or 0),
    }
    out = Path(train_cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=_jsonable)
    write_atomic(out / "report.json", lambda tmp: tmp.write_text(text))
    write_atomic(out / "report.png", lambda tmp: plot_history(report, tmp))
    write_atomic(out / "model.keras", model.save)
    print(format_table([("metric", "value")] +
                       [(k, f"{v:.4f}") for k, v in sorted(final.items())] +
                       [("wall time (s)", f"{wall:.1f}"),
                        ("bytes communicated", f"{report['bytes_communicated']:,}")]),
          flush=True)
    return report


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def format_table(rows: list[tuple]) -> str:
    """A plain text table, first row the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plural(count: int, word: str) -> str:
    """``1 replica``, ``2 replicas``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def describe_topology(report: dict[str, Any]) -> str:
    """``2 replicas``, ``4 replicas on 2 workers``, ``2 workers, 1 parameter server``."""
    workers, ps = report.get("workers", 1), report.get("ps", 0)
    if ps:
        return f"{plural(workers, 'worker')}, {plural(ps, 'parameter server')}"
    text = plural(report["num_replicas"], "replica")
    return text + (f" on {plural(workers, 'worker')}" if workers > 1 and
                   workers != report["num_replicas"] else "")


def plot_history(report: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch, training and validation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = report["history"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        for key, style in ((metric, "-o"), (f"val_{metric}", "--s")):
            if key in history:
                ax.plot(range(1, len(history[key]) + 1), history[key], style, label=key,
                        markersize=4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.suptitle(f"{report.get('name', 'config')}: {report['strategy']}, "
                 f"{describe_topology(report)}")
    fig.tight_layout()
    fig.savefig(path, dpi=80, format="png")
    plt.close(fig)


def launch_job(config: dict[str, Any], config_path: Path) -> int:
    """Starts one local process per task, each running `run_task` on the same config.

    With ``cluster.mode = "nodes"`` these are this host's tasks of a multi-node job:
    the launcher meets the other hosts at ``cluster.master`` (`tfdist.launch.rendezvous`).
    """
    from tfdist.launch import LaunchError, RendezvousError, run
    from tfdist.launch.api import restarts_for

    cluster = config["cluster"]
    if cluster["mode"] in ("spark", "ray"):
        return _engine_job(cluster, json.loads(config_path.read_text()))
    argv = [sys.executable, "-m", "tfdist.train", "--task", str(config_path)]
    if config["strategy"]["name"] == "horovod":
        return _horovodrun(cluster, argv)
    nodes = {}
    if cluster["mode"] == "nodes":
        nodes = dict(nnodes=cluster["nnodes"], node_rank=cluster["node_rank"],
                     master=cluster["master"])
    try:
        run(argv, workers=cluster["workers"], chief=cluster["chief"],
            ps=cluster["ps"], timeout=cluster["timeout"],
            max_restarts=cluster["max_restarts"],
            backup_dir=str(Path(config["train"]["output_dir"]) / "backup"),
            restarts=restarts_for(cluster["chief"], cluster["ps"]), **nodes)
    except (LaunchError, RendezvousError) as error:
        print(f"tfdist train: FAILED: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _engine_job(cluster: dict[str, Any], snapshot: dict[str, Any]) -> int:
    """``cluster.mode = "spark"`` / ``"ray"``: every task runs `run_task` on that engine,
    on ``cluster.master`` (default: ``local[workers]``, or a local Ray instance)."""
    from tfdist.launch import LaunchError

    # The tasks run in the engine's working directory: give them absolute paths.
    config = snapshot["config"]
    for section, key in (("train", "output_dir"), ("data", "path")):
        if config[section][key]:
            config[section][key] = os.path.abspath(config[section][key])
    options = dict(workers=cluster["workers"], timeout=cluster["timeout"])
    try:
        if cluster["mode"] == "spark":
            from tfdist import spark

            with spark.session(cluster["master"] or f"local[{cluster['workers']}]",
                               "tfdist train") as session:
                spark.run(_snapshot_task, snapshot, spark=session, **options)
        else:
            from tfdist import ray

            with ray.connect(cluster["master"] or None):
                ray.run(_snapshot_task, snapshot, **options)
    except LaunchError as error:
        print(f"tfdist train: FAILED: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _snapshot_task(snapshot: dict[str, Any]) -> None:
    """One task of a Spark or Ray job (see `_task_entry`); fails on a config error."""
    if _run_snapshot(snapshot):
        raise SystemExit(2)


def _horovodrun(cluster: dict[str, Any], argv: list[str]) -> int:
    from tfdist.launch import LaunchError, run_command, split_horovod_prefix

    n = cluster["workers"] + int(cluster["chief"])
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    command = [horovodrun, "-np", str(n), "-H", f"localhost:{n}", "--gloo", *argv]
    # Run and relayed as `tfdist launch` runs a task: it dies with this process, and its
    # output comes live with the launcher's prefix ("[1]<stdout>:..." -> "[worker-1] ...").
    try:
        return run_command(command, timeout=cluster["timeout"], stream=sys.stdout,
                           route=split_horovod_prefix)
    except LaunchError as error:
        print(f"tfdist train: {error}", file=sys.stderr)
        return 1


def config_name(path: str | os.PathLike | None) -> str:
    """The name a report gives a config: its file name without ``.toml``."""
    return Path(path).stem if path is not None else "defaults"


def node_overrides(args) -> list[str]:
    """``--nnodes/--node-rank/--master`` as ``--set`` overrides (with
    ``cluster.mode="nodes"`` when any is given)."""
    flags = {"nnodes": getattr(args, "nnodes", None),
             "node_rank": getattr(args, "node_rank", None),
             "master": getattr(args, "master", None)}
    given = [f"cluster.{key}={json.dumps(value)}" for key, value in flags.items()
             if value is not None]
    return ['cluster.mode="nodes"', *given] if given else []


def main(args) -> int:
    """``tfdist train``: load and check, lock the output directory, then run here or
    launch the tasks."""
    source = str(args.config) if args.config is not None else "<defaults>"
    try:
        config = load_config(args.config, [*args.set, *node_overrides(args)])
        check_job(config, source)
        out = Path(config["train"]["output_dir"])
        try:
            out.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as error:  # ValueError: a name not encodable
            raise ConfigError(f"{source}: train.output_dir cannot be created: {error}. "
                              f"Received: {str(out)!r}") from None
        lock = lock_output_dir(out) if _holds_lock(config) else None
    except ConfigError as error:
        print(f"tfdist train: error: {error}", file=sys.stderr)
        return 2
    name = config_name(args.config)
    try:
        launched = is_multi_process(config) and config["cluster"]["mode"] in (
            "local", "nodes", "spark", "ray")
        if lock is not None:  # the launcher points its tasks at OUTPUT_DIR/backup
            prepare_backup(config, out / "backup" if launched else backup_dir(config))
        if launched and config["strategy"]["name"] == "horovod" and \
                config["cluster"]["max_restarts"]:
            print("tfdist train: cluster.max_restarts does not apply to horovod (horovodrun "
                  "does not restart ranks); run the same command again to resume from "
                  f"{out / 'backup'}", file=sys.stderr, flush=True)
        if launched:
            if lock is not None:  # not on the other nodes of a multi-node job
                text = json.dumps(config, indent=2)
                write_atomic(out / "config.resolved.json", lambda tmp: tmp.write_text(text))
            # The tasks (and their restarts) read this job's own snapshot.
            with tempfile.TemporaryDirectory(prefix="tfdist-job-") as job_dir:
                snapshot = Path(job_dir) / "config.json"
                snapshot.write_text(json.dumps({"name": name, "config": config}))
                code = launch_job(config, snapshot)
        else:
            try:
                run_task(config, name)
            except ConfigError as error:
                print(f"tfdist train: error: {source}: {error}", file=sys.stderr)
                return 2
            code = 0
    finally:
        if lock is not None:
            os.close(lock)
    if code == 0 and lock is None:  # not the chief's process: it writes nothing
        print("tfdist train: this node's tasks finished; node 0 writes the report" if launched
              else "tfdist train: this task finished; the chief writes the report", flush=True)
    elif code == 0:
        print(f"tfdist train: wrote {out / 'report.json'}, {out / 'report.png'} and "
              f"{out / 'model.keras'}", flush=True)
    return code


def compare_main(args) -> int:
    """``tfdist compare``: runs each config, then one table and one plot side by side."""
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for index, config_file in enumerate(args.configs):
        run_dir = out / f"{index}-{Path(config_file).stem}"
        command = [sys.executable, "-m", "tfdist.cli", "train", config_file,
                   "--set", f"train.output_dir={json.dumps(str(run_dir))}",
                   *sum((["--set", s] for s in args.set), [])]
        print(f"tfdist compare: [{index + 1}/{len(args.configs)}] {config_file}", flush=True)
        if subprocess.run(command).returncode:
            print(f"tfdist compare: {config_file} failed", file=sys.stderr)
            return 1
        report = json.loads((run_dir / "report.json").read_text())
        report["name"] = Path(config_file).stem
        reports.append(report)
    rows = [("config", "strategy", "topology", "val_accuracy", "loss", "time (s)",
             "bytes communicated")]
    for r in reports:
        rows.append((r["name"], r["strategy"], describe_topology(r),
                     f"{r['final'].get('val_accuracy', float('nan')):.4f}",
                     f"{r['final'].get('loss', float('nan')):.4f}",
                     f"{r['wall_time_seconds']:.1f}", f"{r['bytes_communicated']:,}"))
    table = format_table(rows)
    print(table)
    summary = [{k: r.get(k) for k in ("name", "strategy", "num_replicas", "workers", "ps",
                                      "final", "wall_time_seconds", "bytes_communicated",
                                      "history")}
               for r in reports]
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    (out / "compare.md").write_text(
        "```\n" + table + "\n```\n\nbytes communicated: gradients all-reduced (mirrored, "
        "multi-worker, Horovod), weights averaged (model average), or nothing counted "
        "(parameter server: workers push gradients to the ps).\n")
    plot_compare(summary, out / "compare.png")
    print(f"tfdist compare: wrote {out / 'compare.json'}, {out / 'compare.md'} and "
          f"{out / 'compare.png'}")
    return 0


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")


def coinciding(curves: dict[str, list[float]], atol: float = 1e-6) -> list[list[str]]:
    """Groups of names whose curves are the same (same length, values within ``atol``)."""
    groups: list[list[str]] = []
    for name, curve in curves.items():
        for group in groups:
            other = curves[group[0]]
            if len(other) == len(curve) and all(abs(a - b) <= atol
                                                for a, b in zip(other, curve)):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def plot_compare(summary: list[dict], path: Path) -> None:
    """Validation accuracy per epoch, and final accuracy against bytes and time.

    Each config has its own marker and line style, and smaller markers are drawn over
    larger ones, so identical curves stay visible; a note names the configs whose
    curves coincide.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric = "val_accuracy" if all(r["history"].get("val_accuracy") for r in summary) \
        else "accuracy"
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    curves = {}
    for index, r in enumerate(summary):
        curve = r["history"].get(metric, [])
        curves[r["name"]] = curve
        style = dict(marker=_MARKERS[index % len(_MARKERS)], label=r["name"],
                     markersize=9 - 1.5 * (index % 4), fillstyle="none" if index % 2 else "full")
        axes[0].plot(range(1, len(curve) + 1), curve, linestyle=_LINES[index % len(_LINES)],
                     **style)
        accuracy = r["final"].get(metric, 0.0)
        style.pop("label")
        axes[1].plot(max(r["bytes_communicated"], 1), accuracy, linestyle="none",
                     label=r["name"], **style)
        axes[2].plot(r["wall_time_seconds"], accuracy, linestyle="none", label=r["name"],
                     **style)
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set(xlabel="epoch", ylabel=metric, title=f"{metric} per epoch")
    sent = [max(r["bytes_communicated"], 1) for r in summary]
    log = max(sent) >= 10 * min(sent)  # a log axis over a narrow range shows no labels
    axes[1].set(xlabel="bytes communicated" + (" (log)" if log else ""),
                ylabel=f"final {metric}", xscale="log" if log else "linear",
                title=f"{metric} vs bytes communicated")
    axes[2].set(xlabel="wall time (s)", ylabel=f"final {metric}",
                title=f"{metric} vs time")
    notes = [" = ".join(group) + ": identical curves" for group in coinciding(curves)]
    if notes:
        axes[0].set_xlabel("epoch\n" + "\n".join(notes), fontsize=8)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _task_entry(argv: list[str]) -> int:
    """``python -m tfdist.train --task SNAPSHOT_JSON``: one task of a launched job.

    The snapshot is ``{"name": ..., "config": {...}}`` (or a bare config)."""
    return _run_snapshot(json.loads(Path(argv[1]).read_text()))


def _run_snapshot(snapshot: dict[str, Any]) -> int:
    config, name = (snapshot["config"], snapshot.get("name")) if "config" in snapshot \
        and "strategy" not in snapshot else (snapshot, None)
    try:
        run_task(config, name)
    except ConfigError as error:
        print(f"tfdist train: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--task":
        sys.exit(_task_entry(sys.argv[1:]))
    sys.exit("usage: python -m tfdist.train --task CONFIG_JSON")
