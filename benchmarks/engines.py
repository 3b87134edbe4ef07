"""Engines in ``fit``: step time with TF's and Horovod's engine, and the 64 MB all-reduce
against two loopback bounds, 2 processes on this host, measured in one run.

Step time in Keras ``fit`` of a model with ~32 MB of float32 gradients (Dense layers of
width 2048 on a 16-feature input, global batch 16, so compute is small), median over
the steps after a warm-up ``fit``, for:

- ``engine="tf"``: `tfdist.MultiWorkerMirroredStrategy(engine="tf")` under
  `tfdist.launch` (TF's gRPC ring collectives),
- ``engine="horovod"``: the same class with ``engine="horovod"`` under `tfdist.launch`,
  no ``horovodrun`` (the strategy brings up Gloo from TF_CONFIG),
- ``HorovodStrategy``: `tfdist.HorovodStrategy()` under ``horovodrun --gloo``,
- ``no sync``: the same model in plain Keras in 2 concurrent processes with the
  per-worker batch and no communication: the compute floor of a 2-worker step here.

Variants alternate over rounds (a fresh launch each), so load on the shared machine
hits them alike. The 64 MB all-reduce (float32 sum) is timed for TF's gRPC ring
(`benchmarks.allreduce.tf_ring_times`) and Horovod/Gloo (`benchmarks.allreduce
.horovod_task`, in the ``engine="horovod"`` and ``HorovodStrategy`` processes after
their ``fit``), against one loopback TCP stream moving 64 MB
(`benchmarks.allreduce.loopback_bounds`) and two simultaneous 64 MB streams, one each
way, between two processes (what a 2-rank ring moves: each rank sends and receives
64 MB).

    .venv/bin/python -m benchmarks.engines [--quick] [--output DIR]   # DIR/engines.{json,md,png}
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time

from benchmarks import allreduce
from benchmarks.common import (horovod_missing, machine_info, markdown_table,
                               parse_section_args, pyplot, run_horovod, run_tasks,
                               save_figure, section_parser, write_section)

NAME = "engines"
TITLE = "Engines in fit: step time and the 64 MB all-reduce, 2 workers"
FEATURES = 16
GLOBAL_BATCH = 16
# variant -> how it is started
VARIANTS = {
    "no sync": "launch",
    'engine="tf"': "launch",
    'engine="horovod"': "launch",
    "HorovodStrategy": "horovodrun",
}
HOROVOD_VARIANTS = ('engine="horovod"', "HorovodStrategy")


def settings(quick: bool) -> dict:
    """Model width, steps and variants: the full run, or a smoke run of about a minute
    (the two engines only: every launch costs a TensorFlow start-up)."""
    if quick:
        return {"width": 256, "warmup_steps": 3, "steps": 6, "rounds": 1,
                "allreduce_bytes": 4 << 20, "stock_ring": False,
                "variants": ['engine="tf"', 'engine="horovod"']}
    return {"width": 2048, "warmup_steps": 8, "steps": 40, "rounds": 3,
            "allreduce_bytes": 64 << 20, "stock_ring": True, "variants": list(VARIANTS)}


def build_model(width: int, seed: int = 0):
    """Dense ``16 -> width -> width -> width -> 10``: 8.45M parameters at width 2048."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,))] + [
        keras.layers.Dense(width, activation="relu") for _ in range(3)] + [
        keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def parameters(width: int) -> int:
    return (FEATURES * width + width) + 2 * (width * width + width) + (width * 10 + 10)


def _dataset(batch: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, FEATURES)).astype(np.float32)
    y = rng.integers(0, 10, 1024).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.DATA
    return data.with_options(options)


def _step_timer():
    import keras

    class StepTimer(keras.callbacks.Callback):
        """perf_counter at the end of every training batch."""

        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return StepTimer()


