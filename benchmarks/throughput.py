"""Training throughput by mode: samples/s of a small CNN on the 8x8 digits, 2 workers.

    .venv/bin/python -m benchmarks.throughput [--quick] [--output DIR] [--modes ...]

Every mode trains the same CNN (`benchmarks.common.digits_cnn`, ~137k parameters) with
SGD on the same global batch (64; 32 per worker) in fresh processes:

- ``single``: one process, one device, no strategy (the reference);
- ``mirrored``: `tfdist.MirroredStrategy` on 2 logical CPUs of one process;
- ``multi_worker``: `tfdist.MultiWorkerMirroredStrategy`, 2 workers (`tfdist.launch`);
- ``parameter_server async`` / ``sync``: `tfdist.ParameterServerStrategy`, 1 chief,
  2 workers, 1 ps (a step is one worker's batch of 32 in async mode, one batch per
  worker in sync mode);
- ``model_average``: `tfdist.ModelAverageStrategy(period=4)`, 2 workers;
- ``horovod``: `tfdist.HorovodStrategy` under ``horovodrun -np 2 --gloo``.

The first epoch (tracing) is dropped; samples/s is samples per timed epoch / the median
epoch time. Modes run one after another; with several rounds they alternate, so slow
phases of the machine hit every mode. All processes share this machine's cores: this
measures the framework's per-step cost, not a scale-out speed-up.
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks.common import (machine_info, markdown_table, parse_section_args, pyplot,
                               save_figure, section_parser, write_section)

GLOBAL_BATCH = 64
PERIOD = 4

# mode -> (tfdist public name it needs, how it runs)
MODES = {
    "single": (None, "local"),
    "mirrored": ("MirroredStrategy", "local"),
    "multi_worker": ("MultiWorkerMirroredStrategy", "workers"),
    "parameter_server_async": ("ParameterServerStrategy", "ps"),
    "parameter_server_sync": ("ParameterServerStrategy", "ps"),
    "model_average": ("ModelAverageStrategy", "workers"),
    "horovod": ("HorovodStrategy", "horovod"),
}


def _make_strategy(mode):
    import tfdist

    if mode == "single":
        return None
    if mode == "mirrored":
        tfdist.devices.use_logical_cpus(2)
        return tfdist.MirroredStrategy()
    if mode == "multi_worker":
        return tfdist.MultiWorkerMirroredStrategy()
    if mode.startswith("parameter_server_"):
        return tfdist.ParameterServerStrategy(mode=mode.rsplit("_", 1)[1])
    if mode == "model_average":
        return tfdist.ModelAverageStrategy(period=PERIOD)
    if mode == "horovod":
        return tfdist.HorovodStrategy()
    raise ValueError(f"unknown mode. Received: mode={mode!r}")


def fit_task(mode: str, steps: int, epochs: int) -> dict:
    """Runs in every task: trains ``1 + epochs`` epochs of ``steps`` steps, times them."""
    import contextlib

    strategy = _make_strategy(mode)  # first: multi-worker TF must start before other ops
    from benchmarks.common import EpochTimer, compile_digits, digits_cnn, digits_dataset

    ps = mode.startswith("parameter_server_")
    batch = GLOBAL_BATCH // 2 if ps else GLOBAL_BATCH  # PS datasets are per worker step
    samples_per_step = GLOBAL_BATCH if mode == "parameter_server_sync" else batch
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = compile_digits(digits_cnn())
    timer = EpochTimer()
    start = time.perf_counter()
    model.fit(digits_dataset(batch), epochs=1 + epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[timer])
    timed = timer.seconds[1:]
    median = statistics.median(timed)
    return {"samples_per_second": samples_per_step * steps / median,
            "epoch_seconds": timed, "first_epoch_seconds": timer.seconds[0],
            "total_seconds": time.perf_counter() - start, "steps": steps,
            "samples_per_step": samples_per_step,
            "bytes_communicated": int(getattr(strategy, "bytes_communicated", 0) or 0)}


def _why_unavailable(mode) -> str | None:
    import tfdist

    from benchmarks.common import horovod_missing

    name, _ = MODES[mode]
    if name is not None and name not in tfdist._LAZY:
        return f"not available (tfdist.{name} does not exist yet)"
    if mode == "horovod":
        return horovod_missing()
    return None


def run_mode(mode, steps, epochs, timeout) -> dict:
    from benchmarks.common import run_horovod, run_tasks

    how = MODES[mode][1]
    if how == "local":
        values = run_tasks(fit_task, mode, steps, epochs, workers=1, timeout=timeout)
    elif how == "workers":
        values = run_tasks(fit_task, mode, steps, epochs, workers=2, timeout=timeout)
    elif how == "ps":
        values = run_tasks(fit_task, mode, steps, epochs, workers=2, chief=True, ps=1,
                           timeout=timeout)
    else:
        values = run_horovod(fit_task, mode, steps, epochs, np=2, timeout=timeout)
    return values[0]  # the chief, or worker 0 / rank 0


def plot(results, path):
    names = [m for m in results if "samples_per_second" in results[m]]
    values = [results[m]["samples_per_second"] for m in names]
    fig, ax = pyplot().subplots(figsize=(7, 3.2))
    ax.barh(names, values, color="tab:blue")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("samples/s (digits CNN, global batch 64)")
    ax.invert_yaxis()
    ax.set_title("Throughput by mode, 2 workers on one 2-core machine")
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = section_parser("benchmarks.throughput", __doc__)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every mode this many times, alternating the order")
    args = parse_section_args(parser, argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.quick and args.modes == parser.get_default("modes"):
        # The smoke run (tests) stays short; the parameter-server, model-average and
        # Horovod paths are smoke-tested by their own sections, and all run in full runs.
        modes = ["single", "mirrored", "multi_worker"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    parser_rounds = args.rounds
    steps, epochs, rounds = (4, 1, 1) if args.quick else (30, 3, parser_rounds)
    timeout = 240 if args.quick else 600
    results: dict[str, dict] = {}
    samples: dict[str, list] = {}
    for mode in modes:
        why = _why_unavailable(mode)
        if why:
            results[mode] = {"skipped": why}
            print(f"throughput: {mode}: skipped: {why}", flush=True)
    for round_ in range(rounds):
        for mode in (modes if round_ % 2 == 0 else modes[::-1]):
            if "skipped" in results.get(mode, {}) or "failed" in results.get(mode, {}):
                continue
            print(f"throughput: {mode} (round {round_ + 1}/{rounds}) ...", flush=True)
            try:
                value = run_mode(mode, steps, epochs, timeout)
            except Exception as error:  # one mode failing must not hide the others
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                results[mode] = {"failed": f"{type(error).__name__}: {first[:300]}",
                                 "output_tail": str(error)[-1500:]}
                print(f"throughput: {mode}: FAILED: {results[mode]['failed']}", flush=True)
                continue
            samples.setdefault(mode, []).append(value)
            print(f"throughput: {mode}: {value['samples_per_second']:,.0f} samples/s", flush=True)
    for mode, values in samples.items():
        if "failed" in results.get(mode, {}):
            continue
        results[mode] = {
            "samples_per_second": statistics.median(v["samples_per_second"] for v in values),
            "rounds": values}
    out = args.output
    base = results.get("single", {}).get("samples_per_second")
    rows = [["mode", "samples/s", "vs single device", "bytes all-reduced/pushed per step"]]
    for mode in modes:
        r = results[mode]
        if "samples_per_second" in r:
            last = r["rounds"][-1]
            per_step = last["bytes_communicated"] / ((1 + epochs) * steps)
            rows.append([mode, f"{r['samples_per_second']:,.0f}",
                         f"{r['samples_per_second'] / base:.2f}x" if base else "-",
                         f"{per_step:,.0f}" if per_step else
                         "-" if mode == "single" else "not counted"])
        else:
            rows.append([mode, r.get("skipped") and f"skipped: {r['skipped']}"
                         or f"failed: {r['failed']}", "", ""])
    for mode in MODES:
        if mode not in modes:
            rows.append([mode, "not run (--quick or --modes)", "", ""])
    png = "throughput.png"
    if any("samples_per_second" in r for r in results.values()):
        plot(results, out / png)
    text = ["# Throughput by mode (digits CNN, 2 workers)", "",
            "Command: `.venv/bin/python -m benchmarks.throughput`", "",
            f"Global batch {GLOBAL_BATCH} (32 per worker), {steps} steps per epoch, median "
            f"of {epochs} timed epochs after one warm-up epoch, {rounds} round(s) "
            f"alternating the modes; model averaging with period={PERIOD}. All processes "
            "share one 2-core machine, so this compares per-step framework cost, "
            "not scale-out.", "", markdown_table(rows), ""]
    if (out / png).exists():
        text += [f"![throughput]({png})", ""]
    data = {"machine": machine_info(), "global_batch": GLOBAL_BATCH, "steps": steps,
            "epochs": epochs, "rounds": rounds, "period": PERIOD, "modes": results}
    write_section(out, "throughput", "\n".join(text), data)
    print("\n".join(text), flush=True)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
