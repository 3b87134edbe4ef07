"""Model averaging on 2 workers: final accuracy and bytes all-reduced, sync vs local SGD.

Each configuration trains the digits CNN of the other benchmarks (scikit-learn's 8x8
digits, 80/20 split fixed by a seed) for the same number of epochs with the same global
batch and inner optimizer (SGD 0.05), on 2 workers started by `tfdist.launch`:

- ``sync``: `tfdist.MultiWorkerMirroredStrategy` (gradients all-reduced every step);
  its bytes are computed as steps x parameter bytes (one gradient all-reduce a step);
- ``period=H``: `tfdist.ModelAverageStrategy(period=H)` for H in {1, 4, 16}, without
  and with an outer optimizer (Nesterov SGD 0.7, momentum 0.9: SlowMo/DiLoCo); bytes
  from ``strategy.bytes_communicated``.

Accuracy is measured by ``model.evaluate`` on the held-out 20% (every worker gets the
same number). Run it from the repository root:

    python -m benchmarks.model_average [--output DIR]   # DIR/model_average.{json,md,png}
    python -m benchmarks.model_average --quick          # 1 epoch, 2 configurations
    python -m benchmarks.model_average --render         # rewrite .md/.png from the .json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks.common import (digits_cnn, digits_data, machine_info, markdown_table,
                               parse_section_args, pyplot, run_tasks, save_figure,
                               section_parser, write_json)

GLOBAL_BATCH = 64
LEARNING_RATE = 0.05
OUTER = {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}


def split_digits(seed: int = 0):
    """80/20 train/test split of digits, fixed by ``seed``."""
    import numpy as np

    x, y = digits_data()
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def train(config: dict, epochs: int) -> dict:
    """Runs in every worker: one configuration, trained and evaluated."""
    import keras

    import tfdist

    if config["period"] is None:
        strategy = tfdist.MultiWorkerMirroredStrategy()
    else:
        # A function: the strategy must exist before TF starts (an optimizer starts it).
        outer = (lambda: keras.optimizers.SGD(**OUTER)) if config["outer"] else None
        strategy = tfdist.ModelAverageStrategy(period=config["period"], outer_optimizer=outer)
    (x, y), (x_test, y_test) = split_digits()
    with strategy.scope():
        model = digits_cnn(seed=0)
        model.compile(keras.optimizers.SGD(LEARNING_RATE),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    start = time.perf_counter()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
    steps = int(model.optimizer.iterations.numpy())
    param_bytes = sum(int(w.numpy().nbytes) for w in model.trainable_weights)
    if config["period"] is None:
        nbytes, counted = steps * param_bytes, False
    else:
        nbytes, counted = strategy.bytes_communicated, True
    return {"accuracy": float(accuracy), "loss": float(loss), "bytes": int(nbytes),
            "bytes_counted": counted, "steps": steps, "param_bytes": param_bytes,
            "fit_seconds": seconds}


def configurations(quick: bool) -> list[dict]:
    if quick:
        return [{"name": "sync", "period": None, "outer": False},
                {"name": "period=4", "period": 4, "outer": False}]
    configs = [{"name": "sync", "period": None, "outer": False}]
    for outer in (False, True):
        for period in (1, 4, 16):
            name = f"period={period}" + (" + outer Nesterov" if outer else "")
            configs.append({"name": name, "period": period, "outer": outer})
    return configs


def plot(results: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for r in results:
        marker = "s" if r["period"] is None else ("^" if r["outer"] else "o")
        ax.scatter(r["bytes"] / 1e6, 100 * r["accuracy"], marker=marker, s=60)
        ax.annotate(r["name"], (r["bytes"] / 1e6, 100 * r["accuracy"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.margins(x=0.3, y=0.1)
    ax.set_xlabel("MB all-reduced per worker (log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Digits CNN, 2 workers: accuracy vs bytes, same epochs")
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = section_parser("benchmarks.model_average", __doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", metavar="DIR", default=None, help="deprecated: --output DIR")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md/.png from the existing .json")
    args = parse_section_args(parser, argv)
    if args.out:
        print("model_average: --out is deprecated; use --output DIR", file=sys.stderr,
              flush=True)
        args.output = Path(args.out).resolve()
        args.output.mkdir(parents=True, exist_ok=True)
    out, stem = args.output, "model_average"
    if args.render:
        write_report(out, stem, json.loads((out / f"{stem}.json").read_text()))
        return
    epochs = 1 if args.quick else args.epochs

    results = []
    total = time.perf_counter()
    for config in configurations(args.quick):
        start = time.perf_counter()
        values = run_tasks(train, config, epochs, workers=2, timeout=300, stream=None)
        accuracies = {round(v["accuracy"], 6) for v in values}
        if len(accuracies) != 1:
            raise RuntimeError(f"{config['name']}: workers disagree on accuracy: {accuracies}")
        result = {**config, **values[0], "job_seconds": time.perf_counter() - start}
        results.append(result)
        print(f"{config['name']:<28} accuracy {100 * result['accuracy']:.2f}%  "
              f"bytes {result['bytes']:>12,}  fit {result['fit_seconds']:.1f}s", flush=True)
    total = time.perf_counter() - total

    command = "python -m benchmarks.model_average" + (" --quick" if args.quick else "")
    data = {"epochs": epochs, "global_batch": GLOBAL_BATCH, "learning_rate": LEARNING_RATE,
            "outer": OUTER, "results": results, "total_seconds": total,
            "machine": machine_info(), "command": command}
    write_report(out, stem, data)


def write_report(out: Path, stem: str, data: dict) -> None:
    """Writes ``stem``.json, .md (table and command) and .png from the results."""
    results, epochs, total = data["results"], data["epochs"], data["total_seconds"]
    command = data["command"]
    sync_bytes = results[0]["bytes"]
    rows = [["configuration", "test accuracy", "test loss", "MB all-reduced",
             "fewer bytes than sync", "fit seconds"]]
    for r in results:
        rows.append([r["name"], f"{100 * r['accuracy']:.2f}%", f"{r['loss']:.4f}",
                     f"{r['bytes'] / 1e6:.2f}" + ("" if r["bytes_counted"] else " (computed)"),
                     "-" if r["period"] is None else f"{sync_bytes / r['bytes']:.1f}x",
                     f"{r['fit_seconds']:.1f}"])
    steps, param_bytes = results[0]["steps"], results[0]["param_bytes"]
    longest = max((r["period"] for r in results if r["period"]), default=1)
    extra_average = (f"hence {steps // longest + 1} averages, not {steps / longest:g}, for "
                     f"`period={longest}`" if steps % longest else "here every run ended "
                     "on an average")
    markdown = f"""# Model averaging: accuracy vs bytes (2 workers, digits)

