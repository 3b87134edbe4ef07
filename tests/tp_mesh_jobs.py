"""Tensor parallelism on a 2 x 2 data x model mesh (tests/test_tensor_parallel_mesh.py):
one process of 4 logical CPUs (`main`, run as a script) and 4 workers under tfdist
launch (`launched_task`). Each trains the same models as the references of
`tp_jobs.train`: a column/row Dense pair, an attention block split by heads with a
feed-forward pair, a vocab-parallel embedding with a split (untied) head, and the
hybrid CNN. `shapes` (in `main` too): a column layer's gathered output feeding every
kind of layer that needs all its features, and partial last batches."""

import contextlib
import os
import pickle
import sys

import numpy as np

from tp_fsdp_jobs import LAUNCHED
from tp_jobs import (BATCH, FEATURES, HEAD, HEADS, OUTPUTS, PAIR, attention_block,
                     attention_data, data, hybrid_cnn, image_data, keras_facts,
                     keras_mesh_run, keras_pair, pair, train, train_wide)

VOCAB_SIZE, TOKENS, WIDTH = 16, 3, 8
EMBEDDED = {"table/embeddings": ("model", None), "head/kernel": (None, "model")}
TIED = {"tied/embeddings": ("model", None)}
LAYOUTS = {**PAIR, **HEADS, **HEAD, **EMBEDDED, **TIED, **LAUNCHED}


