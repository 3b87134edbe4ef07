"""One task of the main job: builds the strategy, the model and the data, resumes from
the backup, runs ``fit``, keeps the history, and on the chief writes the report.

``python -m tfdist.train --task SNAPSHOT_JSON`` (see `tfdist.train.__main__`) runs one
task of a launched job; Spark and Ray run `snapshot_task`.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tfdist import env
from tfdist.config import ConfigError, is_multi_process
from tfdist.files import check_free_space, describe_disk_full, is_disk_full, model_save_size
from tfdist.strategies import registry
from tfdist.train.checks import slurm_port, strategy_kwargs
from tfdist.train.outdir import BACKUP_HISTORY_FILE, backup_dir, write_atomic
from tfdist.train.report import format_table, plot_history

# Test hook: "TASK:K" or "K" makes that task SIGKILL itself after epoch K (after its
# backup is written), on the first attempt only. For tests of resuming.
KILL_AFTER_EPOCH_ENV = env.TEST_KILL_AFTER_EPOCH


def build_strategy(config: dict[str, Any]):
    """The strategy a config names, built with its options. Call before other TF work."""
    import tensorflow as tf

    from tfdist import devices

    entry, options = registry.get(config["strategy"]["name"]), strategy_kwargs(config)
    try:
        if entry.class_name is None:
            return tf.distribute.get_strategy()
        if entry.replicas == registry.REPLICA_PER_DEVICE:
            devices.use_logical_cpus(config["cluster"]["logical_cpus"])
        return getattr(importlib.import_module(entry.module), entry.class_name)(**options)
    except TypeError as error:
        raise ConfigError(f"strategy.options do not fit strategy {entry.name!r}: {error}") \
            from None


def export_slurm_cluster(config: dict[str, Any]) -> None:
    """In a Slurm job step without TF_CONFIG, writes the TF_CONFIG Slurm implies."""
    if config["cluster"]["mode"] != "env" or os.environ.get(env.TF_CONFIG):
        return
    if "SLURM_PROCID" in os.environ and not registry.get(config["strategy"]["name"]).horovodrun:
        from tfdist.cluster import from_slurm

        spec = from_slurm(port=slurm_port(), chief=config["cluster"]["chief"],
                          ps=config["cluster"]["ps"])
        os.environ[env.TF_CONFIG] = spec.to_tf_config()


def is_chief_task(config: dict[str, Any], strategy) -> bool:
    """True on the task that reports and writes the model: Horovod's rank 0, or
    TF_CONFIG's chief."""
    if registry.get(config["strategy"]["name"]).horovodrun:
        return strategy.rank == 0
    if os.environ.get(env.TF_CONFIG):
        from tfdist.cluster import ClusterSpec

        return ClusterSpec.from_env().is_chief()
    return True


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
    if spec and os.environ.get(env.RESTART, "0") == "0" and \
            task in ("", os.environ.get(env.TASK, "worker-0")):

        class KillAfterEpoch(keras.callbacks.Callback):
            def on_epoch_end(self, index, logs=None):
                if index + 1 == int(epoch):
                    print(f"tfdist train: {KILL_AFTER_EPOCH_ENV}: killing this task after "
                          f"epoch {epoch}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(KillAfterEpoch())
    return callbacks


def _topology(config: dict[str, Any], strategy) -> dict[str, int]:
    """``{"workers": ..., "ps": ...}``: the training processes and parameter servers."""
    entry = registry.get(config["strategy"]["name"])
    if entry.horovodrun:
        return {"workers": strategy.size, "ps": 0}
    if os.environ.get(env.TF_CONFIG) and is_multi_process(config):
        from tfdist.cluster import ClusterSpec

        spec = ClusterSpec.from_env()
        if entry.ps:
            return {"workers": len(spec.worker), "ps": len(spec.ps)}
        return {"workers": spec.num_workers, "ps": 0}
    return {"workers": 1, "ps": 0}


def run_task(config: dict[str, Any], name: str | None = None) -> dict[str, Any] | None:
    """Trains as one task of the job. Returns the report on the chief, else None.

    Resumes from the backup in `backup_dir` when there is one (a restarted task). Every
    mode that keeps Keras' ``fit`` (all but ``parameter_server``, whose registry entry
    says it replaces ``fit``) feeds it batches whose order depends only on the seed and
    the step (`tfdist.data.make_train_dataset`), so a resumed job ends at the weights of
    an uninterrupted one.

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
    chief = is_chief_task(config, strategy)
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
    if registry.get(config["strategy"]["name"]).replaces_fit:
        # Its own fit shards numpy arrays over its workers itself.
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
        if getattr(strategy, "save_needs_every_worker", False):
            _save_with_the_chief(model)
        return None
    report = {
        "config": config,
        "name": name or "config",
        "strategy": type(strategy).__name__,
        "num_replicas": int(strategy.num_replicas_in_sync),
        **_topology(config, strategy),
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
    check_free_space(out / "model.keras", model_save_size(model))  # h5py: SIGSEGV when full
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


def _save_with_the_chief(model) -> None:
    """Takes part in the chief's ``model.save`` when the strategy's save runs collectives
    (``save_needs_every_worker``: sharded optimizer state is gathered from every worker,
    docs/zero.md). This worker's copy is written to a temporary directory and removed,
    as in stock TF's multi-worker saving."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tfdist-save-") as tmp:
        model.save(os.path.join(tmp, "model.keras"))


def run_snapshot(snapshot: dict[str, Any]) -> int:
    """Runs a task of the job in ``snapshot``; returns its exit code (2: a config error).

    The snapshot is ``{"name": ..., "config": {...}}`` (or a bare config)."""
    config, name = (snapshot["config"], snapshot.get("name")) if "config" in snapshot \
        and "strategy" not in snapshot else (snapshot, None)
    try:
        run_task(config, name)
    except ConfigError as error:
        print(f"tfdist train: error: {error}", file=sys.stderr, flush=True)
        return 2
    except OSError as error:
        if not is_disk_full(error):
            raise
        print(f"tfdist train: FAILED: {describe_disk_full(error)}", file=sys.stderr,
              flush=True)
        return 1
    return 0


def snapshot_task(snapshot: dict[str, Any]) -> None:
    """One task of a Spark or Ray job (see `run_snapshot`); fails on a config error."""
    if run_snapshot(snapshot):
        raise SystemExit(2)
