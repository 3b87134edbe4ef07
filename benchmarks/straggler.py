"""A straggler against model averaging: the fast worker's inner step, 2 workers.

Worker 1 is made 3x slower in every other epoch (it sleeps twice its measured step
after each batch, in a Keras callback); worker 0 is not slowed. With `tfdist.ModelAverageStrategy(period=16)`
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
    """Keras callback: the time between batch ends within each epoch; on worker 1, a
    sleep after each batch in the even epochs after the first (the straggler)."""

    def __new__(cls, straggler: bool):
        import keras

        class _Times(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.steps = []     # (epoch, optimizer step, seconds) of each interval
                self._last, self._epoch, self.sleep = None, 0, 0.0

            def on_epoch_begin(self, epoch, logs=None):
                self._last, self._epoch = None, epoch
                alone = [t for e, _, t in self.steps if e % 2]
                if straggler and epoch > 0 and not epoch % 2 and alone:
                    # (SLOWDOWN - 1) x its own step in the epochs without a straggler.
                    self.sleep = (SLOWDOWN - 1.0) * statistics.median(alone)
                else:
                    self.sleep = 0.0

            def on_train_batch_end(self, batch, logs=None):
                if self.sleep:
                    time.sleep(self.sleep)
                now = time.perf_counter()
                if self._last is not None:
                    step = int(self.model.optimizer.iterations.numpy())
                    self.steps.append((self._epoch, step, now - self._last))
                self._last = now

        return _Times()


def train(mode: str, epochs: int) -> dict:
    """Runs in each worker: fits the digits CNN. Epoch 0 warms up; in the even epochs
    after it worker 1 is the straggler, in the odd ones nobody is (interleaved, so the
    load of the shared machine weighs on both alike)."""
    import tfdist

    strategy = (tfdist.ModelAverageStrategy(period=PERIOD) if mode == "period=16"
                else tfdist.MultiWorkerMirroredStrategy())
    x, y = digits_data()
    with strategy.scope():
        model = compile_digits(digits_cnn(seed=0))
    times = StepTimes(strategy.rank == 1)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[times])

    def median(straggled: bool, averaging: bool = False):
        values = [t for e, step, t in times.steps
                  if e > 0 and (e % 2 == 0) == straggled
                  and (mode == "period=16" and not step % PERIOD) == averaging]
        return statistics.median(values) if values else None

    return {"rank": strategy.rank, "alone": median(False), "straggler": median(True),
            "average_alone": median(False, True), "average_straggler": median(True, True),
            "sleep": times.sleep if strategy.rank == 1 else 0.0}


def main(argv=None) -> None:
    parser = section_parser(f"benchmarks.{NAME}", __doc__)
    parser.add_argument("--epochs", type=int, default=13)
    args = parse_section_args(parser, argv)
    epochs = 3 if args.quick else args.epochs  # odd: as many epochs alone as straggled
    results = {}
    for mode in ("period=16", "sync"):
        values = run_tasks(train, mode, epochs, workers=2, timeout=900, stream=None)
        fast, slow = sorted(values, key=lambda v: v["rank"])
        results[mode] = {"fast": fast, "slow": slow,
                         "ratio": fast["straggler"] / fast["alone"],
                         "straggler_ratio": slow["straggler"] / slow["alone"]}
        print(f"{mode:<10} fast worker {fast['alone'] * 1e3:.1f} ms alone, "
              f"{fast['straggler'] * 1e3:.1f} ms with the straggler "
              f"({results[mode]['ratio']:.2f}x); straggler {slow['straggler'] * 1e3:.1f} ms "
              f"({results[mode]['straggler_ratio']:.2f}x its own)", flush=True)
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
             "fast worker's averaging step, alone / straggler (ms)"]]
    for mode, r in data["results"].items():
        fast, slow = r["fast"], r["slow"]
        averages = ("-" if fast["average_alone"] is None else
                    f"{fast['average_alone'] * 1e3:.0f} / {fast['average_straggler'] * 1e3:.0f}")
        rows.append([mode, f"{fast['alone'] * 1e3:.1f}", f"{fast['straggler'] * 1e3:.1f}",
                     f"{r['ratio']:.2f}x", f"{slow['straggler'] * 1e3:.1f}",
                     f"{r['straggler_ratio']:.2f}x", averages])
    ratio = data["ratio_period16"]
    markdown = f"""# Straggler: the fast worker's inner step with a 3x slower peer

Digits CNN, 2 workers under `tfdist.launch` (no root), global batch {data['global_batch']},
{data['epochs']} epochs in one launch per strategy: epoch 0 warms up, then epochs
alternate between no straggler and worker 1 sleeping {data['slowdown'] - 1:g}x its own
step after each batch (about {data['slowdown']:g}x slower), so the load of the shared
machine weighs on both alike. Medians of the steps that do not average (model averaging,
`period={data['period']}`) or of every step (sync), timed between batch ends, the first
step of each epoch left out.

{markdown_table(rows)}

Goal `{NAME}`: the fast worker's median inner step with the straggler / without it
{target.target}: **{ratio:.2f}x, {target.status(ratio)}**. Under sync every step waits
for the straggler ({data['ratio_sync']:.2f}x). With model averaging the fast worker waits
only at the averages (last column: its averaging step, which absorbs the straggler's
lag). The machine has 2 shared cores: when the straggler
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
            values.append((r["fast"]["alone"], r["fast"]["straggler"],
                           r["slow"]["straggler"])[i] * 1e3)
        ax.bar([m + (i - 1) * width for m in range(len(modes))], values, width, label=label)
    ax.set_xticks(range(len(modes)), [f"{m}" for m in modes])
    ax.set_ylabel("median inner step (ms)")
    ax.set_title("A 3x slower peer: model averaging (period 16) against sync")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
