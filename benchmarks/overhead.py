"""Strategy overhead: step time of each tfdist strategy / the stock TF strategy it extends.

    .venv/bin/python -m benchmarks.overhead [--quick] [--output DIR]

Same model (the MLP of `benchmarks.mirrored`: 256-512-512-10, global batch 256), same
data, Keras' own compiled ``train_function`` called step by step:

- mirrored: `tfdist.MirroredStrategy` vs `tf.distribute.MirroredStrategy` on 2 logical
  CPUs, in one process, alternating every block of steps
  (`benchmarks.mirrored.step_times`), with the same cross-device ops (pure overhead)
  and with each one's default;
- multi-worker: `tfdist.MultiWorkerMirroredStrategy` vs
  `tf.distribute.MultiWorkerMirroredStrategy`, 2 workers started by `tfdist.launch`.
  Multi-worker TF starts once per process, so each launch measures one strategy, and the
  launches rotate (stock, tfdist, tfdist without collective timeout, ...) so slow phases
  hit all. The third candidate isolates the cost of tfdist's default
  ``collective_timeout`` (TF starts a sleeping thread per timed collective). Stock
  MWMS cannot run Keras 3's ``train_function`` (keras-team/keras#20585), so both run the
  same custom step (tape, Keras optimizer ``apply``, loss reduced to the host).

The ratio is median(tfdist step) / median(stock step); its goal is in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (machine_info, markdown_table, parse_section_args, pyplot,
                               run_tasks, save_figure, section_parser, write_section)
from benchmarks.goals import goal, read_analysis

BATCH = 256


def mirrored_task(rounds: int, repeats: int) -> dict:
    """In a fresh process: 2 logical CPUs, then `benchmarks.mirrored.step_times`."""
    import tfdist

    tfdist.devices.use_logical_cpus(2)
    from benchmarks.mirrored import step_times

    return step_times(rounds=rounds, repeats=repeats, batch=BATCH)


KINDS = ("stock", "tfdist", "tfdist, no collective timeout")


def _threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def multi_worker_task(kind: str, blocks: int, steps: int) -> dict:
    """In each of 2 workers: seconds per step of ``blocks`` blocks of ``steps`` steps,
    and how many OS threads the process gained per step meanwhile."""
    import tfdist

    if kind == "stock":
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif kind == "tfdist, no collective timeout":
        strategy = tfdist.MultiWorkerMirroredStrategy(collective_timeout=None)
    else:
        strategy = tfdist.MultiWorkerMirroredStrategy()
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 8, 256)).astype("float32")
    y = rng.integers(0, 10, size=BATCH * 8).astype("int32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, "relu"),
                                  keras.layers.Dense(512, "relu"), keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    optimizer = model.optimizer

    # Stock MultiWorkerMirroredStrategy cannot run Keras 3's own train step
    # (keras-team/keras#20585: "Invalid reduction dimension 0 for input with 0
    # dimensions"), so both strategies run this custom step: forward, backward, Keras'
    # optimizer (which all-reduces the gradients), and the loss reduced to the host.
    @tf.function
    def train_step(iterator):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=next(iterator)),
                               axis=None)

    dist = iter(strategy.experimental_distribute_dataset(data))
    for _ in range(3):  # trace, then warm up the collectives
        train_step(dist)
    seconds = []
    threads = _threads()
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(steps):
            loss = train_step(dist)
        float(loss)  # wait for the last step
        seconds.append((time.perf_counter() - start) / steps)
    return {"seconds": seconds, "threads_per_step": (_threads() - threads) / (blocks * steps)}


def measure_multi_worker(rounds, blocks, steps, timeout, kinds=KINDS):
    from benchmarks.common import run_tasks

    samples = {kind: [] for kind in kinds}
    threads = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        order = kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]
        for kind in order:
            print(f"overhead: multi-worker {kind} (round {round_ + 1}/{rounds}) ...", flush=True)
            values = run_tasks(multi_worker_task, kind, blocks, steps, workers=2,
                               timeout=timeout)
            samples[kind] += values[0]["seconds"]  # worker 0 (workers run in lockstep)
            threads[kind].append(values[0]["threads_per_step"])
            print(f"overhead: multi-worker {kind}: "
                  f"{statistics.median(values[0]['seconds']) * 1e3:.2f} ms/step, "
                  f"{values[0]['threads_per_step']:+.2f} threads/step", flush=True)
    return samples, threads


def plot(rows, path, target):
    names = [r[0] for r in rows]
    ratios = [r[1] for r in rows]
    fig, ax = pyplot().subplots(figsize=(10, 0.6 * len(names) + 1.2))
    colors = ["tab:green" if target.is_met(r) else "tab:red" for r in ratios]
    ax.barh(names, ratios, color=colors)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(target.bound, color="gray", ls="--", lw=0.8, label=f"goal {target.bound:g}")
    for i, r in enumerate(ratios):
        ax.text(r, i, f" {r:.3f}", va="center", fontsize=8)
    ax.set_xlim(min(0.9, min(ratios) - 0.02), max(1.1, max(ratios) + 0.08))
    ax.set_xlabel("tfdist step time / stock TF step time")
    ax.invert_yaxis()
    ax.legend(loc="upper right", fontsize=8, bbox_to_anchor=(1.0, 1.25), ncol=1)
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse_section_args(section_parser("benchmarks.overhead", __doc__), argv)
    target = goal("overhead")

    if args.quick:
        m_rounds, m_repeats, w_rounds, w_blocks, w_steps, timeout = 2, 2, 1, 2, 3, 240
    else:
        m_rounds, m_repeats, w_rounds, w_blocks, w_steps, timeout = 15, 10, 2, 5, 15, 600
    data = {"machine": machine_info(), "batch": BATCH}
    errors = {}
    print("overhead: mirrored (2 logical CPUs) ...", flush=True)
    try:
        mirrored = run_tasks(mirrored_task, m_rounds, m_repeats, workers=1, timeout=timeout)[0]
        data["mirrored_step_seconds"] = mirrored
        data["mirrored_ratio"] = (mirrored["tfdist MirroredStrategy (collective)"]
                                  / mirrored["stock MirroredStrategy (collective)"])
        data["mirrored_ratio_default"] = (
            mirrored["tfdist MirroredStrategy (default)"]
            / mirrored["stock MirroredStrategy + ReductionToOneDevice"])
    except Exception as error:
        errors["mirrored"] = f"{type(error).__name__}: {str(error)[:400]}"
        print(f"overhead: mirrored FAILED: {errors['mirrored']}", flush=True)
    try:
        # The smoke run leaves out the diagnostic third candidate.
        samples, threads = measure_multi_worker(w_rounds, w_blocks, w_steps, timeout,
                                                KINDS[:2] if args.quick else KINDS)
        medians = {kind: statistics.median(v) for kind, v in samples.items()}
        data["multi_worker_step_seconds"] = medians
        data["multi_worker_samples"] = samples
        data["multi_worker_threads_per_step"] = {k: statistics.median(v)
                                                 for k, v in threads.items()}
        data["multi_worker_ratio"] = medians["tfdist"] / medians["stock"]
        if "tfdist, no collective timeout" in medians:
            data["multi_worker_ratio_no_timeout"] = (medians["tfdist, no collective timeout"]
                                                     / medians["stock"])
    except Exception as error:
        errors["multi_worker"] = f"{type(error).__name__}: {str(error)[:400]}"
        print(f"overhead: multi-worker FAILED: {errors['multi_worker']}", flush=True)
    data["errors"] = errors

    rows = [["tfdist strategy", "stock TF strategy", "tfdist step (ms)", "stock step (ms)",
             "ratio", f"goal {target.target}"]]
    plot_rows = []

    def add(name, stock_name, ours, stock):
        ratio = ours / stock
        rows.append([name, stock_name, f"{ours * 1e3:.2f}", f"{stock * 1e3:.2f}",
                     f"**{ratio:.3f}**", "met" if target.is_met(ratio) else "missed"])
        plot_rows.append((name, ratio))

    if "mirrored_step_seconds" in data:
        m = data["mirrored_step_seconds"]
        add("MirroredStrategy (same ops: collective)", "MirroredStrategy",
            m["tfdist MirroredStrategy (collective)"], m["stock MirroredStrategy (collective)"])
        add("MirroredStrategy (default: ReductionToOneDevice + byte counter)",
            "MirroredStrategy + ReductionToOneDevice", m["tfdist MirroredStrategy (default)"],
            m["stock MirroredStrategy + ReductionToOneDevice"])
    else:
        rows.append(["MirroredStrategy", "MirroredStrategy", "", "", "failed",
                     errors.get("mirrored", "")])
    if "multi_worker_ratio" in data:
        w = data["multi_worker_step_seconds"]
        add("MultiWorkerMirroredStrategy (2 workers)", "MultiWorkerMirroredStrategy",
            w["tfdist"], w["stock"])
        if "tfdist, no collective timeout" in w:
            add("MultiWorkerMirroredStrategy(collective_timeout=None)",
                "MultiWorkerMirroredStrategy", w["tfdist, no collective timeout"], w["stock"])
    else:
        rows.append(["MultiWorkerMirroredStrategy", "MultiWorkerMirroredStrategy", "", "",
                     "failed", errors.get("multi_worker", "")])
    out = args.output
    leak = ""
    if "multi_worker_threads_per_step" in data:
        t = data["multi_worker_threads_per_step"]
        leak = ("OS threads gained per training step (worker 0): " + ", ".join(
            f"{k}: {v:+.2f}" for k, v in t.items()) + ". "
            + read_analysis()["overhead-collective-timeout"])
    text = ["# Strategy overhead against stock TF", "",
            "Command: `.venv/bin/python -m benchmarks.overhead`", "",
            f"MLP 256-512-512-10, global batch {BATCH}, Keras' compiled train step. Mirrored: "
            f"one process, candidates alternate every block of {m_repeats} steps "
            f"({m_rounds} blocks each). Multi-worker: {w_rounds} launches of 2 workers per "
            f"strategy, rotating the order, {w_blocks} blocks of {w_steps} steps each; "
            "medians of the per-step times.", "", markdown_table(rows), "", leak, ""]
    if plot_rows:
        plot(plot_rows, out / "overhead.png", target)
        text += ["![overhead](overhead.png)", ""]
    write_section(out, "overhead", "\n".join(text), data)
    print("\n".join(text), flush=True)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
