"""Split layers whose math tfdist must read from the layer (issue 39), shared by
tests/test_tensor_parallel.py (2 logical CPUs) and tp_mesh_jobs.py (a 2 x 2 mesh of 4):
activations that are not element-wise on column layers, and an EinsumDense split on its
kernel's first axis that is an output letter (keras-hub Gemma's query/key/value)."""

import numpy as np

TOKENS, WIDTH, HEADS_N, HEAD_DIM = 4, 8, 4, 3

# Column up (its own activation a callable) -> row down -> column up2 (relu) ->
# Activation(callable) -> row down2 -> column up3 (relu, an activity regularizer reads
# its output) -> row down3 -> column EinsumDense (log_softmax) -> column head (softmax).
ACTIVATIONS = {f"{name}/kernel": (None, "model") for name in ("up", "up2", "up3", "mix",
                                                               "head")}
ACTIVATIONS.update({f"{name}/kernel": ("model", None) for name in ("down", "down2",
                                                                    "down3")})
# "btd,ndh->btnh" split on n (its first kernel axis, an output letter: by heads), then
# "btnh,nhd->btd" split on n (contracted: row-parallel), as Gemma's layout map lays out
# its attention (with None where Gemma names "batch").
EINSUM_HEADS = {"query/kernel": ("model", None, None),
                "attention_output/kernel": ("model", None, None)}


def centered(h):
    """A callable activation that needs every feature."""
    import keras

    return h - keras.ops.mean(h, axis=-1, keepdims=True)


def scaled(h):
    """Another: each row scaled by its mean magnitude."""
    import keras

    return h / (1.0 + keras.ops.mean(keras.ops.abs(h), axis=-1, keepdims=True))


def activations_model():
    import keras

    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation=centered, name="up")(inputs)
    h = keras.layers.Dense(8, name="down")(h)
    h = keras.layers.Dense(16, activation="relu", name="up2")(h)
    h = keras.layers.Activation(scaled, name="scaled")(h)
    h = keras.layers.Dense(8, name="down2")(h)
    h = keras.layers.Dense(16, activation="relu", name="up3",
                           activity_regularizer=keras.regularizers.L2(0.1))(h)
    h = keras.layers.Dense(8, name="down3")(h)
    h = keras.layers.EinsumDense("ab,bc->ac", 8, bias_axes="c", activation="log_softmax",
                                 name="mix")(h)
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax", name="head")(h))


def activations_data(n=32):
    import keras

    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 6)).astype("float32"),
            keras.utils.to_categorical(np.arange(n) % 4, 4).astype("float32"))


def einsum_heads_model():
    import keras

    inputs = keras.Input((TOKENS, WIDTH))
    q = keras.layers.EinsumDense("btd,ndh->btnh", (TOKENS, HEADS_N, HEAD_DIM),
                                 bias_axes="nh", activation="tanh", name="query")(inputs)
    h = keras.layers.EinsumDense("btnh,nhd->btd", (TOKENS, WIDTH), bias_axes="d",
                                 name="attention_output")(q)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(h)))


def einsum_heads_data(n=32):
    rng = np.random.default_rng(4)
    return (rng.normal(size=(n, TOKENS, WIDTH)).astype("float32"),
            rng.normal(size=(n, 2)).astype("float32"))


def optimizer_for(name):
    import keras

    return keras.optimizers.Adam(0.01) if name == "adam" else keras.optimizers.SGD(0.1)


def run_einsum_heads(strategy_for, keras_shape=None):
    """The Gemma-like heads trained with Adam and SGD under ``strategy_for()`` and on one
    device, and with Adam under keras.distribution.ModelParallel on ``keras_shape``:
    ``{"adam": (split, reference), "sgd": ..., "keras": (split, reference)}`` weights."""
    from tp_jobs import train

    from tfdist._hooks.tensor_parallel import split_of

    x, y = einsum_heads_data()
    out = {}
    for name in ("adam", "sgd"):
        def make(name=name):
            return optimizer_for(name)

        got, model = train(strategy_for(), einsum_heads_model, optimizer=make, x=x, y=y)
        out[name] = (got, train(None, einsum_heads_model, optimizer=make, x=x, y=y)[0])
        out["split"] = sorted(v.path for v in model.weights if split_of(v) is not None)
    if keras_shape is not None:
        got, strategy = keras_run(EINSUM_HEADS, keras_shape, einsum_heads_model,
                                  optimizer=lambda: optimizer_for("adam"), x=x, y=y)
        out["keras"] = (got, out["adam"][1], type(strategy).__name__)
    return out


def keras_run(layouts, shape, build, **train_options):
    """``build``'s model trained under keras.distribution.ModelParallel laid out by
    ``layouts`` on a ``shape`` mesh of every device: ``(weights, its strategy)``."""
    import keras

    from helpers import layout_map
    from tp_jobs import train

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(layouts.items(), shape=shape)))
    try:
        weights, model = train(None, build, **train_options)
        return weights, model.distribute_strategy
    finally:
        keras.distribution.set_distribution(None)
