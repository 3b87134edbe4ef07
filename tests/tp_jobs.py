"""Tensor-parallel runs shared by tests/test_tensor_parallel.py, in process and launched:
a column/row Dense pair and an attention block split by heads."""

import contextlib
import os

import numpy as np

from helpers import layout_map

BATCH, FEATURES, HIDDEN, OUTPUTS, DIM = 8, 6, 16, 4, 8
PAIR = {"up/kernel": (None, "model"), "down/kernel": ("model", None)}
HEADS = {"mha/(query|key|value)/kernel": (None, "model", None),
         "mha/attention_output/kernel": ("model", None, None)}


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, FEATURES)).astype("float32"),
            rng.normal(size=(n, OUTPUTS)).astype("float32"))


def pair(norm=False, between=None, prefix=""):
    """The column/row Dense pair, its layers named ``prefix + "up"`` and ``"down"``."""
    import keras

    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(HIDDEN, activation=None if between else "relu",
                           name=prefix + "up")(inputs)
    if between:  # element-wise layers between the pair: the activation stays split
        for made in between():
            h = made(h)
    if norm:  # needs every feature: the column output is gathered first
        h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(inputs, keras.layers.Dense(OUTPUTS, name=prefix + "down")(h))


def attention_block():
    """A transformer block: attention split by heads, then a column/row feed-forward."""
    import keras

    inputs = keras.Input((4, DIM))
    h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=3, name="mha")(
        inputs, inputs, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="norm")(h + inputs)
    h = keras.layers.Dense(16, activation="relu", name="up")(h)
    h = keras.layers.Dense(DIM, name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(h)))


HEAD = {"head_up/kernel": (None, "model"), "head_down/kernel": ("model", None)}


def hybrid_cnn():
    """The seeds' hybrid: convolutions data-parallel, a wide fully-connected head split."""
    import keras

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", name="conv1")(inputs)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv2")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(64, activation="relu", name="head_up")(h)
    h = keras.layers.Dense(32, activation="relu", name="head_down")(h)
    return keras.Model(inputs, keras.layers.Dense(OUTPUTS, name="logits")(h))


def image_data(n=32):
    rng = np.random.default_rng(2)
    return (rng.normal(size=(n, 8, 8, 1)).astype("float32"),
            rng.normal(size=(n, OUTPUTS)).astype("float32"))


def train(strategy, build, epochs=2, optimizer="adam", x=None, y=None, seed=1, loss="mse"):
    """Trains ``build()`` from weights seeded ``seed`` with the global batch ``BATCH``
    (under ``strategy``'s scope unless None) with ``optimizer`` ("adam", "sgd" or a
    function making one); returns ``(weights, model)``."""
    import keras

    keras.utils.set_random_seed(seed)
    initial = build().get_weights()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        for variable, value in zip(model.weights, initial):
            variable.assign(value)  # a split variable takes its slice
        # SGD for attention: the key bias's true gradient is zero (a softmax ignores a
        # shift), and Adam would blow its rounding noise up to learning-rate steps.
        if callable(optimizer):
            optimizer = optimizer()
        elif optimizer == "adam":
            optimizer = keras.optimizers.Adam(0.01)
        else:
            optimizer = keras.optimizers.SGD(0.1)
        model.compile(optimizer, loss)
    if x is None:
        x, y = data()
    # x alone: a dataset of its own batches.
    model.fit(x, y, batch_size=None if y is None else BATCH, epochs=epochs, shuffle=False,
              verbose=0)
    return [np.asarray(w) for w in model.get_weights()], model


def keras_facts(model) -> dict:
    """What Keras reports of ``model``'s variables, as a plain model would report them:
    ``count_params()``, ``summary()``'s total, every model and optimizer variable's
    shape (in their order), and whether ``set_weights(get_weights())`` gives the same weights back."""
    import re

    lines = []
    model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))  # rich's colours
    total = int(re.search(r"Total params: ([\d,]+)", text).group(1).replace(",", ""))
    weights = [np.asarray(w) for w in model.get_weights()]
    model.set_weights(weights)
    slots = model.optimizer.variables if model.optimizer is not None else []
    return {"count_params": model.count_params(), "summary_total": total,
            "shapes": [tuple(v.shape) for v in model.weights],
            "slot_shapes": [tuple(v.shape) for v in slots],
            "round_trip": all(np.array_equal(a, b)
                              for a, b in zip(weights, model.get_weights()))}


def train_and_report(strategy, build, held, optimizer="adam", save=None, epochs=2) -> dict:
    """``build``'s model trained under ``strategy`` (None: one device): its weights,
    predict and evaluate, and with a strategy what each replica holds (``held(model)``)
    and the bytes fit sent; saved to ``save`` if given."""
    before = strategy.bytes_communicated if strategy is not None else 0
    weights, model = train(strategy, build, epochs=epochs, optimizer=optimizer)
    out = {"weights": weights}
    if strategy is not None:
        out["bytes"] = strategy.bytes_communicated - before  # fit's
        out["held"] = held(model)
    x, y = data()
    out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    out["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    if save:
        model.save(save)
    return out


def keras_mesh_run(layouts, build, held, **train_options) -> dict:
    """``build``'s model under keras.distribution.ModelParallel on DeviceMesh((2, 2))
    with ``layouts``: weights, the strategy it ran under and what each replica holds."""
    import keras

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(layouts.items(), shape=(2, 2))))
    try:
        weights, model = train(None, build, **train_options)
        strategy = model.distribute_strategy
        return {"weights": weights, "strategy": type(strategy).__name__,
                "model_parallel": strategy.tensor_parallel.model_parallel,
                "held": held(model)}
    finally:
        keras.distribution.set_distribution(None)


