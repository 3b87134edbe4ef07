"""Time per step on 2 workers with and without compression and accumulation.

    .venv/bin/python -m benchmarks.communication [--quick] [--output DIR]

`tfdist.MultiWorkerMirroredStrategy` on the digits CNN, global batch 64, 2 worker
processes on 127.0.0.1. Variants: plain, fp16, bf16, accumulate_steps=4. A
multi-worker strategy can start once per process, so every variant is its own launch;
the variants alternate over several rounds and the median is reported.
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks.common import (compile_digits, digits_cnn, digits_dataset, machine_info,
                               markdown_table, parse_section_args, run_tasks, section_parser,
                               write_section)

VARIANTS = {
    "plain": {},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "accumulate 4": {"accumulate_steps": 4},
}


def _task(options: dict, steps: int, batch: int) -> dict:
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(
        communication_options=tfdist.CommunicationOptions(**options))
    data = digits_dataset(batch)
    with strategy.scope():
        model = compile_digits(digits_cnn())
    model.fit(data, epochs=1, steps_per_epoch=8, verbose=0)  # compile and warm up
    before = strategy.bytes_communicated
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - start
    return {"step_seconds": seconds / steps,
            "bytes_per_step": (strategy.bytes_communicated - before) / steps,
            "updates": int(model.optimizer.iterations.numpy())}


def main(argv=None) -> dict:
    args = parse_section_args(section_parser("benchmarks.communication", __doc__), argv)
    rounds, steps = (1, 8) if args.quick else (3, 60)
    # The smoke run: the two ends of the comparison.
    variants = {k: VARIANTS[k] for k in ("plain", "accumulate 4")} if args.quick else VARIANTS
    samples = {name: [] for name in variants}
    for round_index in range(rounds):
        for name, options in variants.items():
            print(f"communication: round {round_index + 1}/{rounds}: {name}", flush=True)
            result = run_tasks(_task, options, steps, 64, workers=2, timeout=600)[0]
            samples[name].append(result)
    table = [["variant", "step (ms)", "vs plain", "bytes / step", "vs plain"]]
    summary = {}
    for name, results in samples.items():
        step = statistics.median(r["step_seconds"] for r in results)
        nbytes = statistics.median(r["bytes_per_step"] for r in results)
        summary[name] = {"step_seconds": step, "bytes_per_step": nbytes}
    plain = summary["plain"]
    for name, s in summary.items():
        table.append([name, f"{s['step_seconds'] * 1e3:.2f}",
                      f"{s['step_seconds'] / plain['step_seconds']:.2f}x",
                      f"{s['bytes_per_step']:,.0f}",
                      f"{s['bytes_per_step'] / plain['bytes_per_step']:.2f}x"])
    markdown = "\n".join([
        "# Compression and accumulation, 2 workers (multi-worker mirrored)", "",
        "Command: `.venv/bin/python -m benchmarks.communication`", "",
        f"Digits CNN, global batch 64, {steps} timed steps per run, median of {rounds} "
        "alternating rounds. A step is one micro-batch; with accumulation one update "
        "(and one all-reduce) happens every 4 steps.", "", markdown_table(table), "",
        "On loopback the all-reduce is a small part of a step, so compression saves bytes "
        "but little time here; it pays on slow links (see slow_link).", ""])
    data = {"machine": machine_info(), "rounds": rounds, "steps": steps,
            "summary": summary, "samples": samples}
    write_section(args.output, "communication", markdown, data)
    print(markdown)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
