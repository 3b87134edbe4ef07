"""Chief-aware Keras callbacks: only the chief writes the real path.

Keras 3's `ModelCheckpoint`, `BackupAndRestore` and `CSVLogger` have no multi-worker
logic: every worker writes the same file. Under tfdist's strategies Keras' own classes
work too (other workers write to a temporary directory during ``fit``); these classes
are the explicit API, usable with any strategy. They make every worker
run the same code (saving reads distributed variables, which may need all workers), but
only the chief writes to the target path; the other workers write to a private
temporary path that is removed right after.

Who is chief comes from the model's strategy (``extended.should_checkpoint`` and its
cluster resolver), or else from TF_CONFIG. Without a cluster every process is chief.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shutil

import keras

from tfdist import env
from tfdist._hooks.keras_callbacks import BackupHooks, CheckpointHooks
from tfdist._hooks.keras_trainer import set_initial_epoch
from tfdist.cluster import ClusterSpec
from tfdist.files import (check_free_space, commit, model_save_size, private_temp_dir,
                          temp_path_for, write_text_atomic)
from tfdist.keras.guards import StopOnNaN  # noqa: F401  (re-exported)
from tfdist.keras.warmup import LinearScalingWarmup  # noqa: F401  (re-exported)

BACKUP_DIR_ENV = env.BACKUP_DIR
# Written by the chief's `ModelCheckpoint` next to its checkpoints when training ends;
# `tfdist.keras.SidecarEvaluator` stops once it has seen it.
TRAINING_DONE_FILE = "tfdist_training_done.json"
logger = logging.getLogger("tfdist")


def task_info(strategy=None) -> tuple[bool, str]:
    """``(is_chief, task_name)`` of this process, e.g. ``(False, "worker-1")``.

    Args:
        strategy: The model's distribution strategy, or None to read TF_CONFIG only.
    """
    extended = getattr(strategy, "extended", None)
    if hasattr(strategy, "task_name") and hasattr(extended, "should_checkpoint"):
        return bool(extended.should_checkpoint), strategy.task_name  # tfdist's strategies
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    task_type = getattr(resolver, "task_type", None)
    if task_type is not None:
        name = f"{task_type}-{int(getattr(resolver, 'task_id', 0) or 0)}"
        extended = getattr(strategy, "extended", None)
        if extended is not None and hasattr(extended, "should_checkpoint"):
            return bool(extended.should_checkpoint), name
    if os.environ.get(env.TF_CONFIG):
        cluster = ClusterSpec.from_env()
        if cluster.task is not None:
            return cluster.is_chief(), cluster.task.name
    return True, "worker-0"


def _model_strategy(model):
    return getattr(model, "distribute_strategy", None) if model is not None else None


class _ChiefAware:
    """Mixin: ``self.is_chief``/``self.task_name`` and a private temp directory."""

    _tfdist_chief_aware = True  # strategies leave these callbacks' paths alone
    _tmpdir: str | None = None

    def _task(self):
        return task_info(_model_strategy(getattr(self, "model", None)))

    @property
    def is_chief(self) -> bool:
        return self._task()[0]

    @property
    def task_name(self) -> str:
        return self._task()[1]

    def _temp_dir(self) -> str:
        if self._tmpdir is None or not os.path.isdir(self._tmpdir):
            self._tmpdir = private_temp_dir(self.task_name)
        return self._tmpdir

    def _remove_temp_dir(self):
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


class ModelCheckpoint(_ChiefAware, CheckpointHooks):
    """`keras.callbacks.ModelCheckpoint` where only the chief writes ``filepath``.

    Every worker saves (and so takes part in any collective the save needs); the
    others save to a temporary file that is deleted right away. Same arguments as
    Keras' class.

    The chief writes each checkpoint to a hidden ``.tmp-*`` sibling and renames it into
    place, so a reader (`tfdist.keras.SidecarEvaluator`) never sees a partial file. When
    training ends it writes ``tfdist_training_done.json`` (`TRAINING_DONE_FILE`, holding
    the number of epochs done) in the checkpoints' directory, and removes it when
    training begins.
    """

    _final_path = None

    def checkpoint_path(self, path):
        if self.is_chief:
            self._final_path = path
            return str(temp_path_for(path))
        return os.path.join(self._temp_dir(), os.path.basename(path))

    def save_checkpoint(self, save):
        self._final_path = None
        try:
            save()
            temp = temp_path_for(self._final_path) if self._final_path else None
            if temp is not None and os.path.exists(temp):
                commit(temp, self._final_path)
        finally:
            if self._final_path:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(temp_path_for(self._final_path))
            if not self.is_chief:
                self._remove_temp_dir()

    def _done_marker(self):
        """The training-done marker's path, or None if the directory is templated."""
        directory = os.path.dirname(os.fspath(self.filepath))
        return None if "{" in directory else os.path.join(directory, TRAINING_DONE_FILE)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        marker = self._done_marker()
        if self.is_chief and marker is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(marker)
        self._epochs_done = 0

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._epochs_done = epoch + 1

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        marker = self._done_marker()
        if self.is_chief and marker is not None:
            os.makedirs(os.path.dirname(marker) or ".", exist_ok=True)
            write_text_atomic(marker, json.dumps({"epochs": self._epochs_done}))