def fit_task(variant: str, width: int, warmup_steps: int, steps: int,
             allreduce_bytes: int | None = None, quick: bool = False) -> dict:
    """Runs in every task: warm-up ``fit``, then a timed ``fit`` of ``steps`` steps.

    Returns the step times (differences between successive batch ends), and for the
    Horovod variants the all-reduce times of ``allreduce.horovod_task``.
    """
    import contextlib

    import tfdist

    # First: a multi-worker strategy must start before any other TF op.
    if variant == 'engine="tf"':
        strategy = tfdist.MultiWorkerMirroredStrategy(engine="tf")
    elif variant == 'engine="horovod"':
        strategy = tfdist.MultiWorkerMirroredStrategy(engine="horovod")
    elif variant == "HorovodStrategy":
        strategy = tfdist.HorovodStrategy()
    elif variant == "no sync":
        strategy = None
    else:
        raise ValueError(f"unknown variant. Received: variant={variant!r}")
    # Each worker reads half of every global batch; without sync it reads that half itself.
    batch = GLOBAL_BATCH // 2 if strategy is None else GLOBAL_BATCH
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_model(width)
    data = _dataset(batch)
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=warmup_steps, verbose=0)
    warmup_seconds = time.perf_counter() - start
    timer = _step_timer()
    counted = getattr(strategy, "bytes_communicated", None)
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps + 1, verbose=0, callbacks=[timer])
    fit_seconds = time.perf_counter() - start
    # Step i's time is ends[i] - ends[i-1]; the first timed step also paid epoch start-up.
    step_times = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    result = {"step_seconds": statistics.median(step_times), "step_samples": step_times,
              "warmup_fit_seconds": warmup_seconds, "timed_fit_seconds": fit_seconds,
              "replicas": strategy.num_replicas_in_sync if strategy is not None else 1,
              "engine": getattr(strategy, "engine", None)}
    if counted is not None:  # what the strategy all-reduced per step (gradients, metrics)
        result["bytes_per_step"] = (strategy.bytes_communicated - counted) / (steps + 1)
    if allreduce_bytes and strategy is not None:
        result["allreduce_seconds"] = allreduce.strategy_allreduce_seconds(
            strategy, allreduce_bytes, quick)
        if variant in HOROVOD_VARIANTS:  # Horovod's own op, no strategy in between
            times = allreduce.horovod_task([allreduce_bytes], quick)
            result["hvd_allreduce_seconds"] = times[allreduce_bytes]
    return result


def run_variant(variant: str, cfg: dict, quick: bool, timeout: float) -> dict:
    """One launch of ``variant`` (2 processes); returns worker 0's / rank 0's result."""
    args = (variant, cfg["width"], cfg["warmup_steps"], cfg["steps"],
            cfg["allreduce_bytes"], quick)
    if VARIANTS[variant] == "horovodrun":
        return run_horovod(fit_task, *args, np=2, timeout=timeout)[0]
    return run_tasks(fit_task, *args, workers=2, timeout=timeout)[0]


# ---- the two-stream bound ------------------------------------------------------------------

def _duplex_peer(port: int, nbytes: int, reps: int) -> None:
    """The second process: per round, on ``go``, sends ``nbytes`` while receiving
    ``nbytes``, then answers ``k`` once both are done."""
    import numpy as np

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(np.ones(nbytes, np.uint8))
        buffer = memoryview(np.empty(nbytes, np.uint8))
        go = bytearray(1)
        for _ in range(reps):
            sock.recv_into(go)
            sender = threading.Thread(target=sock.sendall, args=(payload,))
            sender.start()
            _recv_exactly(sock, buffer, nbytes)
            sender.join()
            sock.sendall(b"k")