def embedded():
    """A vocab-parallel embedding with an untied head split on its outputs (the vocab)."""
    import keras

    inputs = keras.Input((TOKENS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB_SIZE, WIDTH, name="table")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    return keras.Model(inputs, keras.layers.Dense(VOCAB_SIZE, name="head")(h))


def tied():
    """A vocab-parallel ReversibleEmbedding whose reverse call is the head (tied)."""
    import keras

    inputs = keras.Input((TOKENS,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(VOCAB_SIZE, WIDTH, name="tied")
    h = keras.layers.Flatten(name="flat")(table(inputs))
    h = keras.layers.Dense(WIDTH, name="mix")(h)
    return keras.Model(inputs, table(h, reverse=True))


def token_data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, VOCAB_SIZE, size=(32, TOKENS)).astype("int32"),
            rng.normal(size=(32, VOCAB_SIZE)).astype("float32"))


def held(model):
    """``(elements this process's first replica holds, whole elements)`` of the split
    variables."""
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    split = [v for v in model.weights if split_of(v) is not None]
    return (sum(int(np.prod(tf_value(v).values[0].shape)) for v in split),
            sum(int(np.prod(split_of(v).full_shape)) for v in split))


def run_all(strategy_for):
    """Each model trained with ``strategy_for()`` (a fresh strategy, or None for one
    device): ``{name: {"weights", "held", "bytes", "model"}}``."""
    cases = {"pair": (pair, "adam", None), "attention": (attention_block, "sgd",
                                                         attention_data()),
             "embedded": (embedded, "adam", token_data()),
             "tied": (tied, "adam", token_data()),
             "hybrid": (hybrid_cnn, "adam", image_data())}
    out = {}
    for name, (build, optimizer, xy) in cases.items():
        strategy = strategy_for()
        before = strategy.bytes_communicated if strategy else 0
        x, y = xy if xy is not None else (None, None)
        weights, model = train(strategy, build, optimizer=optimizer, x=x, y=y)
        out[name] = {"weights": weights, "model": model,
                     "bytes": strategy.bytes_communicated - before if strategy else 0,
                     "held": held(model) if strategy else None}
        out[name]["facts"] = keras_facts(model)  # after the bytes: get_weights gathers
        if x is None:
            from tp_jobs import data

            x, y = data()
        out[name]["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
        out[name]["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    return out


def _plain(results):
    return {name: {k: v for k, v in r.items() if k != "model"} for name, r in results.items()}


def keras_mesh():
    """The pair under keras.distribution.ModelParallel on DeviceMesh((2, 2))."""
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in PAIR.items():
        layout_map[key] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    try:
        keras.utils.set_random_seed(1)
        initial = pair().get_weights()
        model = pair()
        strategy = model.distribute_strategy
        for variable, value in zip(model.weights, initial):
            variable.assign(value)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        from tp_jobs import data

        x, y = data()
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return {"weights": [np.asarray(w) for w in model.get_weights()],
                "facts": keras_facts(model), "strategy": type(strategy).__name__,
                "model_parallel": strategy.tensor_parallel.model_parallel}
    finally:
        keras.distribution.set_distribution(None)


def clipped(strategy_for):
    """The pair trained with SGD clipped by ``global_clipnorm`` and by ``clipnorm`` on
    ``strategy_for()`` and on one device, and unclipped on one device."""
    import keras

    out = {"unclipped": train(None, pair, optimizer=lambda: keras.optimizers.SGD(0.1))[0]}
    for clip in ("global_clipnorm", "clipnorm"):
        def sgd():
            return keras.optimizers.SGD(0.1, **{clip: 0.05})

        out[clip] = {"mesh": train(strategy_for(), pair, optimizer=sgd)[0],
                     "reference": train(None, pair, optimizer=sgd)[0]}
    return out


def continue_from(path, strategy):
    """The hybrid CNN saved at ``path``, loaded in ``strategy``'s scope (None: plain),
    its loaded weights, and its weights after one more epoch on new data."""
    import keras

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.saving.load_model(path)
    loaded = [np.asarray(w) for w in model.get_weights()]
    x, y = image_data()
    model.fit(x[::-1].copy(), y[::-1].copy(), batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    return {"loaded": loaded, "after": [np.asarray(w) for w in model.get_weights()]}


SHAPES_ROWS = 36  # 4 full batches of 8 and a last one of 4: one row per replica
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


def shapes() -> dict:
    """`consumers` trained with Adam and SGD on 36 rows in batches of 8 (the last batch
    4 rows, one per replica), and the column/row pair under keras.distribution's
    ModelParallel on DeviceMesh((2, 2)) on the same rows; each with its one-device
    reference."""
    import tfdist

    def run(strategy, optimizer):
        weights, model = train(strategy, consumers, optimizer=optimizer, x=x, y=y)
        return {"weights": weights, "predict": model.predict(x, batch_size=BATCH, verbose=0)}

    x, y = data(SHAPES_ROWS)
    results = {optimizer: {
        "mesh": run(tfdist.ModelParallelStrategy(layout_map=CONSUMERS, model_parallel=2),
                    optimizer),
        "reference": run(None, optimizer)} for optimizer in ("adam", "sgd")}
    keras_run = keras_mesh_run(PAIR, pair, lambda model: None, x=x, y=y)
    results["keras"] = {"weights": keras_run["weights"], "strategy": keras_run["strategy"],
                        "model_parallel": keras_run["model_parallel"],
                        "reference": train(None, pair, x=x, y=y)[0]}
    return results


def main(out_path, saved=None):
    """In one process of 4 logical CPUs: every model on the 2 x 2 mesh and on one device;
    the pair with fp16 compression; Keras' ModelParallel on DeviceMesh((2, 2)); the pair
    clipped by norm; an EinsumDense split by heads on its kernel's first axis
    (`tp_layer_jobs.run_einsum_heads`); `shapes`; and
    (``saved``) a 2 x 2 save loaded on a 1 x 4 mesh and continued (``"-"``: its path is
    read from stdin, after the rest)."""
    import tfdist

    tfdist.devices.use_logical_cpus(4)
    results = {"mesh": _plain(run_all(lambda: tfdist.ModelParallelStrategy(
                   layout_map=LAYOUTS, model_parallel=2))),
               "reference": _plain(run_all(lambda: None))}
    fp16 = tfdist.ModelParallelStrategy(layout_map=PAIR, model_parallel=2, compression="fp16")
    results["fp16"] = {"weights": train(fp16, pair)[0], "bytes": fp16.bytes_communicated}
    results["keras"] = keras_mesh()
    results["wide"] = train_wide(None)  # the launch's wide pair's reference
    results["clipped"] = clipped(lambda: tfdist.ModelParallelStrategy(layout_map=PAIR,
                                                                      model_parallel=2))
    from tp_layer_jobs import EINSUM_HEADS, run_einsum_heads

    results["einsum_heads"] = run_einsum_heads(lambda: tfdist.ModelParallelStrategy(
        layout_map=EINSUM_HEADS, model_parallel=2), keras_shape=(2, 2))
    results["shapes"] = shapes()
    if saved == "-":
        saved = sys.stdin.readline().strip()
    if saved:
        results["one_by_four"] = continue_from(
            saved, tfdist.ModelParallelStrategy(layout_map=HEAD))
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


def launched_task():
    """On each of 4 workers (one replica each, a 2 x 2 mesh, engine "tf"): the pair under
    Keras' ModelParallel on DeviceMesh((2, 2)), then every model under its strategy;
    the hybrid CNN saved (every worker: gathering the slices is a collective)."""
    # One strategy per process (TF configures its collectives once): Keras'
    # ModelParallel on DeviceMesh((2, 2)) makes it, trains the pair on a dataset of
    # global batches, then every model trains under the same strategy.
    keras_weights, strategy = keras_pair(LAYOUTS, shape=(2, 2))
    keras_run = {"weights": keras_weights, "strategy": type(strategy).__name__,
                 "engine": strategy.engine,
                 "model_parallel": strategy.tensor_parallel.model_parallel}
    results = run_all(lambda: strategy)
    model = results["hybrid"]["model"]
    path = os.path.join(os.environ["TFDIST_TEST_DIR"], f"hybrid_{strategy.rank}.keras")
    model.save(path)
    from tp_fsdp_jobs import launched

    # The pair with kernels laid out ("batch", "model") / ("model", "batch").
    sharded = launched(strategy, os.environ["TFDIST_TEST_DIR"])
    return {"rank": strategy.rank, "replicas": strategy.num_replicas_in_sync,
            "saved": path, "keras": keras_run, "sharded": sharded,
            "wide": train_wide(strategy), **_plain(results)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