class BackupAndRestore(_ChiefAware, BackupHooks):
    """`keras.callbacks.BackupAndRestore` for many workers: resume after a crash.

    The chief keeps the backup in ``backup_dir``; the other workers write theirs to a
    temporary directory that is removed after each save. On start every worker
    restores from ``backup_dir`` (so it must be on storage every worker can read, as
    with any multi-host checkpoint). A backup is committed atomically: the weights go
    to a new file first, then a small JSON file naming them is renamed into place, so
    a worker killed mid-save leaves the previous backup usable.

    Args:
        backup_dir: Directory for the backup; default: ``$TFDIST_BACKUP_DIR`` (set by
            ``tfdist launch --backup-dir``).
        save_freq: ``"epoch"`` or a number of batches, as in Keras. A restart resumes
            at the start of the epoch of the last backup (Keras' rule), so use
            ``"epoch"`` when runs must be reproducible.
        delete_checkpoint: Whether the chief deletes the backup when training ends.
    """

    _STATE = "tfdist_backup.json"
    _PREVIOUS_STATE = "tfdist_backup.prev.json"

    def __init__(self, backup_dir=None, save_freq="epoch", delete_checkpoint=True):
        backup_dir = backup_dir or os.environ.get(BACKUP_DIR_ENV)
        if not backup_dir:
            raise ValueError("backup_dir is required: pass it or set "
                             f"{BACKUP_DIR_ENV}. Received: backup_dir={backup_dir!r}")
        super().__init__(os.fspath(backup_dir), save_freq=save_freq, double_checkpoint=False,
                         delete_checkpoint=delete_checkpoint)
        self._saves = 0

    def _state_path(self, directory=None, previous=False):
        name = self._PREVIOUS_STATE if previous else self._STATE
        return os.path.join(directory or self.backup_dir, name)

    def restore_backup(self):
        """Restores the newest readable backup; a broken one is named and set aside."""
        candidates = [p for p in (self._state_path(), self._state_path(previous=True))
                      if os.path.exists(p)]
        if not candidates:
            return
        if not self.model.built:
            raise ValueError("BackupAndRestore needs a built model before fit(). "
                             f"Received: an unbuilt model {self.model.name!r}")
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        problems = []
        for state_path in candidates:
            state, broken, problem = _read_backup(state_path, self.backup_dir)
            if state is None:
                problems.append(f"{broken}: {problem}")
                logger.warning("BackupAndRestore: the backup %s is unreadable (%s); trying "
                               "the previous one.", broken, problem)
                if self.is_chief:
                    _set_aside(broken)
                continue
            try:
                self.model.load_weights(os.path.join(self.backup_dir, state["weights"]))
            except (OSError, ValueError, KeyError) as error:
                broken = os.path.join(self.backup_dir, state["weights"])
                problems.append(f"{broken}: {type(error).__name__}: {error}")
                logger.warning("BackupAndRestore: the backup %s is unreadable (%s: %s); "
                               "trying the previous one.", broken, type(error).__name__, error)
                if self.is_chief:
                    _set_aside(broken)
                continue
            self._restored(state)
            return
        raise ValueError(f"no usable backup in {self.backup_dir!r}: "
                         + "; ".join(problems) + ". Remove the directory to start afresh.")

    def _restored(self, state):
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and state["epoch"] >= epochs:
            logger.warning("BackupAndRestore: the backup in %s is already complete: it "
                           "holds epoch %d of %d, so fit has nothing left to train.",
                           self.backup_dir, state["epoch"], epochs)
        set_initial_epoch(self.model, state["epoch"])
        self._saves = int(state.get("saves", 0))

    def save_backup(self):
        self._saves += 1
        directory = self.backup_dir if self.is_chief else self._temp_dir()
        os.makedirs(directory, exist_ok=True)
        weights = f"backup-{self._saves}.weights.h5"
        try:
            # Under any strategy (tfdist's save hooks check only under tfdist's own).
            check_free_space(os.path.join(directory, weights), model_save_size(self.model))
            self.model.save_weights(os.path.join(directory, weights), overwrite=True)
            epoch, batch = self.backup_position()
            state = {"epoch": epoch, "batch": batch, "weights": weights, "saves": self._saves}
            current, previous = self._state_path(directory), self._state_path(directory, True)
            if os.path.exists(current):
                os.replace(current, previous)  # kept, with its weights, as the fallback
            write_text_atomic(current, json.dumps(state))  # the commit point
            keep = {weights, _weights_named_in(previous)}
            for name in os.listdir(directory):  # older backups
                if name.startswith("backup-") and name.endswith(".weights.h5") \
                        and name not in keep:
                    os.remove(os.path.join(directory, name))
        finally:
            if not self.is_chief:
                self._remove_temp_dir()

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and self.is_chief and os.path.exists(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)
        self._remove_temp_dir()


