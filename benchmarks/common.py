"""Shared benchmark plumbing: arguments, timing, machine facts, tables, figures, tasks."""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.horovodrun import run_horovod  # noqa: F401  (sections import it from here)

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / "benchmarks"  # where the committed results live
QUICK_DIR = Path(tempfile.gettempdir()) / "tfdist-bench-quick"

# A section's process exits without the interpreter's last garbage collection over
# TensorFlow's objects (seconds on a busy machine), as the tests' job scripts do:
# atexit runs it after the handlers registered later.
atexit.register(gc.freeze)


# ---- arguments and figures, the same for every section ----------------------------------

def section_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The arguments every section (and the runner) takes: ``--quick`` and ``--output``.

    Add a section's own arguments to it, then call `parse_section_args`.
    """
    parser = argparse.ArgumentParser(
        prog=f"python -m {name}", description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one repetition: a smoke run, not a result")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help=f"directory for the reports, JSON and plots (default: "
                             f"benchmarks/; with --quick: {QUICK_DIR}, so a smoke run never "
                             f"overwrites the committed results)")
    return parser


def parse_section_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parses ``argv``; ``args.output`` becomes an existing directory (a `Path`)."""
    args = parser.parse_args(argv)
    args.output = output_dir(args.output, args.quick)
    return args


def engine_section_args(name: str, doc: str | None, argv=None,
                        more=None) -> argparse.Namespace:
    """A section's arguments with ``--engine``: `section_parser`'s, then ``more(parser)``'s
    (a section's own, if given), parsed; ``args.engine`` is "horovod" if Horovod works
    here, else "tf", unless given."""
    parser = section_parser(f"benchmarks.{name}", doc)
    parser.add_argument("--engine", choices=("horovod", "tf"), default=None,
                        help="default: horovod if installed, else tf")
    if more is not None:
        more(parser)
    args = parse_section_args(parser, argv)
    args.engine = args.engine or ("tf" if horovod_missing() else "horovod")
    return args


def output_dir(output: str | Path | None, quick: bool) -> Path:
    """``output``, or by default benchmarks/ (QUICK_DIR with --quick), created."""
    path = Path(output or (QUICK_DIR if quick else BENCH_DIR)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def pyplot():
    """``matplotlib.pyplot`` drawing to files only (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> None:
    """Lays out ``fig``, writes it to ``path`` (PNG) and frees it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def machine_info() -> dict:
    """Machine and versions, recorded next to every result (from the packages' metadata:
    no TensorFlow import in a section's own process)."""
    info = {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "platform": platform.platform()}
    tensorflow = package_version("tensorflow", "tensorflow-cpu", "tf-nightly")
    if tensorflow is not None:
        info.update(tensorflow=tensorflow, keras=package_version("keras"))
    info["horovod"] = package_version("horovod")
    return info


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed, or None."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def interleaved_medians(candidates: dict, rounds: int, repeats: int) -> dict:
    """Times each callable ``repeats`` times per round, alternating candidates every
    round so machine noise hits all of them alike. Returns the median seconds per call."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            samples[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(values) for name, values in samples.items()}


def markdown_table(rows: list[list]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in body]
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2))


def load_json(path: str | Path | None) -> dict | None:
    """The JSON in ``path``, or None if there is no such file or it is not JSON."""
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


# ---- section reports, tasks, and the digits workload ---------------------------------------


def write_section(out: str | Path, name: str, markdown: str, data: dict) -> None:
    """Writes a section's report: ``OUT/name.md`` (shown in RESULTS.md) and ``name.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
    write_json(out / f"{name}.json", data)


def skip_section(out: str | Path, name: str, title: str, reason: str, data=None) -> None:
    """Records a whole section as skipped, with the reason, and prints it."""
    write_section(out, name, f"# {title}\n\nskipped: {reason}\n",
                  {"skipped": reason, **(data or {})})
    print(f"{name}: skipped: {reason}", flush=True)


def task_env(extra: dict | None = None) -> dict:
    """Environment for benchmark tasks: the checkout importable, TF quiet."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT),
                                                     os.environ.get("PYTHONPATH", "")) if p),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.update(extra or {})
    return env


def run_tasks(fn, *args, workers: int = 2, chief: bool = False, ps: int = 0,
              timeout: float = 600, cluster=None, wrap=None, env=None, stream=None,
              **kwargs) -> list:
    """Runs module-level ``fn(*args, **kwargs)`` in every task of a cluster.

    Like `tfdist.launch` with a function, plus `tfdist.launch.run`'s ``cluster`` and
    ``wrap`` (tasks in network namespaces). Returns the values in task order (chief,
    workers, ps; ps tasks and tasks that never return give None).
    """
    import sys

    import cloudpickle

    from tfdist.launch import run
    from tfdist.launch.api import restarts_for

    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as tmp:
        payload = Path(tmp, "payload.pkl")
        payload.write_bytes(cloudpickle.dumps((fn, args, kwargs)))
        os.chmod(tmp, 0o755)  # readable from other namespaces' processes (same user)
        result = run([sys.executable, "-m", "tfdist.runners.task_main", str(payload), tmp],
                     workers=workers, chief=chief, ps=ps, timeout=timeout,
                     env=task_env(env), stream=stream, cluster=cluster, wrap=wrap,
                     restarts=restarts_for(chief, ps))
        values = []
        for task in result.cluster.tasks():
            path = Path(tmp, f"{task.name}.result.pkl")
            values.append(cloudpickle.loads(path.read_bytes()) if path.exists() else None)
        return values


# The runner probes Horovod once and passes the answer to every section ("" = works).
HOROVOD_MISSING_ENV = "TFDIST_BENCH_HOROVOD_MISSING"


def horovod_missing() -> str | None:
    """Why Horovod cannot run here, or None if ``import horovod.tensorflow`` works (in a
    subprocess: it imports TensorFlow; the runner's answer in `HOROVOD_MISSING_ENV`, if
    set)."""
    import subprocess
    import sys

    if HOROVOD_MISSING_ENV in os.environ:
        return os.environ[HOROVOD_MISSING_ENV] or None
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                           capture_output=True, text=True, env=dict(os.environ,
                                                                    TF_CPP_MIN_LOG_LEVEL="3"))
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"horovod not installed ({last})"
    return None


def digits_data():
    """sklearn's 8x8 digits: x (1797, 8, 8, 1) float32 in [0, 1], y int32."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype(np.float32)
    return x, digits.target.astype(np.int32)


def digits_cnn(seed: int = 0, width: int = 64):
    """The small CNN of the throughput and slow-link benchmarks (~137k parameters)."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])


def compile_digits(model, learning_rate: float = 0.05):
    import keras

    model.compile(keras.optimizers.SGD(learning_rate),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def digits_dataset(batch_size: int, seed: int = 0, shard_policy: str = "DATA"):
    """Shuffled, repeated digits batched to ``batch_size`` (the global batch)."""
    import tensorflow as tf

    x, y = digits_data()
    data = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed)
            .repeat().batch(batch_size, drop_remainder=True))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, shard_policy)
    return data.with_options(options)


class EpochTimer:
    """A Keras callback that keeps the wall time of every epoch (``.seconds``)."""

    def __new__(cls):
        import keras

        class _Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds = []

            def on_epoch_begin(self, epoch, logs=None):
                self._start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        return _Timer()
