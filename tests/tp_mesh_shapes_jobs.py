"""A column layer's gathered output and a partial last batch on a 2 x 2 data x model
mesh, in one process of 4 logical CPUs (tests/test_tensor_parallel_mesh_shapes.py runs
it: a pytest process has 2): `consumers`, a model whose split column outputs feed
every kind of layer that needs all their features, trained with Adam and SGD on 36 rows
in batches of 8 (the last batch 4 rows, one per replica), and the column/row pair under
keras.distribution.ModelParallel on DeviceMesh((2, 2)) on the same rows; each against
one device."""

import pickle
import sys

from tp_jobs import BATCH, FEATURES, OUTPUTS, PAIR, data, keras_mesh_run, pair, train

ROWS = 36  # 4 full batches of 8 and a last one of 4: one row per replica
CONSUMERS = {f"{name}/kernel": (None, "model") for name in ("up", "mid", "twin")}
CONSUMERS["down/kernel"] = ("model", None)


def consumers():
    """Column ``up`` -> LayerNormalization -> Dropout -> Lambda -> Softmax -> column
    ``mid`` -> Activation("softmax") -> column ``twin`` twice (a shared layer) -> row
    ``down``; ``up``'s output also feeds a replicated Dense ``side`` (a second consumer).
    The dropout rate is tiny so that it keeps every feature: the run equals one device."""
    import keras

    inputs = keras.Input((FEATURES,))
    up = keras.layers.Dense(16, name="up")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(up)
    h = keras.layers.Dropout(1e-7, name="drop")(h)
    h = keras.layers.Lambda(lambda t: 2.0 * t, name="double")(h)
    h = keras.layers.Softmax(name="soft")(h)
    h = keras.layers.Dense(16, name="mid")(h)
    h = keras.layers.Activation("softmax", name="act")(h)
    twin = keras.layers.Dense(16, name="twin")
    h = twin(twin(h))
    out = keras.layers.Dense(OUTPUTS, name="down")(h)
    return keras.Model(inputs, out + keras.layers.Dense(OUTPUTS, name="side")(up))


def run(strategy, optimizer, x, y) -> dict:
    weights, model = train(strategy, consumers, optimizer=optimizer, x=x, y=y)
    return {"weights": weights, "predict": model.predict(x, batch_size=BATCH, verbose=0)}


def main(out_path, directory=None):
    import tfdist

    tfdist.devices.use_logical_cpus(4)
    x, y = data(ROWS)
    results = {}
    for optimizer in ("adam", "sgd"):
        results[optimizer] = {
            "mesh": run(tfdist.ModelParallelStrategy(layout_map=CONSUMERS, model_parallel=2),
                        optimizer, x, y),
            "reference": run(None, optimizer, x, y)}
    keras_run = keras_mesh_run(PAIR, pair, lambda model: None, x=x, y=y)
    results["keras"] = {"weights": keras_run["weights"], "strategy": keras_run["strategy"],
                        "model_parallel": keras_run["model_parallel"],
                        "reference": train(None, pair, x=x, y=y)[0]}
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