def attention_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(32, 4, DIM)).astype("float32"),
            rng.normal(size=(32, 2)).astype("float32"))


def launched_task(engine):
    """On each of 2 workers (one replica each, the "model" axis across them): the pair,
    the attention block and the hybrid CNN; what each holds; the bytes; and (chief) the
    references."""
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    strategy = tfdist.MultiWorkerModelParallelStrategy(layout_map={**PAIR, **HEADS, **HEAD},
                                                       engine=engine)
    out = {"chief": strategy.is_chief, "replicas": strategy.num_replicas_in_sync}
    weights, trained = train(strategy, pair)
    split = [v for v in trained.weights if split_of(v) is not None]
    out["pair"] = weights
    out["held"] = sum(int(np.prod(tf_value(v).values[0].shape)) for v in split)
    out["whole"] = sum(int(np.prod(split_of(v).full_shape)) for v in split)
    out["bytes"] = strategy.bytes_communicated
    x, y = attention_data()
    out["attention"] = train(strategy, attention_block, optimizer="sgd", x=x, y=y)[0]
    images, labels = image_data()
    out["hybrid"], hybrid = train(strategy, hybrid_cnn, x=images, y=labels)
    path = os.path.join(os.environ["TFDIST_TEST_DIR"], f"hybrid_{strategy.rank}.keras")
    hybrid.save(path)  # every worker: gathering the slices is a collective
    out["saved"] = path
    if strategy.is_chief:
        out["reference"] = {"pair": train(None, pair)[0],
                            "attention": train(None, attention_block, optimizer="sgd",
                                               x=x, y=y)[0],
                            "hybrid": train(None, hybrid_cnn, x=images, y=labels)[0]}
    return out


def keras_pair(layouts, shape=None):
    """Backend-agnostic Keras in a launched task: ModelParallel laid out by ``layouts``
    over a mesh of every worker's devices (``shape``, by default ``(1, all)``), the pair
    trained on a tf.data dataset of global batches. Returns ``(weights, strategy)``:
    the weights and the tfdist strategy Keras' distribution made."""
    import keras
    import tensorflow as tf

    keras.distribution.initialize()
    shape = shape or (1, len(keras.distribution.list_devices()))
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(layouts.items(), shape=shape)))
    try:
        x, y = data()
        weights, model = train(None, pair,
                               x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    finally:
        keras.distribution.set_distribution(None)
    return weights, model.distribute_strategy


def keras_launched_task():
    """On each of 2 workers: `keras_pair` split over a (1, 2) mesh of every device."""
    import keras

    weights, strategy = keras_pair(PAIR)
    return {"strategy": type(strategy).__name__, "weights": weights,
            "devices": keras.distribution.list_devices(),
            "bytes": strategy.bytes_communicated}


def gathered_as_by_workers(strategy, model):
    """``{path: (whole, whole as several workers take it)}`` for each split variable of
    ``model``: the one worker's local assembly of its replicas' pieces, and the same
    pieces through the strategy's gather (`tfdist.comm.communicator.gather_numpy`),
    which a job of several workers takes (``num_workers`` set to 2 meanwhile)."""
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    split = [v for v in model.weights if split_of(v) is not None]
    local = [split_of(v).full_numpy(tf_value(v)) for v in split]
    strategy.num_workers = 2  # shadows the class's 1: full_numpy gathers
    try:
        gathered = [split_of(v).full_numpy(tf_value(v)) for v in split]
    finally:
        del strategy.num_workers
    return {v.path: pair for v, pair in zip(split, zip(local, gathered))}


# Issue 39's wide pair (tests/test_tensor_parallel_mesh.py): Input(64) -> Dense(2048, relu) column -> Dense(64, tanh) row ->
# Dense(1), named to match PAIR. In float64: in float32 its Adam run is not reproducible at
# 1e-5 even on one device (initial weights moved by one ulp end 2.4e-3 apart: a ReLU
# pre-activation within rounding of zero flips, docs/tensor_parallel.md).
WIDE_STEPS, WIDE_BATCH = 20, 64


def wide():
    import keras

    inputs = keras.Input((64,), dtype="float64")
    h = keras.layers.Dense(2048, activation="relu", name="up", dtype="float64")(inputs)
    h = keras.layers.Dense(64, activation="tanh", name="down", dtype="float64")(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float64")(h))


def train_wide(strategy) -> dict:
    """The wide pair trained 20 steps of 64 rows (MSE) with Adam(1e-3) and with
    AdamW(1e-3) under ``strategy`` (None: one device): ``{"adam": weights, "adamw":
    weights}``."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(WIDE_STEPS * WIDE_BATCH, 64))
    y = rng.normal(size=(WIDE_STEPS * WIDE_BATCH, 1))
    out = {}
    for name, make in (("adam", keras.optimizers.Adam), ("adamw", keras.optimizers.AdamW)):
        keras.utils.set_random_seed(1)
        initial = wide().get_weights()
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = wide()
            for variable, value in zip(model.weights, initial):
                variable.assign(value)
            model.compile(make(1e-3), "mse")
        model.fit(x, y, batch_size=WIDE_BATCH, epochs=1, shuffle=False, verbose=0)
        out[name] = [np.asarray(w) for w in model.get_weights()]
    return out
