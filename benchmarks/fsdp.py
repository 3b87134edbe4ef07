"""Fully sharded parameters (ZeRO-3) against ZeRO-2 and unsharded: memory, bytes, time.

    .venv/bin/python -m benchmarks.fsdp [--quick] [--output DIR] [--engine horovod|tf]
                                        [--cap-mb MB]

Part 1: `tfdist.MultiWorkerMirroredStrategy` unsharded, with
``shard_optimizer_state=True`` and with ``shard_parameters=True``, at 2 and 4 worker
processes on 127.0.0.1; a stack of Dense layers of at least 256 MB of float32 weights,
Adam, ``fit`` on random data. Each worker reports:

- persistent bytes: every TF variable the process holds after training (weights or
  their shards, optimizer slots or their slices, counters), found by walking the
  garbage collector's objects, so no strategy reports on itself;
- net peak RSS: ``VmHWM`` at the end minus ``VmRSS`` before the model was built;
- wire bytes per step: what its collectives send in a ring (`ring_wire_bytes`), and
  ``bytes_communicated`` as tfdist counts it;
- step time: the median of the timed steps.

Part 2: the largest model that trains when every worker process is capped at
``--cap-mb`` (a cgroup v1 memory group per task, `benchmarks.memcap`; needs root):
1 unsharded worker against 4 workers with ``shard_parameters=True`` (and 4 with
``shard_optimizer_state=True``), growing the width until a run is killed. The curve
(parameters against each worker's peak memory) goes to ``fsdp.png``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (engine_section_args, machine_info, markdown_table, pyplot,
                               run_tasks, save_figure, write_section)

NAME = "fsdp"
TITLE = "Fully sharded parameters (ZeRO-3): memory, bytes and step time per worker"
MODES = {"unsharded": {}, "shard_optimizer_state": {"shard_optimizer_state": True},
         "shard_parameters": {"shard_parameters": True}}


def settings(quick: bool) -> dict:
    if quick:
        return {"width": 512, "layers": 2, "batch": 16, "warmup": 1, "steps": 2,
                "workers": (2,), "cap_widths": (), "cap_layers": 4}
    # 4 x 4096 x 4096 float32 (+ biases): 268 MB of weights.
    # Capped: 16 layers, so that one gathered layer is small against the model.
    return {"width": 4096, "layers": 4, "batch": 16, "warmup": 1, "steps": 4,
            "workers": (2, 4), "cap_layers": 16,
            "cap_widths": (1024, 1536, 2048, 2560, 3072, 3584, 4096, 4608)}


def _rss(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _variable_bytes() -> int:
    """Bytes of every TF resource variable alive in this process (each once)."""
    import numpy as np
    import tensorflow as tf

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, tf.Variable) and hasattr(obj, "handle") and \
                not isinstance(obj, tf.distribute.DistributedValues):
            try:
                key = id(obj.handle)
            except (AttributeError, ValueError):
                continue
            if key in seen or not obj.shape.is_fully_defined():
                continue
            seen.add(key)
            total += int(np.prod(obj.shape)) * obj.dtype.size
    return total


def dense_stack(width: int, layers: int, seed: int = 0):
    """``layers`` Dense layers of ``width`` (the benchmark's model), seeded."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((width,))] + [
        keras.layers.Dense(width) for _ in range(layers)])


def random_data(width: int, rows: int):
    """``(x, y)``: normal float32 rows, the same in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, width)).astype("float32"),
            rng.normal(size=(rows, width)).astype("float32"))


def adam():
    """The optimizer of every run (epsilon 1e-3: a first step that does not turn
    rounding-sized gradients into whole steps, so runs compare at 1e-5)."""
    import keras

    return keras.optimizers.Adam(1e-4, epsilon=1e-3)


def ring_wire_bytes(sizes: list, n: int, options: dict) -> float:
    """What one worker sends per step in a ring, from the collectives each mode runs:
    an all-reduce sends 2(N-1)/N of its payload, an all-gather or a reduce-scatter
    (N-1)/N. Unsharded: one all-reduce of the gradients. ``shard_optimizer_state``: a
    reduce-scatter of the gradients and an all-gather of the weights. ``shard_parameters``:
    for each variable of at least ``min_shard_elements``, an all-gather forward, again
    backward (``reshard_after_forward``, the default) and a reduce-scatter of its
    gradient; smaller ones all-reduced."""
    share = (n - 1) / n
    if options.get("shard_parameters"):
        threshold = 4 * options.get("min_shard_elements", 100_000)
        sharded = sum(s for s in sizes if s >= threshold)
        gathers = 2 if options.get("reshard_after_forward", True) else 1
        return (gathers + 1) * share * sharded + 2 * share * (sum(sizes) - sharded)
    return 2 * share * sum(sizes)


def _task(engine, options, width, layers, batch, warmup, steps, weights=False):
    import keras
    import numpy as np

    import tfdist

    start = _rss("VmRSS")
    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine, **options)
    x, y = random_data(width, batch * max(warmup, steps))
    with strategy.scope():
        model = dense_stack(width, layers)
        model.compile(adam(), loss="mse")
    times = []

    class StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            times.append(time.perf_counter() - self.t0)

    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=warmup, shuffle=False,
              verbose=0)
    before = strategy.bytes_communicated
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, shuffle=False,
              verbose=0, callbacks=[StepTimes()])
    counted = (strategy.bytes_communicated - before) / steps
    result = {"ring_wire_bytes_per_step": ring_wire_bytes(
        [int(np.prod(v.shape)) * 4 for v in model.trainable_variables],
        strategy.num_replicas_in_sync, options),
              "rank": strategy.rank, "workers": strategy.num_replicas_in_sync,
              "parameters": int(model.count_params()),
              "persistent_bytes": _variable_bytes(),
              "net_peak_rss": _rss("VmHWM") - start,
              "step_seconds": statistics.median(times), "wire_bytes_per_step": counted}
    if weights:
        found = model.get_weights()  # every worker: a sharded read is a collective
        if strategy.rank == 0:
            result["weights"] = found
    return result


def reference_weights(width, layers, batch, warmup, steps) -> list:
    """`_task`'s training in this process on one device: the weights."""
    x, y = random_data(width, batch * max(warmup, steps))
    model = dense_stack(width, layers)
    model.compile(adam(), loss="mse")
    for count in (c for c in (warmup, steps) if c):
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=count, shuffle=False,
                  verbose=0)
    return model.get_weights()


