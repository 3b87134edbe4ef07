"""Side-car evaluation: an ``evaluator`` task that evaluates each checkpoint training writes.

What ``tf.keras.utils.SidecarEvaluator`` did for tf-keras, for Keras 3. Start the job with
``tfdist launch --evaluator``; the evaluator task builds the model, then::

    tfdist.keras.SidecarEvaluator(model, val_data, checkpoint_dir="ckpt").start()

while the chief trains with
``tfdist.keras.callbacks.ModelCheckpoint("ckpt/epoch-{epoch:03d}.weights.h5",
save_weights_only=True)``.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import logging
import os
import re
import time

import keras

from tfdist.checks import check_int, check_seconds
from tfdist.keras.callbacks import TRAINING_DONE_FILE

logger = logging.getLogger("tfdist")

CHECKPOINT_PATTERNS = ("*.weights.h5", "*.keras")
CSV_NAME = "evaluation.csv"
SUMMARY_DIR = "evaluation"
_NUMBER = re.compile(r"\d+")
_MAX_LOAD_ATTEMPTS = 3


class SidecarEvaluator:
    """Evaluates every new checkpoint in ``checkpoint_dir`` while training writes them.

    Checkpoints are the files matching ``patterns`` (Keras weights ``*.weights.h5`` or
    whole models ``*.keras``), such as `tfdist.keras.callbacks.ModelCheckpoint` or
    ``keras.callbacks.ModelCheckpoint`` write. The last number in a file's name is its
    epoch (``epoch-003.weights.h5`` -> 3): checkpoints are evaluated in epoch order, each
    one once (a file rewritten under the same name is evaluated again). Hidden files
    (``.tmp-*``, written then renamed into place by tfdist's ``ModelCheckpoint``) are
    ignored, and a file is read only once its size and time have not changed for one
    poll, so an in-place writer is waited for too.

    Each evaluation is logged as one row of ``<log_dir>/evaluation.csv`` (``epoch``,
    ``checkpoint``, then the metrics) and as TensorBoard scalars ``epoch_<metric>`` at
    step ``epoch`` under ``<log_dir>/evaluation``.

    The evaluator ends when training has ended: tfdist's ``ModelCheckpoint`` writes
    ``tfdist_training_done.json`` next to the checkpoints on the chief at the end of
    ``fit``, and once that marker is there (written after this process started) and
    every checkpoint has been evaluated, `start` returns. It also ends after
    ``max_evaluations`` evaluations, and raises `TimeoutError` after ``idle_timeout``
    seconds without a new checkpoint, so it never hangs.

    Args:
        model: A compiled Keras model with the architecture of the trained one (built,
            when loading ``.weights.h5`` files). It is evaluated as it is, without any
            distribution strategy.
        data: What ``model.evaluate`` takes: a ``tf.data.Dataset`` (or other
            iterable of batches), or an ``(x, y)`` / ``(x, y, sample_weight)`` tuple.
        checkpoint_dir: The directory the chief writes its checkpoints to.
        steps: Batches per evaluation (None: the whole of ``data``).
        max_evaluations: Stop after this many evaluations (None: when training ends).
        callbacks: Keras callbacks for ``model.evaluate``.
        log_dir: Where the CSV and the TensorBoard events go; default
            ``<checkpoint_dir>/evaluation``.
        poll_seconds: How often the directory is listed.
        idle_timeout: Seconds without a new checkpoint (and no end of training) after
            which `start` raises `TimeoutError`.
        patterns: File name patterns of checkpoints.
        batch_size: ``model.evaluate``'s batch size for array data.
    """

    def __init__(self, model, data, checkpoint_dir, steps=None, max_evaluations=None,
                 callbacks=None, *, log_dir=None, poll_seconds=1.0, idle_timeout=600.0,
                 patterns=CHECKPOINT_PATTERNS, batch_size=None):
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a keras.Model. Received: model={model!r}")
        if data is None:
            raise ValueError("data is required: a dataset or an (x, y) tuple to evaluate "
                             "on. Received: data=None")
        if steps is not None:
            check_int("steps", steps, 1)
        if max_evaluations is not None:
            check_int("max_evaluations", max_evaluations, 1)
        self.model = model
        self.data = data
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = callbacks
        self.log_dir = os.fspath(log_dir) if log_dir is not None else os.path.join(
            self.checkpoint_dir, "evaluation")
        self.poll_seconds = check_seconds("poll_seconds", poll_seconds)
        self.idle_timeout = check_seconds("idle_timeout", idle_timeout)
        self.patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        self.batch_size = batch_size
        self.results: list[dict] = []
        self._evaluated: dict[str, tuple] = {}  # name -> (size, mtime) evaluated
        self._seen: dict[str, tuple] = {}  # name -> (size, mtime) at the last poll
        self._failures: dict[tuple, int] = {}  # (name, size, mtime) -> failed loads
        self._started = _process_start_time()

    @property
    def csv_path(self) -> str:
        """The CSV file rows are written to."""
        return os.path.join(self.log_dir, CSV_NAME)

    def start(self) -> list[dict]:
        """Evaluates checkpoints until training ends (or ``max_evaluations``).

        Returns:
            One dict per evaluation: ``epoch`` (None when the name has no number),
            ``checkpoint`` (the file name) and the metrics ``model.evaluate`` returned.

        Raises:
            TimeoutError: no new checkpoint and no end of training for ``idle_timeout``.
        """
        import tensorflow as tf

        os.makedirs(self.log_dir, exist_ok=True)
        self.results = []
        writer = tf.summary.create_file_writer(os.path.join(self.log_dir, SUMMARY_DIR))
        last_progress = time.monotonic()
        with open(self.csv_path, "w", newline="") as csv_file:
            while True:
                finished = self._training_ended()  # before listing: no checkpoint missed
                pending = self._pending()
                for name in self._stable(pending):
                    if self._evaluate(name, csv_file, writer):
                        last_progress = time.monotonic()
                        if len(self.results) == self.max_evaluations:
                            return self.results
                if finished and not self._pending():
                    return self.results
                idle = time.monotonic() - last_progress
                if idle > self.idle_timeout:
                    raise TimeoutError(
                        f"SidecarEvaluator: no new checkpoint in {self.checkpoint_dir!r} "
                        f"for {idle:.0f}s and no end-of-training marker "
                        f"({TRAINING_DONE_FILE}); evaluated {len(self.results)} "
                        f"checkpoint(s). Received: idle_timeout={self.idle_timeout:g}")
                time.sleep(self.poll_seconds)

    # ---- the directory --------------------------------------------------------------

    def _training_ended(self) -> bool:
        """Whether this run's end-of-training marker is there (an older run's is not)."""
        try:
            return os.stat(os.path.join(self.checkpoint_dir, TRAINING_DONE_FILE)).st_mtime \
                >= self._started
        except FileNotFoundError:
            return False

    def _pending(self) -> list[str]:
        """Checkpoint names not evaluated in their current version, in epoch order."""
        try:
            names = os.listdir(self.checkpoint_dir)
        except FileNotFoundError:
            return []
        pending = []
        for name in names:
            if name.startswith(".") or not any(fnmatch.fnmatch(name, p)
                                               for p in self.patterns):
                continue
            signature = _signature(os.path.join(self.checkpoint_dir, name))
            if signature is None or self._evaluated.get(name) == signature or \
                    self._failures.get((name, *signature), 0) >= _MAX_LOAD_ATTEMPTS:
                continue
            pending.append(name)
        return sorted(pending, key=lambda n: (_epoch_of(n) is None, _epoch_of(n) or 0, n))

    def _stable(self, names: list[str]) -> list[str]:
        """Those of ``names`` unchanged since the last poll (so no longer being written)."""
        stable = []
        for name in names:
            signature = _signature(os.path.join(self.checkpoint_dir, name))
            if signature is not None and self._seen.get(name) == signature:
                stable.append(name)
            self._seen[name] = signature
        return stable

    # ---- one evaluation -------------------------------------------------------------

    def _evaluate(self, name: str, csv_file, writer) -> bool:
        """Loads and evaluates checkpoint ``name``; False if it could not be loaded."""
        import tensorflow as tf

        path = os.path.join(self.checkpoint_dir, name)
        signature = _signature(path)
        if signature is None:
            return False
        try:
            self.model.load_weights(path)
        except (OSError, ValueError, KeyError) as error:
            key = (name, *signature)
            self._failures[key] = self._failures.get(key, 0) + 1
            logger.warning("SidecarEvaluator: could not load %s (%s: %s)%s", path,
                           type(error).__name__, error,
                           "; skipping it" if self._failures[key] >= _MAX_LOAD_ATTEMPTS
                           else "; retrying")
            return False
        metrics = self.model.evaluate(self._x(), *self._y_and_weights(), steps=self.steps,
                                      callbacks=self.callbacks, batch_size=self.batch_size,
                                      verbose=0, return_dict=True)
        self._evaluated[name] = signature
        epoch = _epoch_of(name)
        row = {"epoch": epoch, "checkpoint": name,
               **{k: float(v) for k, v in sorted(metrics.items())}}
        self.results.append(row)
        self._write_csv(csv_file, row)
        step = epoch if epoch is not None else len(self.results)
        with writer.as_default():
            for key, value in row.items():
                if key not in ("epoch", "checkpoint"):
                    tf.summary.scalar(f"epoch_{key}", value, step=step)
        writer.flush()
        logger.info("SidecarEvaluator: %s: %s", name, json.dumps(row))
        return True

    def _x(self):
        return self.data[0] if isinstance(self.data, tuple) else self.data

    def _y_and_weights(self):
        return tuple(self.data[1:]) if isinstance(self.data, tuple) else ()

    def _write_csv(self, csv_file, row: dict) -> None:
        writer = csv.DictWriter(csv_file, fieldnames=list(row), extrasaction="ignore",
                                restval="")
        if csv_file.tell() == 0:
            writer.writeheader()
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
        csv_file.flush()


def _signature(path: str) -> tuple[int, int] | None:
    """``(size, mtime_ns)`` of a file, or None if it is gone."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _epoch_of(name: str) -> int | None:
    """The last number in a file name: ``epoch-003.weights.h5`` -> 3 (None if none)."""
    numbers = _NUMBER.findall(name.split(".", 1)[0])
    return int(numbers[-1]) if numbers else None


def _process_start_time() -> float:
    """When this process started (wall clock), so an older run's marker is ignored."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