def _recv_exactly(sock, buffer, nbytes: int) -> None:
    got = 0
    while got < nbytes:
        n = sock.recv_into(buffer[got:nbytes])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def two_stream_bound(nbytes: int, quick: bool) -> float:
    """Median seconds for two processes to exchange ``nbytes`` each way at once over one
    loopback TCP connection (both directions in flight together, as in a 2-rank ring)."""
    import multiprocessing as mp

    import numpy as np

    warmup = 2
    reps = allreduce.repetitions(nbytes, quick)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = mp.get_context("spawn").Process(target=_duplex_peer,
                                            args=(port, nbytes, reps + warmup), daemon=True)
    child.start()
    try:
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(120)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(np.ones(nbytes, np.uint8))
        buffer = memoryview(np.empty(nbytes + 1, np.uint8))

        def exchange():
            conn.sendall(b"g")
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
            _recv_exactly(conn, buffer, nbytes + 1)  # the peer's bytes, then its "k"
            sender.join()

        seconds = allreduce._median_times(exchange, reps, warmup=warmup)
        conn.close()
    finally:
        server.close()
        child.join(30)
        if child.is_alive():
            child.kill()
    return seconds


def stock_ring_seconds(nbytes: int, quick: bool, timeout: float) -> float:
    """Stock TF's gRPC ring (``allreduce.tf_ring_times``, its own launch): a cross-check
    of engine="tf"."""
    print(f"[{NAME}] all-reduce {nbytes >> 20} MB: stock TF gRPC ring (tfdist.launch, "
          "2 workers)", flush=True)
    return allreduce.tf_ring_times([nbytes], quick, timeout)[nbytes]


def bounds(nbytes: int, quick: bool) -> dict:
    """One loopback TCP stream, two streams one each way, and memcpy of ``nbytes``."""
    tcp, memcpy = allreduce.loopback_bounds([nbytes], quick)
    return {"one stream": tcp[nbytes], "two streams": two_stream_bound(nbytes, quick),
            "memcpy": memcpy[nbytes]}


# ---- report --------------------------------------------------------------------------------

def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _goals():
    """The targets of docs/benchmarks.md (``engines-fit``, ``engines-allreduce``)."""
    from benchmarks.goals import goal, read_analysis

    return goal("engines-fit"), goal("engines-allreduce"), read_analysis()


BOUNDS = ("one stream", "two streams", "memcpy")
# all-reduce rows: label -> (variant, key in its result)
ALLREDUCE_ROWS = {
    'engine="tf": TF gRPC ring': ('engine="tf"', "allreduce_seconds"),
    'engine="horovod": Gloo': ('engine="horovod"', "allreduce_seconds"),
    "HorovodStrategy: Gloo (horovodrun)": ("HorovodStrategy", "allreduce_seconds"),
    'hvd.allreduce in the engine="horovod" job': ('engine="horovod"', "hvd_allreduce_seconds"),
    "hvd.allreduce under horovodrun": ("HorovodStrategy", "hvd_allreduce_seconds"),
}


def summarize(samples: dict, bound_samples: list, stock_ring, cfg: dict) -> dict:
    steps = {v: statistics.median(r["step_seconds"] for r in rs) for v, rs in samples.items()
             if rs}
    tf_step = steps.get('engine="tf"')
    ratios = {}
    if tf_step:
        for v in ('engine="horovod"', "HorovodStrategy", "no sync"):
            if v in steps:
                ratios[f'{v} / engine="tf"'] = steps[v] / tf_step
    seconds = {}
    for label, (variant, key) in ALLREDUCE_ROWS.items():
        values = [r[key] for r in samples.get(variant, []) if key in r]
        if values:
            seconds[label] = statistics.median(values)
    if stock_ring is not None:
        seconds["stock TF gRPC ring"] = stock_ring
    for name in BOUNDS:
        values = [b[name] for b in bound_samples]
        if values:
            seconds[name] = statistics.median(values)
    one, two = seconds.get("one stream"), seconds.get("two streams")
    engines = [k for k in seconds if k not in BOUNDS]
    return {"step_seconds": steps, "ratios": ratios,
            "allreduce_bytes": cfg["allreduce_bytes"], "allreduce_seconds": seconds,
            "allreduce_vs_two_streams": {k: seconds[k] / two for k in engines} if two else {},
            "allreduce_vs_one_stream": {k: seconds[k] / one for k in engines + ["two streams"]}
            if one else {}}