def _largest(run: list) -> dict:
    return {key: max(r[key] for r in run) for key in run[0] if key != "rank"}


def measure(engine: str, config: dict) -> dict:
    """Part 1: every mode at every worker count; the largest worker's figures."""
    runs = {}
    for n in config["workers"]:
        for mode, options in MODES.items():
            label = f"{n} workers, {mode}"
            print(f"{NAME}: {label} ({engine})", flush=True)
            runs[label] = _largest(run_tasks(
                _task, engine, options, config["width"], config["layers"], config["batch"],
                config["warmup"], config["steps"], workers=n, timeout=1800))
    ratios = {}
    for n in config["workers"]:
        plain = runs[f"{n} workers, unsharded"]
        ratios[str(n)] = {mode: {
            "persistent_bytes": runs[f"{n} workers, {mode}"]["persistent_bytes"]
            / plain["persistent_bytes"],
            "net_peak_rss": runs[f"{n} workers, {mode}"]["net_peak_rss"] / plain["net_peak_rss"],
            "wire_bytes": runs[f"{n} workers, {mode}"]["ring_wire_bytes_per_step"]
            / plain["ring_wire_bytes_per_step"],
            "counted_bytes": runs[f"{n} workers, {mode}"]["wire_bytes_per_step"]
            / plain["wire_bytes_per_step"],
            "step_time": runs[f"{n} workers, {mode}"]["step_seconds"] / plain["step_seconds"],
        } for mode in MODES if mode != "unsharded"}
    return {"runs": runs, "ratios": ratios}


def capped(engine: str, config: dict, cap_bytes: int) -> dict:
    """Part 2: per mode, the widths tried (parameters, each worker's peak, trained)."""
    from benchmarks.memcap import MemoryCaps

    curves = {}
    for label, n, options in (("1 worker, unsharded", 1, {}),
                              ("4 workers, shard_optimizer_state", 4,
                               {"shard_optimizer_state": True}),
                              ("4 workers, shard_parameters", 4, {"shard_parameters": True})):
        points = []
        for width in config["cap_widths"]:
            caps = MemoryCaps(cap_bytes, tag=f"tfdist-fsdp-{len(curves)}-{width}")
            try:
                print(f"{NAME}: capped at {cap_bytes / 2**20:.0f} MiB: {label}, width "
                      f"{width}", flush=True)
                try:
                    run_tasks(_task, engine, options, width, config["cap_layers"], 16, 1, 1,
                              workers=n, timeout=1800, wrap=caps.wrap)
                    trained = True
                except Exception:  # noqa: BLE001 - a killed task is the measurement
                    trained = False
                tasks = [f"worker-{i}" for i in range(n)]
                points.append({"width": width,
                               "parameters": config["cap_layers"] * (width * width + width),
                               "peak_bytes": max(caps.peak(t) for t in tasks),
                               "oom_killed": any(caps.oom_killed(t) for t in tasks),
                               "trained": trained})
            finally:
                caps.remove()
            if not trained:
                break
        curves[label] = points
    largest = {label: max([p["parameters"] for p in points if p["trained"]] or [0])
               for label, points in curves.items()}
    base = largest["1 worker, unsharded"]
    return {"cap_bytes": cap_bytes, "curves": curves, "largest": largest,
            "largest_ratio": {label: (value / base if base else None)
                              for label, value in largest.items()}}