class MetricsLogger(_ChiefAware, keras.callbacks.Callback):
    """Writes each epoch's logs to a CSV or JSON-lines file, from the chief only.

    The format follows the file name: ``.csv`` for CSV, ``.json``/``.jsonl`` for one
    JSON object per line. Other workers write each row to a temporary file that is
    removed at once. Every worker's values are the same global values (the strategy
    reduces loss and metrics across workers).

    Args:
        filepath: Target file.
        append: Append to an existing file (e.g. when resuming) instead of replacing it.
    """

    def __init__(self, filepath, append=False):
        super().__init__()
        self.filepath = os.fspath(filepath)
        extension = os.path.splitext(self.filepath)[1].lower()
        if extension not in (".csv", ".json", ".jsonl"):
            raise ValueError("MetricsLogger writes .csv, .json or .jsonl files. "
                             f"Received: filepath={self.filepath!r}")
        self.format = "csv" if extension == ".csv" else "json"
        self.append = append
        self._path = None
        self._keys = None

    def on_train_begin(self, logs=None):
        self._keys = None
        if not self.is_chief:
            return
        self._path = self.filepath
        directory = os.path.dirname(self._path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        if not self.append and os.path.exists(self._path):
            os.remove(self._path)
        if self.format == "csv" and os.path.exists(self._path):
            with open(self._path, newline="") as f:
                header = next(csv.reader(f), None)
            self._keys = header[1:] if header else None

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch}
        row.update({k: _plain(v) for k, v in sorted((logs or {}).items())})
        if self.is_chief:
            self._write_row(self._path, row)
            return
        # Other workers: the same write to a private file, removed at once.
        self._path = os.path.join(self._temp_dir(), os.path.basename(self.filepath))
        try:
            self._write_row(self._path, row)
        finally:
            self._remove_temp_dir()

    def _write_row(self, path, row):
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        with open(path, "a", newline="") as f:
            if self.format == "json":
                f.write(json.dumps(row) + "\n")
                return
            if self._keys is None:
                self._keys = [k for k in row if k != "epoch"]
            writer = csv.DictWriter(f, fieldnames=["epoch", *self._keys],
                                    extrasaction="ignore", restval="")
            if new:
                writer.writeheader()
            writer.writerow(row)


def _read_backup(state_path, backup_dir):
    """``(state, None, None)``, or ``(None, broken_path, problem)`` if it is unusable."""
    try:
        with open(state_path) as f:
            state = json.load(f)
        if not isinstance(state, dict) or not isinstance(state.get("weights"), str) or \
                not isinstance(state.get("epoch"), int):
            raise ValueError(f"not a backup record: {state!r}"[:200])
    except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
        return None, state_path, f"{type(error).__name__}: {error}"
    weights = os.path.join(backup_dir, state["weights"])
    if not os.path.exists(weights):
        return None, weights, "the file is missing"
    return state, None, None


def _weights_named_in(state_path):
    try:
        with open(state_path) as f:
            return json.load(f).get("weights")
    except (OSError, ValueError, AttributeError):
        return None


def _set_aside(path):
    """Renames a broken backup file to ``*.corrupt`` so no later attempt retries it."""
    with contextlib.suppress(OSError):
        os.replace(path, path + ".corrupt")


def _plain(value):
    """A JSON/CSV-friendly Python number for a logged value."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
