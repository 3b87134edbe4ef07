"""Variables laid out over "batch" alone on a d x m data x model mesh, in one process of
4 logical CPUs (tests/test_tensor_parallel_batch_axis.py runs it: a pytest process has
2): a Dense stack whose outer layers are laid out ``("batch", None)`` / ``("batch",)``
around a column/row pair over "model", on 2 x 1 and 2 x 2 meshes, against one device;
and the ("batch", "model") pair of tests/tp_fsdp_jobs.py under mixed precision."""

import os
import pickle
import sys

import numpy as np

from tp_jobs import BATCH, FEATURES, OUTPUTS, data, train

WIDE, MIDDLE = 16, 8  # layer "a": FEATURES -> WIDE; the pair WIDE -> WIDE -> MIDDLE
STACK = {"a/kernel": ("batch", None), "a/bias": ("batch",),
         "up/kernel": (None, "model"), "down/kernel": ("model", None),
         "b/kernel": ("batch", None), "b/bias": ("batch",)}
BATCH_ONLY = ("a/kernel", "a/bias", "b/kernel", "b/bias")
STEPS = 2 * (32 // BATCH)  # two epochs of 32 rows


def stack():
    """Dense a (over "batch"), the column/row pair up/down (over "model"), Dense b."""
    import keras

    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(WIDE, activation="relu", name="a")(inputs)
    h = keras.layers.Dense(WIDE, activation="relu", name="up")(h)
    h = keras.layers.Dense(MIDDLE, activation="relu", name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(OUTPUTS, name="b")(h))


def held(model) -> dict:
    """Per split variable (and optimizer slot, as ``slot/<name>``): the elements each
    local replica stores, and the whole variable's."""
    from tp_fsdp_jobs import held as tp_held

    return tp_held(model)


def run(strategy, save=None):
    """The stack trained under ``strategy`` (None: one device) with Adam."""
    before = strategy.bytes_communicated if strategy is not None else 0
    weights, model = train(strategy, stack)
    out = {"weights": weights}
    if strategy is not None:
        out["bytes"] = strategy.bytes_communicated - before
        out["held"] = held(model)
    x, y = data()
    out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    out["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    if save:
        model.save(save)
    return out


def keras_mesh():
    """The stack under keras.distribution.ModelParallel on DeviceMesh((2, 2))."""
    import keras

    from helpers import layout_map

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(STACK.items(), shape=(2, 2))))
    try:
        weights, model = train(None, stack)
        strategy = model.distribute_strategy
        return {"weights": weights, "strategy": type(strategy).__name__,
                "model_parallel": strategy.tensor_parallel.model_parallel,
                "held": held(model)}
    finally:
        keras.distribution.set_distribution(None)


def main(out_path, directory):
    import tfdist

    tfdist.devices.use_logical_cpus(4)

    def mesh(d, m):
        devices = [f"/cpu:{i}" for i in range(d * m)]
        return tfdist.ModelParallelStrategy(layout_map=STACK, devices=devices,
                                            model_parallel=m)

    saved = os.path.join(directory, "stack.keras")
    results = {"2x1": run(mesh(2, 1)), "2x2": run(mesh(2, 2), save=saved),
               "reference": run(None), "keras": keras_mesh(), "saved": saved}
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
