"""Step time of one fit under keras.distribution.DataParallel and under the tfdist strategy
it runs as (the figures of docs/keras_distribution.md).

    PYTHONPATH=.:tests python scripts/keras_distribution_steps.py local    # 2 logical CPUs
    PYTHONPATH=.:tests python scripts/keras_distribution_steps.py workers  # 2 workers

Modes alternate round by round; each prints the median per-step time of epochs 2-4 (ms)
per round and the median over rounds.
"""
import json
import sys
import time

import tfdist
from helpers import run_cluster

STEPS, BATCH, WIDTH = 40, 64, 512


def run(mode):
    """One fit (4 epochs of STEPS steps) in ``mode``: none (one device), mirrored, mwms
    (tfdist strategies) or keras (``keras.distribution.DataParallel()``)."""
    import statistics

    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 256)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((256,)),
                                  keras.layers.Dense(WIDTH, activation="relu"),
                                  keras.layers.Dense(WIDTH, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if mode == "keras":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = build()
    elif mode == "none":
        model = build()
    else:
        strategy = (tfdist.MultiWorkerMirroredStrategy() if mode == "mwms"
                    else tfdist.MirroredStrategy())
        with strategy.scope():
            model = build()
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append((time.perf_counter() - self.start) / STEPS)

    model.fit(data, epochs=4, verbose=0, callbacks=[Timer()])
    return {"step_ms": 1000 * statistics.median(times[1:]), "params": model.count_params(),
            "replicas": model.distribute_strategy.num_replicas_in_sync}


def interleaved(where, rounds):
    """``{mode: [ms per round]}``: in this process (local) or each round a launch."""
    import statistics

    import keras

    modes = ("none", "mirrored", "keras") if where == "local" else ("keras", "mwms")
    got = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            if where == "local":
                got[mode].append(run(mode)["step_ms"])
                keras.distribution.set_distribution(None)
            else:
                got[mode].append(run_cluster(run, mode, timeout=400)[0]["step_ms"])
    return {m: round(statistics.median(v), 2) for m, v in got.items()}, got


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "local"
    if where == "local":
        tfdist.devices.use_logical_cpus(2)
    print(json.dumps(interleaved(where, int(sys.argv[2]) if len(sys.argv) > 2 else 3)))
