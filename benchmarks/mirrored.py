"""Mirrored strategy on 2 logical CPUs: cross-device ops, and overhead against stock TF.

    .venv/bin/python -m benchmarks.mirrored [--quick] [--output DIR]

1. All-reduce latency of each CPU cross-device ops (ReductionToOneDevice, TF's default
   ring collective) from 4 KB to 64 MB: how tfdist's CPU default was chosen.
2. Step time of `tfdist.MirroredStrategy` / stock `tf.distribute.MirroredStrategy` on the
   same model, both with TF's default ops (pure overhead) and with each one's default.
Measurements alternate between candidates so noise hits them alike.
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks.common import (machine_info, markdown_table, parse_section_args,
                               section_parser, write_json)
from benchmarks.goals import goal


def allreduce_latency(sizes, rounds, repeats):
    import tensorflow as tf

    import tfdist

    results = {}
    for name, ops in (("ReductionToOneDevice", None), ("collective ring (TF default)",
                                                     "collective")):
        strategy = tfdist.MirroredStrategy(cross_device_ops=ops)
        results[name] = {}
        for size in sizes:
            n = size // 4
            value = strategy.run(lambda: tf.ones([n]) * tf.cast(
                tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32))

            @tf.function
            def step(v=value, s=strategy):
                return s.extended.reduce_to(tf.distribute.ReduceOp.SUM, v, v)

            step()
            results[name][size] = None
            from benchmarks.common import interleaved_medians

            results[name][size] = interleaved_medians({"x": step}, rounds, repeats)["x"]
    return results


def step_times(rounds, repeats, batch=256):
    import keras
    import tensorflow as tf

    import tfdist
    from benchmarks.common import interleaved_medians

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 8, 256)).astype("float32")
    y = rng.integers(0, 10, size=batch * 8).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()

    def trainer(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, "relu"),
                                      keras.layers.Dense(512, "relu"), keras.layers.Dense(10)])
            model.compile(keras.optimizers.SGD(0.01),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        dist = iter(strategy.experimental_distribute_dataset(data))
        model.make_train_function()
        model.train_function(dist)  # compile
        return lambda: model.train_function(dist)

    candidates = {
        "stock MirroredStrategy (collective)": trainer(tf.distribute.MirroredStrategy()),
        "tfdist MirroredStrategy (collective)": trainer(
            tfdist.MirroredStrategy(cross_device_ops="collective")),
        "stock MirroredStrategy + ReductionToOneDevice": trainer(
            tf.distribute.MirroredStrategy(
                cross_device_ops=tf.distribute.ReductionToOneDevice())),
        "tfdist MirroredStrategy (default)": trainer(tfdist.MirroredStrategy()),
    }
    return interleaved_medians(candidates, rounds, repeats)


def main(argv=None) -> dict:
    args = parse_section_args(section_parser("benchmarks.mirrored", __doc__), argv)
    import tfdist

    tfdist.devices.use_logical_cpus(2)
    target = goal("overhead").target

    if args.quick:
        sizes, rounds, repeats = [4096, 1 << 20], 1, 2
    else:
        sizes, rounds, repeats = [4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20], 5, 5
    latency = allreduce_latency(sizes, rounds, repeats)
    steps = step_times(rounds=3 if args.quick else 15, repeats=2 if args.quick else 10)
    stock, ours = (steps["stock MirroredStrategy (collective)"],
                   steps["tfdist MirroredStrategy (collective)"])
    result = {
        "machine": machine_info(),
        "allreduce_seconds": {k: {str(s): t for s, t in v.items()} for k, v in latency.items()},
        "step_seconds": steps,
        "overhead_ratio_same_ops": ours / stock,
        "overhead_ratio_default": steps["tfdist MirroredStrategy (default)"]
        / steps["stock MirroredStrategy + ReductionToOneDevice"],
        "speedup_default_vs_stock_default": stock / steps["tfdist MirroredStrategy (default)"],
    }
    out = args.output
    write_json(out / "mirrored.json", result)
    names = list(latency)
    rows = [["size"] + [f"{n} (ms)" for n in names] + ["collective / R1D"]]
    for size in sizes:
        times = [latency[n][size] for n in names]
        rows.append([f"{size / 1024:g} KB"] + [f"{t * 1e3:.3f}" for t in times]
                    + [f"{times[1] / times[0]:.2f}x"])
    step_rows = [["strategy", "step (ms)"]] + [[k, f"{v * 1e3:.2f}"] for k, v in steps.items()]
    text = ["# Mirrored strategy, 2 logical CPUs", "",
            "Command: `.venv/bin/python -m benchmarks.mirrored`", "",
            "## All-reduce latency by cross-device ops", "", markdown_table(rows), "",
            "## Step time, same model, measured alternately", "", markdown_table(step_rows), "",
            f"- tfdist / stock with the same (collective) ops: "
            f"**{result['overhead_ratio_same_ops']:.3f}** (goal {target})",
            f"- tfdist default (ReductionToOneDevice + byte counter) / stock with "
            f"ReductionToOneDevice: **{result['overhead_ratio_default']:.3f}** (goal {target})",
            f"- stock default / tfdist default (speed-up of tfdist's CPU choice): "
            f"**{result['speedup_default_vs_stock_default']:.2f}x**", ""]
    (out / "mirrored.md").write_text("\n".join(text))
    print("\n".join(text))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