def report(data: dict, command: str) -> str:
    s, cfg = data["summary"], data["settings"]
    fit_goal, reduce_goal, analysis = _goals()
    mb = cfg["allreduce_bytes"] / 2**20
    grad_mb = data["gradient_bytes"] / 2**20
    lines = [f"# {TITLE}", "", f"Command: `{command}`", "",
             f"Keras `fit` of Dense `{FEATURES} -> {cfg['width']} x3 -> 10` "
             f"({data['parameters']:,} float32 parameters: {grad_mb:.1f} MiB of gradients), "
             f"global batch {GLOBAL_BATCH}, 2 processes. Step time: median of "
             f"{cfg['steps']} steps after a {cfg['warmup_steps']}-step warm-up `fit`, "
             f"median over {cfg['rounds']} alternating round(s), worker 0 / rank 0. "
             "`no sync`: the same model in plain Keras in 2 concurrent processes with the "
             "per-worker batch and no communication (the compute floor of a step here).", ""]
    rows = [["variant", "how started", "step (ms)", 'vs engine="tf"', "per round (ms)",
             "all-reduced / step"]]
    tf_step = s["step_seconds"].get('engine="tf"')
    for v, how in VARIANTS.items():
        step = s["step_seconds"].get(v)
        runs = data["samples"].get(v, [])
        per_round = ", ".join(_ms(r["step_seconds"]) for r in runs)
        sent = [r["bytes_per_step"] for r in runs if r.get("bytes_per_step") is not None]
        why = data["skipped"].get(v) or ("not in --quick" if v not in cfg["variants"] else "-")
        rows.append([v, "horovodrun --gloo" if how == "horovodrun" else "tfdist.launch",
                     _ms(step) if step else why,
                     f"{step / tf_step:.2f}x" if step and tf_step else "-", per_round or "-",
                     f"{statistics.median(sent) / 2**20:.1f} MiB" if sent else "-"])
    lines += [markdown_table(rows), ""]
    lines += [f"{mb:g} MB all-reduce (float32 sum), 2 processes, median time:", ""]
    rows = [["", "ms", "/ two streams", "/ one stream", "per round (ms)"]]
    per_round = {k: [b[k] for b in data["bound_samples"]] for k in BOUNDS}
    for label, (variant, key) in ALLREDUCE_ROWS.items():
        per_round[label] = [r[key] for r in data["samples"].get(variant, []) if key in r]
    for k, v in s["allreduce_seconds"].items():
        rows.append([k, _ms(v), f"{s['allreduce_vs_two_streams'][k]:.2f}x"
                     if k in s["allreduce_vs_two_streams"] else "-",
                     f"{s['allreduce_vs_one_stream'][k]:.2f}x"
                     if k in s["allreduce_vs_one_stream"] else "-",
                     ", ".join(_ms(x) for x in per_round.get(k, [])) or "-"])
    lines += [markdown_table(rows), "",
              f"A 2-rank ring all-reduce of S bytes sends S/2 (reduce-scatter) + S/2 "
              "(all-gather) = S bytes each way, both directions at once. `one stream` moves "
              f"{mb:g} MB one way only; `two streams` moves {mb:g} MB each way at the same "
              "time between two processes (one TCP connection, a sender thread per side), "
              "which is the data movement the ring needs. On a 2-core host the two "
              "directions share the cores that copy the bytes through the kernel, so "
              "`two streams` is the honest bound; `one stream` assumes the second "
              "direction is free.", ""]
    # goals
    rows = [["goal", "target", "measured", "status"]]
    hvd_ratio = s["ratios"].get('engine="horovod" / engine="tf"')
    rows.append(['`engines-fit`: engine="horovod" step / engine="tf" step', fit_goal.target,
                 f"{hvd_ratio:.2f}" if hvd_ratio else "not measured",
                 fit_goal.status(hvd_ratio) if hvd_ratio else "-"])
    hs = s["ratios"].get('HorovodStrategy / engine="tf"')
    if hs:
        rows.append(['(HorovodStrategy step / engine="tf" step)', fit_goal.target,
                     f"{hs:.2f}", fit_goal.status(hs)])
    for k, v in s["allreduce_vs_two_streams"].items():
        rows.append([f"`engines-allreduce`: {mb:g} MB, {k} / two streams", reduce_goal.target,
                     f"{v:.2f}x", reduce_goal.status(v)])
    lines += ["Goals (docs/benchmarks.md):", "", markdown_table(rows), ""]
    lines += _where_the_time_goes(data, analysis, fit_goal, reduce_goal)
    lines += [f"1-minute load average before / after: {data['load_average_1min']['before']} / "
              f"{data['load_average_1min']['after']} on {data['machine']['cpus']} CPUs "
              "(the machine is shared; ratios measured side by side carry over, absolute "
              "times do not).", "", f"![{NAME}]({NAME}.png)", ""]
    return "\n".join(lines)