Digits CNN ({param_bytes // 4:,} parameters), {epochs} epochs, {steps} optimizer steps,
global batch {GLOBAL_BATCH} (2 workers x {GLOBAL_BATCH // 2}), inner SGD {LEARNING_RATE};
outer optimizer: Nesterov SGD 0.7, momentum 0.9. Test set: the held-out 20% of digits.
Bytes: one worker's payload, summed over all all-reduces (for sync: steps x parameter
bytes, one gradient all-reduce a step). Wall time of the whole run: {total:.0f} s
({len(results)} launches of 2 workers; most of it is process and cluster start-up).

{markdown_table(rows)}

`period=1` is the same algorithm as sync with plain SGD (the tests check equality over
a few steps to 1e-5); over {steps} steps rounding differences grow (about 1e-3 in the
weights here), which is the gap between those two rows. When the steps are not a
multiple of `period`, `fit` ends with one more average (so the model is one model):
{extra_average}. Fit seconds include tracing and
were measured on a shared 2-core machine: read them as rough.

Reproduce: `{command}` (from the repository root). Plot: `{stem}.png`.
Machine: {data['machine'].get('cpus')} CPUs, TensorFlow {data['machine'].get('tensorflow')}.
"""
    (out / f"{stem}.md").write_text(markdown)
    write_json(out / f"{stem}.json", data)
    plot(results, out / f"{stem}.png")
    print(markdown)


if __name__ == "__main__":
    main()
