"""A straggler against model averaging: the fast worker's inner step, 2 workers.

Worker 1 is made 3x slower (it sleeps twice the measured step after each batch, in a
Keras callback); worker 0 is not slowed. With `tfdist.ModelAverageStrategy(period=16)`
a step that does not average sends nothing, so worker 0's median inner step (the steps
that do not average, timed between batch ends, the first of each epoch left out) should
stay at its step with no straggler; it waits only at the averages. The same straggler
under `tfdist.MultiWorkerMirroredStrategy` (sync) is shown for contrast: there every
step waits. Needs no root. Run it from the repository root:

    python -m benchmarks.straggler [--output DIR]   # DIR/straggler.{json,md,png}
    python -m benchmarks.straggler --quick          # 1 epoch
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import (compile_digits, digits_cnn, digits_data, machine_info,
                               markdown_table, parse_section_args, pyplot, run_tasks,
                               save_figure, section_parser, write_section)
from benchmarks.goals import goal

NAME = "straggler"
GLOBAL_BATCH = 64
PERIOD = 16
SLOWDOWN = 3.0


class StepTimes:
    """Keras callback: the time between batch ends within each epoch, and a sleep after
    each batch (the straggler)."""

    def __new__(cls, sleep: float):
        import keras

        class _Times(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.steps = []     # (optimizer step, seconds) of each timed interval
                self._last = None

            def on_epoch_begin(self, epoch, logs=None):
                self._last = None

            def on_train_batch_end(self, batch, logs=None):
                if sleep:
                    time.sleep(sleep)
                now = time.perf_counter()
                if self._last is not None:
                    step = int(self.model.optimizer.iterations.numpy())
                    self.steps.append((step, now - self._last))
                self._last = now

        return _Times()


def train(mode: str, sleep: float, epochs: int) -> dict:
    """Runs in each worker: fits the digits CNN; worker 1 sleeps ``sleep`` s per batch."""
    import tfdist

    strategy = (tfdist.ModelAverageStrategy(period=PERIOD) if mode == "period=16"
                else tfdist.MultiWorkerMirroredStrategy())
    x, y = digits_data()
    with strategy.scope():
        model = compile_digits(digits_cnn(seed=0))
    times = StepTimes(sleep if strategy.rank == 1 else 0.0)
    start = time.perf_counter()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[times])
    seconds = time.perf_counter() - start
    inner = [t for step, t in times.steps if mode != "period=16" or step % PERIOD]
    averaging = [t for step, t in times.steps if mode == "period=16" and not step % PERIOD]
    return {"rank": strategy.rank, "median_inner": statistics.median(inner),
            "median_average": statistics.median(averaging) if averaging else None,
            "fit_seconds": seconds, "inner": inner}


def run(mode: str, sleep: float, epochs: int) -> list[dict]:
    values = run_tasks(train, mode, sleep, epochs, workers=2, timeout=600, stream=None)
    return sorted(values, key=lambda v: v["rank"])


def main(argv=None) -> None:
    parser = section_parser(f"benchmarks.{NAME}", __doc__)
    parser.add_argument("--epochs", type=int, default=4)
    args = parse_section_args(parser, argv)
    epochs = 1 if args.quick else args.epochs
    results = {}
    for mode in ("period=16", "sync"):
        alone = run(mode, 0.0, epochs)
        base = alone[0]["median_inner"]
        sleep = (SLOWDOWN - 1.0) * base
        slowed = run(mode, sleep, epochs)
        results[mode] = {"alone": alone, "straggler": slowed, "sleep": sleep,
                         "ratio": slowed[0]["median_inner"] / base,
                         "straggler_ratio": slowed[1]["median_inner"] / alone[1]["median_inner"]}
        print(f"{mode:<10} fast worker {base * 1e3:.1f} ms alone, "
              f"{slowed[0]['median_inner'] * 1e3:.1f} ms with the straggler "
              f"({results[mode]['ratio']:.2f}x); straggler "
              f"{slowed[1]['median_inner'] * 1e3:.1f} ms", flush=True)
    command = f"python -m benchmarks.{NAME}" + (" --quick" if args.quick else "")
    data = {"epochs": epochs, "period": PERIOD, "global_batch": GLOBAL_BATCH,
            "slowdown": SLOWDOWN, "results": results,
            "ratio_period16": results["period=16"]["ratio"],
            "ratio_sync": results["sync"]["ratio"], "machine": machine_info(),
            "command": command}
    write_report(args.output, data)


def write_report(out, data: dict) -> None:
    """Writes straggler.md/.json and straggler.png."""
    target = goal(NAME)
    rows = [["strategy", "fast worker alone (ms)", "fast worker, straggler (ms)",
             "ratio", "straggler's step (ms)", "straggler's step / its own alone",
             "fast worker's averaging step (ms)"]]
    for mode, r in data["results"].items():
        fast, slow = r["straggler"]
        average = fast["median_average"]
        rows.append([mode, f"{r['alone'][0]['median_inner'] * 1e3:.1f}",
                     f"{fast['median_inner'] * 1e3:.1f}", f"{r['ratio']:.2f}x",
                     f"{slow['median_inner'] * 1e3:.1f}", f"{r['straggler_ratio']:.2f}x",
                     "-" if average is None else f"{average * 1e3:.0f}"])
    ratio = data["ratio_period16"]
    markdown = f"""# Straggler: the fast worker's inner step with a 3x slower peer

Digits CNN, 2 workers under `tfdist.launch` (no root), global batch {data['global_batch']},
{data['epochs']} epochs; worker 1 sleeps {data['slowdown'] - 1:g}x the fast worker's step
after each batch (it becomes about {data['slowdown']:g}x slower). Medians of the steps
that do not average (model averaging, `period={data['period']}`) or of every step (sync),
timed between batch ends, the first step of each epoch left out.

{markdown_table(rows)}

Goal `{NAME}`: the fast worker's median inner step with the straggler / without it
{target.target}: **{ratio:.2f}x, {target.status(ratio)}**. Under sync every step waits
for the straggler ({data['ratio_sync']:.2f}x). With model averaging the fast worker waits
only at the averages (last column: its averaging step, which absorbs the straggler's
lag of {data['period'] - 1} steps). The machine has 2 shared cores: when the straggler
sleeps, the fast worker may run faster than alone (a ratio below 1).

Reproduce: `{data['command']}`. Plot: `{NAME}.png`.
"""
    write_section(out, NAME, markdown, data)
    plot(data, out / f"{NAME}.png")
    print(markdown)


def plot(data: dict, path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    modes = list(data["results"])
    labels = ["fast worker alone", "fast worker, straggler", "straggler"]
    width = 0.25
    for i, label in enumerate(labels):
        values = []
        for mode in modes:
            r = data["results"][mode]
            source = (r["alone"][0], r["straggler"][0], r["straggler"][1])[i]
            values.append(source["median_inner"] * 1e3)
        ax.bar([m + (i - 1) * width for m in range(len(modes))], values, width, label=label)
    ax.set_xticks(range(len(modes)), [f"{m}" for m in modes])
    ax.set_ylabel("median inner step (ms)")
    ax.set_title("A 3x slower peer: model averaging (period 16) against sync")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