def _where_the_time_goes(data, analysis, fit_goal, reduce_goal) -> list[str]:
    s = data["summary"]
    steps, seconds = s["step_seconds"], s["allreduce_seconds"]
    notes = []
    floor, tf_step, hvd_step = (steps.get("no sync"), steps.get('engine="tf"'),
                                steps.get('engine="horovod"'))
    hvd_ratio = s["ratios"].get('engine="horovod" / engine="tf"')
    if hvd_ratio and floor:
        half = data["gradient_bytes"] / s["allreduce_bytes"]
        tf_reduce = seconds.get('engine="tf": TF gRPC ring')
        hvd_reduce = seconds.get('engine="horovod": Gloo')
        text = (f"- Step: `no sync` (compute, optimizer and Keras' loop, no communication) "
                f"takes {_ms(floor)} ms, so sync costs {_ms(tf_step - floor)} ms per step on "
                f"engine=\"tf\" and {_ms(hvd_step - floor)} ms on engine=\"horovod\"")
        if tf_reduce and hvd_reduce:
            text += (f"; scaling the {s['allreduce_bytes'] >> 20} MB all-reduce to the "
                     f"{data['gradient_bytes'] / 2**20:.0f} MiB of gradients predicts "
                     f"{_ms(tf_reduce * half)} and {_ms(hvd_reduce * half)} ms")
        text += (f". With free communication the ratio could not go below "
                 f"{floor / tf_step:.2f}.")
        if not fit_goal.is_met(hvd_ratio):
            text += " " + analysis.get("engines-fit", "")
        notes.append(text)
    missed = {k: v for k, v in s["allreduce_vs_two_streams"].items()
              if not reduce_goal.is_met(v)}
    if missed:
        parts = ", ".join(f"{k} {v:.1f}x" for k, v in missed.items())
        notes.append(f"- All-reduce: `engines-allreduce` missed ({parts} the two-stream "
                     f"bound of {_ms(seconds['two streams'])} ms; memcpy of the buffer: "
                     f"{_ms(seconds.get('memcpy'))} ms). "
                     + analysis.get("engines-allreduce", ""))
    return (["Where the time goes:", ""] + notes + [""]) if notes else []


