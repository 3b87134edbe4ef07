"""Sharded optimizer state (ZeRO-2) against the unsharded run: memory, step time, bytes.

    .venv/bin/python -m benchmarks.zero [--quick] [--output DIR] [--engine horovod|tf]

`tfdist.MultiWorkerMirroredStrategy` with and without ``shard_optimizer_state=True``,
2 and 4 worker processes on 127.0.0.1, a stack of Dense layers of at least 64 MB of
float32 weights trained with Adam (``fit`` on random data). Each worker reports:

- net peak RSS: ``VmHWM`` at the end minus ``VmRSS`` before the model was built;
- optimizer-variable bytes: what its optimizers hold, each variable once
  (`optimizer_state_bytes`; the sharded run: the wrapper's ``variables``, which hold
  its counters, the user's optimizer's and every local slot slice, plus each local
  inner optimizer's counters), split into counters (scalars) and slots;
- reduced-gradient bytes: the gradients it keeps after the reduction (unsharded: every
  gradient; sharded: its slice of every bucket). Both compute the whole local gradient
  during the backward pass;
- model state: weights + reduced gradients + optimizer variables (+ the sharded
  run's slice copy of the weights): ZeRO-2's 4Ψ + 12Ψ/N against 16Ψ;
- step time: the median of the timed steps' times (``fit`` per step);
- wire bytes per step: what one worker sends in a ring (all-reduce 2(N-1)/N x P;
  reduce-scatter and all-gather (N-1)/N x P each; where the engine has no
  reduce-scatter, an all-reduce), and ``bytes_communicated`` as tfdist counts it.

The default engine is Horovod (its ``reducescatter``); on CPU, engine "tf" reduce-scatters
with TF's all-to-all and a local sum (see docs/zero.md).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (engine_section_args, machine_info, markdown_table, run_tasks,
                               write_section)

NAME = "zero"
TITLE = "Sharded optimizer state (ZeRO-2): memory, step time and bytes per worker"


def settings(quick: bool) -> dict:
    if quick:
        return {"width": 256, "layers": 2, "batch": 32, "warmup": 1, "steps": 3,
                "workers": (2,)}
    # 4 x 2048 x 2048 float32 (+ biases): 67 MB of weights.
    return {"width": 2048, "layers": 4, "batch": 64, "warmup": 2, "steps": 8,
            "workers": (2, 4)}


def _rss(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _task(engine, sharded, width, layers, batch, warmup, steps):
    import keras
    import numpy as np

    import tfdist
    from tfdist.comm.communicator import StrategyCommunicator

    start = _rss("VmRSS")
    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine,
                                                  shard_optimizer_state=sharded)
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    rows = batch * max(warmup, steps)  # one epoch covers every step
    x = rng.normal(size=(rows, width)).astype("float32")
    y = rng.normal(size=(rows, width)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width) for _ in range(layers)])
        model.compile(keras.optimizers.Adam(1e-4), loss="mse")

    class StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            self.times.append(time.perf_counter() - self.t0)

    timer = StepTimes()
    timer.times = []
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=warmup, verbose=0)
    before = strategy.bytes_communicated
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[timer])
    counted = (strategy.bytes_communicated - before) / steps
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)

    held = optimizer_state_bytes(model, strategy)
    optimizer_bytes = held["counters"] + held["slots"]
    if sharded:
        state = strategy.sharded_optimizer_state(model.optimizer)
        padded = sum(b.slice_size * n * np.dtype(b.dtype).itemsize for b in state.buckets)
        gradient_bytes = padded // n
        slice_copy = padded // n
        true_scatter = type(strategy.communicator.inner).reduce_scatter_workers is not (
            StrategyCommunicator.reduce_scatter_workers)
        wire = (n - 1) / n * padded * ((1 if true_scatter else 2) + 1)
    else:
        gradient_bytes, slice_copy = weights, 0
        wire = 2 * (n - 1) / n * weights
    return {"rank": strategy.rank, "workers": n, "weights_bytes": weights,
            "optimizer_bytes": optimizer_bytes, "optimizer_counter_bytes": held["counters"],
            "optimizer_slot_bytes": held["slots"],
            "padding_bytes": padded - weights if sharded else 0,  # over all N slices
            "gradient_bytes": gradient_bytes,
            "model_state_bytes": weights + gradient_bytes + optimizer_bytes + slice_copy,
            "net_peak_rss": _rss("VmHWM") - start,
            "step_seconds": statistics.median(timer.times),
            "wire_bytes_per_step": wire, "counted_bytes_per_step": counted}


def optimizer_state_bytes(model, strategy) -> dict:
    """``{"counters", "slots"}``: the bytes of this worker's optimizer variables, each
    counted once: scalars (step counters, learning rates) and the rest (slots).

    Under ``shard_optimizer_state=True`` the model's optimizer is the wrapper, whose
    ``variables`` already hold every local slot slice; the local inner optimizers add
    only their counters.
    """
    import numpy as np

    found = {id(v): v for v in model.optimizer.variables}
    state = strategy.sharded_optimizer_state(model.optimizer)  # None: unsharded
    for inner in (state.optimizers if state is not None else ()):
        found.update((id(v), v) for v in inner.variables)
    out = {"counters": 0, "slots": 0}
    for variable in found.values():
        kind = "slots" if len(variable.shape) else "counters"
        out[kind] += int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
    return out


def _ratios(runs: dict) -> dict:
    """Per N: sharded / unsharded of each measure (the largest worker's)."""
    out = {}
    for n in sorted({r["workers"] for r in runs.values()}):
        plain, shard = runs[f"{n} workers, unsharded"], runs[f"{n} workers, sharded"]
        out[str(n)] = {
            "optimizer_bytes_times_n": shard["optimizer_bytes"] / plain["optimizer_bytes"] * n,
            "optimizer_bytes": shard["optimizer_bytes"] / plain["optimizer_bytes"],
            "model_state": shard["model_state_bytes"] / plain["model_state_bytes"],
            "net_peak_rss": shard["net_peak_rss"] / plain["net_peak_rss"],
            "step_time": shard["step_seconds"] / plain["step_seconds"],
            "wire_bytes": shard["wire_bytes_per_step"] / plain["wire_bytes_per_step"],
        }
    return out


def explain(runs: dict) -> list[str]:
    """One line per N: what the optimizer bytes x N and the model state ratio are made
    of, from the measured bytes (the excess over 1, and over ZeRO-2's bound, named)."""
    lines = []
    for n in sorted({r["workers"] for r in runs.values()}):
        plain, shard = runs[f"{n} workers, unsharded"], runs[f"{n} workers, sharded"]
        total = plain["optimizer_bytes"]
        counters = (shard["optimizer_counter_bytes"] * n - plain["optimizer_counter_bytes"])
        slots = shard["optimizer_slot_bytes"] * n - plain["optimizer_slot_bytes"]
        padding = plain["optimizer_slot_bytes"] * shard["padding_bytes"] / shard["weights_bytes"]
        bound = (4 + 16 / n) / 16  # weights 4Ψ; gradient slice, slots, slice copy 16Ψ/N
        lines.append(
            f"- {n} workers: optimizer bytes x N = {(total + counters + slots) / total:.4f} "
            f"= 1 {counters / total:+.4f} from the counters ({shard['optimizer_counter_bytes']}"
            f" B per worker sharded, {plain['optimizer_counter_bytes']} B unsharded: the "
            f"wrapper's, the user's optimizer's and each local inner optimizer's step and "
            f"learning rate) {slots / total:+.4f} from the slot slices (the padding of each "
            f"bucket to a multiple of N accounts for {padding / total:+.4f}). Model state "
            f"{shard['model_state_bytes'] / plain['model_state_bytes']:.4f} against "
            f"(4Ψ + 16Ψ/N) / 16Ψ = {bound:.4f} (weights; gradient slice, slots and the "
            "slice copy of the weights): the rest is the same counters and padding.")
    return lines


def main(argv=None) -> dict:
    args = engine_section_args(NAME, __doc__, argv)
    engine = args.engine
    config = settings(args.quick)
    runs = {}
    for n in config["workers"]:
        for sharded in (False, True):
            label = f"{n} workers, {'sharded' if sharded else 'unsharded'}"
            print(f"{NAME}: {label} ({engine})", flush=True)
            results = run_tasks(_task, engine, sharded, config["width"], config["layers"],
                                config["batch"], config["warmup"], config["steps"],
                                workers=n, timeout=900)
            worst = {key: max(r[key] for r in results) for key in results[0]
                     if key != "rank"}
            worst["workers"] = n
            runs[label] = worst
    ratios = _ratios(runs)
    mb = 1e6
    table = [["run", "net peak RSS (MB)", "optimizer vars (MB)", "reduced grads (MB)",
              "model state (MB)", "step (ms)", "wire / step (MB)", "counted / step (MB)"]]
    for label, r in runs.items():
        table.append([label, f"{r['net_peak_rss'] / mb:.0f}", f"{r['optimizer_bytes'] / mb:.1f}",
                      f"{r['gradient_bytes'] / mb:.1f}", f"{r['model_state_bytes'] / mb:.1f}",
                      f"{r['step_seconds'] * 1e3:.0f}", f"{r['wire_bytes_per_step'] / mb:.1f}",
                      f"{r['counted_bytes_per_step'] / mb:.1f}"])
    ratio_table = [["N", "optimizer bytes x N", "model state", "net peak RSS", "step time",
                    "wire bytes"]]
    for n, r in ratios.items():
        ratio_table.append([n, f"{r['optimizer_bytes_times_n']:.3f}", f"{r['model_state']:.2f}",
                            f"{r['net_peak_rss']:.2f}", f"{r['step_time']:.2f}",
                            f"{r['wire_bytes']:.2f}"])
    weights_mb = next(iter(runs.values()))["weights_bytes"] / mb
    markdown = "\n".join([
        f"# {TITLE}", "", f"Command: `.venv/bin/python -m benchmarks.{NAME}`", "",
        f"Engine `{engine}`; {config['layers']} Dense layers of {config['width']} "
        f"({weights_mb:.0f} MB of float32 weights), Adam, global batch {config['batch']}, "
        f"median of {config['steps']} timed steps. Each figure is the largest worker's.", "",
        markdown_table(table), "", "Sharded / unsharded:", "", markdown_table(ratio_table),
        "", "Model state = weights + reduced gradients + optimizer variables (+ the "
        "sharded run's slice copy of the weights). Wire bytes follow a ring: an "
        "all-reduce sends 2(N-1)/N of the payload per worker, a reduce-scatter and an "
        "all-gather (N-1)/N each. Each optimizer variable is counted once.", "",
        "What the ratios are made of:", "", *explain(runs), ""])
    data = {"machine": machine_info(), "engine": engine, "settings": config,
            "runs": runs, "ratios": ratios, "weights_bytes": weights_mb * mb}
    write_section(args.output, NAME, markdown, data)
    print(markdown)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