def goal_values(data: dict, quick: bool) -> dict:
    """The figures docs/benchmarks.md's ``fsdp-*`` goals are checked on (`benchmarks.goals`)."""
    if quick:
        return {"goal_values_missing": "a --quick run (small model)"}
    fsdp = {n: modes["shard_parameters"] for n, modes in data["ratios"].items()}
    cap = data.get("capped")
    return {"goal_values": {
        "fsdp-persistent": {f"{n} workers: persistent bytes x N": r["persistent_bytes"] * int(n)
                            for n, r in fsdp.items()},
        "fsdp-peak": {"4 workers: net peak RSS": fsdp["4"]["net_peak_rss"]} if "4" in fsdp
        else {},
        "fsdp-wire": {f"{n} workers: wire bytes": r["wire_bytes"] for n, r in fsdp.items()},
        "fsdp-step": {f"{n} workers: step time": r["step_time"] for n, r in fsdp.items()},
        "fsdp-capacity": {"largest model, 4 sharded / 1 unsharded": None if cap is None
                          else cap["largest_ratio"]["4 workers, shard_parameters"]},
    }}


def _plot(out: Path, cap: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in cap["curves"].items():
        ax.plot([p["parameters"] / 1e6 for p in points],
                [p["peak_bytes"] / 2**20 for p in points], marker="o", label=label)
        failed = [p for p in points if not p["trained"]]
        ax.scatter([p["parameters"] / 1e6 for p in failed],
                   [p["peak_bytes"] / 2**20 for p in failed], marker="x", s=80, color="red")
    ax.axhline(cap["cap_bytes"] / 2**20, linestyle="--", color="grey", label="cap per worker")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("peak memory per worker (MiB)")
    ax.set_title("Largest model under a per-worker memory cap (x: killed)")
    ax.legend()
    save_figure(fig, out / f"{NAME}.png")


def main(argv=None) -> dict:
    args = engine_section_args(NAME, __doc__, argv, lambda parser: parser.add_argument(
        "--cap-mb", type=int, default=1536, help="each worker's memory cap in part 2 (MiB)"))
    engine = args.engine
    config = settings(args.quick)
    data = {"machine": machine_info(), "engine": engine, "settings": config,
            **measure(engine, config)}
    from benchmarks.memcap import cannot_cap

    why = cannot_cap() if config["cap_widths"] else "--quick: no capped runs"
    data["capped"] = None if why else capped(engine, config, args.cap_mb * 2**20)
    data.update(goal_values(data, args.quick))
    mb = 1e6
    table = [["run", "parameters (M)", "persistent (MB)", "net peak RSS (MB)", "step (ms)",
              "ring wire / step (MB)", "counted / step (MB)"]]
    for label, r in data["runs"].items():
        table.append([label, f"{r['parameters'] / 1e6:.1f}", f"{r['persistent_bytes'] / mb:.0f}",
                      f"{r['net_peak_rss'] / mb:.0f}", f"{r['step_seconds'] * 1e3:.0f}",
                      f"{r['ring_wire_bytes_per_step'] / mb:.1f}",
                      f"{r['wire_bytes_per_step'] / mb:.1f}"])
    ratio_table = [["N", "mode", "persistent", "net peak RSS", "ring wire bytes",
                    "counted bytes", "step time"]]
    for n, modes in data["ratios"].items():
        for mode, r in modes.items():
            ratio_table.append([n, mode, f"{r['persistent_bytes']:.3f}",
                                f"{r['net_peak_rss']:.2f}", f"{r['wire_bytes']:.2f}",
                                f"{r['counted_bytes']:.2f}", f"{r['step_time']:.2f}"])
    lines = [f"# {TITLE}", "", f"Command: `.venv/bin/python -m benchmarks.{NAME}`", "",
             f"Engine `{engine}`; {config['layers']} Dense layers of {config['width']}, "
             f"Adam, global batch {config['batch']}, median of {config['steps']} timed "
             "steps. Each figure is the largest worker's.", "", markdown_table(table), "",
             "Against the unsharded run at the same N:", "", markdown_table(ratio_table), "",
             "Ring wire bytes: what each step's collectives send per worker in a ring "
             "(`ring_wire_bytes`); counted: tfdist's `bytes_communicated`, which counts an "
             "all-reduce's payload once.", ""]
    cap = data["capped"]
    if cap is None:
        lines += [f"Capped runs: not run ({why}).", ""]
    else:
        rows = [["run", "largest trained (M parameters)", "x 1 unsharded worker"]]
        for label, value in cap["largest"].items():
            ratio = cap["largest_ratio"][label]
            rows.append([label, f"{value / 1e6:.1f}", "-" if ratio is None else f"{ratio:.2f}"])
        lines += [f"Under a cap of {cap['cap_bytes'] / 2**20:.0f} MiB per worker process "
                  f"({config['cap_layers']} Dense layers, width "
                  f"{', '.join(map(str, config['cap_widths']))} until killed):", "",
                  markdown_table(rows), "", f"![curve]({NAME}.png)", ""]
        _plot(args.output, cap)
    markdown = "\n".join(lines)
    write_section(args.output, NAME, markdown, data)
    print(markdown)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