def plot(data: dict, path) -> None:
    s = data["summary"]
    fig, (ax_step, ax_red) = pyplot().subplots(1, 2, figsize=(11, 3.8))
    names = [v for v in VARIANTS if v in s["step_seconds"]]
    values = [s["step_seconds"][v] * 1e3 for v in names]
    colors = ["tab:gray" if v == "no sync" else "tab:blue" for v in names]
    ax_step.barh(names, values, color=colors)
    for i, v in enumerate(values):
        ax_step.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax_step.invert_yaxis()
    ax_step.set_xlabel("median step time in fit (ms)")
    ax_step.set_title(f"fit, {data['gradient_bytes'] / 2**20:.1f} MiB of gradients, 2 workers",
                      fontsize=10)
    red = {k: v for k, v in s["allreduce_seconds"].items() if v is not None and k != "memcpy"}
    names = list(red)
    values = [red[k] * 1e3 for k in names]
    colors = ["tab:green" if "stream" in k else "tab:orange" for k in names]
    ax_red.barh(names, values, color=colors)
    for i, v in enumerate(values):
        ax_red.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    two = s["allreduce_seconds"].get("two streams")
    if two:
        ax_red.axvline(2 * two * 1e3, color="tab:red", ls="--", lw=1,
                       label="goal: 2x two streams")
        ax_red.legend(fontsize=8, loc="best")
    ax_red.invert_yaxis()
    ax_red.set_xlabel("median time (ms)")
    ax_red.set_title(f"{s['allreduce_bytes'] >> 20} MB all-reduce vs loopback bounds",
                     fontsize=10)
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = section_parser(f"benchmarks.{NAME}", __doc__)
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds per launch before its processes are killed")
    args = parse_section_args(parser, argv)
    cfg = settings(args.quick)
    command = f".venv/bin/python -m benchmarks.{NAME}" + (" --quick" if args.quick else "")
    load_before = os.getloadavg()[0]
    skipped = {}
    why = horovod_missing()
    variants = list(cfg["variants"])
    if why:
        for v in HOROVOD_VARIANTS:
            skipped[v] = f"skipped: {why}"
        variants = [v for v in variants if v not in HOROVOD_VARIANTS]
    samples = {v: [] for v in VARIANTS}
    bound_samples = []
    started = time.perf_counter()
    for round_index in range(cfg["rounds"]):
        # Alternate the order every round so a load change does not favour one variant.
        order = variants if round_index % 2 == 0 else variants[::-1]
        for v in order:
            t0 = time.perf_counter()
            result = run_variant(v, cfg, args.quick, args.timeout)
            samples[v].append(result)
            extra = ""
            for key, label in (("allreduce_seconds", "all-reduce"),
                               ("hvd_allreduce_seconds", "hvd.allreduce")):
                if key in result:
                    extra += f", {label} {_ms(result[key])} ms"
            print(f"[{NAME}] round {round_index + 1}/{cfg['rounds']}: {v}: step "
                  f"{_ms(result['step_seconds'])} ms{extra} "
                  f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})",
                  flush=True)
        # The bounds every round too, so they see the same machine as the engines.
        bound_samples.append(bounds(cfg["allreduce_bytes"], args.quick))
        print(f"[{NAME}] round {round_index + 1}/{cfg['rounds']}: bounds: " + ", ".join(
            f"{k} {_ms(v)} ms" for k, v in bound_samples[-1].items()), flush=True)
    stock_ring = (stock_ring_seconds(cfg["allreduce_bytes"], args.quick, args.timeout)
                  if cfg["stock_ring"] else None)
    data = {"command": command, "settings": cfg, "parameters": parameters(cfg["width"]),
            "gradient_bytes": 4 * parameters(cfg["width"]), "global_batch": GLOBAL_BATCH,
            "samples": samples, "bound_samples": bound_samples, "skipped": skipped,
            "summary": summarize(samples, bound_samples, stock_ring, cfg),
            "machine": machine_info(),
            "load_average_1min": {"before": round(load_before, 2),
                                  "after": round(os.getloadavg()[0], 2)},
            "seconds": time.perf_counter() - started,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    markdown = report(data, command)
    write_section(args.output, NAME, markdown, data)
    plot(data, args.output / f"{NAME}.png")
    print(markdown, flush=True)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
