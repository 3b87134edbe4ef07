"""Shared benchmark plumbing: interleaved timing, machine facts, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def machine_info() -> dict:
    """Machine and versions, recorded next to every result."""
    info = {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import keras
        import tensorflow as tf

        info.update(tensorflow=tf.__version__, keras=keras.__version__)
    except ImportError:
        pass
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except ImportError:
        info["horovod"] = None
    return info


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


# ---- sections of `tfdist bench`, tasks, and the digits workload --------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]


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
    import tempfile

    import cloudpickle

    from tfdist.launch import run

    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as tmp:
        payload = Path(tmp, "payload.pkl")
        payload.write_bytes(cloudpickle.dumps((fn, args, kwargs)))
        os.chmod(tmp, 0o755)  # readable from other namespaces' processes (same user)
        result = run([__import__("sys").executable, "-m", "tfdist._task_main", str(payload),
                      tmp], workers=workers, chief=chief, ps=ps, timeout=timeout,
                     env=task_env(env), stream=stream, cluster=cluster, wrap=wrap)
        values = []
        for task in result.cluster.tasks():
            path = Path(tmp, f"{task.name}.result.pkl")
            values.append(cloudpickle.loads(path.read_bytes()) if path.exists() else None)
        return values


_HOROVOD_TASK = """
import importlib, os, pickle, sys
module, name, args_path, out_dir = sys.argv[1:5]
with open(args_path, "rb") as f:
    args, kwargs = pickle.load(f)
result = getattr(importlib.import_module(module), name)(*args, **kwargs)
from tfdist.comm import horovod as comm
with open(os.path.join(out_dir, f"rank{comm.rank()}.pkl"), "wb") as f:
    pickle.dump(result, f)
"""


def horovod_missing() -> str | None:
    """Why Horovod cannot run here, or None if ``import horovod.tensorflow`` works."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                           capture_output=True, text=True, env=dict(os.environ,
                                                                    TF_CPP_MIN_LOG_LEVEL="3"))
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"horovod not installed ({last})"
    return None


def run_horovod(fn, *args, np: int = 2, timeout: float = 600, env=None, **kwargs) -> list:
    """Runs module-level ``fn(*args, **kwargs)`` under ``horovodrun --gloo``; values by rank.

    Raises:
        RuntimeError: horovodrun failed or timed out (with the end of its output).
    """
    import pickle
    import signal
    import subprocess
    import sys
    import tempfile

    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-hvd-") as tmp:
        args_path = os.path.join(tmp, "args.pkl")
        with open(args_path, "wb") as f:
            pickle.dump((args, kwargs), f)
        module = fn.__module__
        if module == "__main__":  # a section run as `python -m benchmarks.x`
            spec = getattr(sys.modules["__main__"], "__spec__", None)
            if spec is None:
                raise ValueError(f"run_horovod needs a function of an importable module. "
                                 f"Received: {fn.__qualname__} of a script")
            module = spec.name
        cmd = [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
               "--start-timeout", "120", sys.executable, "-c", _HOROVOD_TASK,
               module, fn.__name__, args_path, tmp]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **task_env(env)),
                                start_new_session=True, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise RuntimeError(f"horovodrun timed out after {timeout:g}s:\n"
                               + output[-2000:]) from None
        if proc.returncode != 0:
            # Horovod's own traceback comes last; the rank's error is in its prefixed lines.
            errors = [line for line in output.splitlines()
                      if "<stderr>" in line and ("Error" in line or "error" in line)]
            raise RuntimeError(f"horovodrun exited with {proc.returncode}: "
                               + (errors[-1].strip() if errors else "see the output below")
                               + "\n" + "\n".join(errors[-10:]) + "\n" + output[-2000:])
        values = []
        for rank in range(np):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                values.append(pickle.load(f))
        return values


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
