"""The models, data and per-worker task of `benchmarks.tensor_parallel`.

Two workloads, each trained in the same worker processes under one strategy:

- the seeds' hybrid CNN on scikit-learn's digits (8x8 images, a real small image set
  that ships with scikit-learn): two convolutions, then a fully-connected head
  ``head_up`` (column-parallel) and ``head_down`` (row-parallel, at least 4096 x 4096),
  then a replicated ``logits`` layer;
- a transformer block: a replicated input projection ``embed`` (so that the block's
  input needs a gradient, as after an embedding), MultiHeadAttention ``mha`` split by
  heads, a feed-forward pair ``ffn_up`` / ``ffn_down``, two LayerNormalizations.
"""

from __future__ import annotations

import statistics
import time

HEAD = {"head_up/kernel": (None, "model"), "head_down/kernel": ("model", None)}
BLOCK = {"mha/(query|key|value)/kernel": (None, "model", None),
         "mha/attention_output/kernel": ("model", None, None),
         "ffn_up/kernel": (None, "model"), "ffn_down/kernel": ("model", None)}
BLOCK_SPLIT_LAYERS = ("mha", "ffn_up", "ffn_down")
TRAIN_ROWS = 1536  # of the 1797 digits; the other 261 are the test set


def digits_split():
    """``(x, y), (x_test, y_test)``: the digits, shuffled once (seed 0), 1536 / 261."""
    import numpy as np

    from benchmarks.common import digits_data

    x, y = digits_data()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:TRAIN_ROWS], y[:TRAIN_ROWS]), (x[TRAIN_ROWS:], y[TRAIN_ROWS:])


def hybrid_cnn(width: int):
    """Convolutions (data-parallel), then ``head_up`` 512 -> width and ``head_down``
    width -> width (the split head), then 10 logits."""
    import keras

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inputs)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(h)
    h = keras.layers.Flatten(name="flat")(h)  # 4 x 4 x 32 = 512
    h = keras.layers.Dense(width, activation="relu", name="head_up")(h)
    h = keras.layers.Dense(width, activation="relu", name="head_down")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))


def transformer_block(seq: int, width: int, heads: int):
    """``embed`` (replicated), attention by heads, a feed-forward pair of 4 x width."""
    import keras

    inputs = keras.Input((seq, width))
    h = keras.layers.Dense(width, name="embed")(inputs)
    a = keras.layers.MultiHeadAttention(heads, width // heads, name="mha")(
        h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="norm1")(h + a)
    f = keras.layers.Dense(4 * width, activation="relu", name="ffn_up")(h)
    f = keras.layers.Dense(width, name="ffn_down")(f)
    return keras.Model(inputs, keras.layers.LayerNormalization(name="norm2")(h + f))


def block_data(rows: int, seq: int, width: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, seq, width)).astype("float32"),
            rng.normal(size=(rows, seq, width)).astype("float32"))


def _seeded_copy(strategy, build):
    """``build()`` in ``strategy``'s scope holding the weights seed 0 gives one process."""
    import keras

    keras.utils.set_random_seed(0)
    initial = build().get_weights()
    with strategy.scope():
        model = build()
        for variable, value in zip(model.weights, initial):
            variable.assign(value)  # a split variable takes its slice
    return model


def local_elements(variable) -> int:
    """Elements of ``variable`` this worker holds: its slice when split."""
    import math

    from tfdist._hooks.tensor_parallel import split_of, tf_value

    if split_of(variable) is None:
        return math.prod(variable.shape)
    return math.prod(tf_value(variable).values[0].shape)


class _StepTimes:
    def __new__(cls, times: list):
        import keras

        class StepTimes(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.t0)

        return StepTimes()


def _hybrid(strategy, config) -> dict:
    import keras

    (x, y), (x_test, y_test) = digits_split()
    x, y = x[:config["train_rows"]], y[:config["train_rows"]]
    width, batch = config["head_width"], config["cnn_batch"]
    model = _seeded_copy(strategy, lambda: hybrid_cnn(width))
    with strategy.scope():
        model.compile(keras.optimizers.SGD(config["learning_rate"], momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain = hybrid_cnn(width)  # this process's plain copy: test accuracy after each epoch
    plain.compile(metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accuracy, times = [], []

    class Test(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            plain.set_weights(model.get_weights())  # every worker: a split read gathers
            accuracy.append(float(plain.evaluate(x_test, y_test, verbose=0)[1]))

    before = strategy.bytes_communicated
    model.fit(x, y, batch_size=batch, epochs=config["epochs"], shuffle=False, verbose=0,
              callbacks=[_StepTimes(times), Test()])
    steps = config["epochs"] * (len(x) // batch)
    head = [v for v in model.weights if v.path.split("/")[0] in ("head_up", "head_down")]
    split = [v for v in head if _is_split(v)]
    return {"bytes_per_step": (strategy.bytes_communicated - before) / steps,
            "test_accuracy": accuracy, "step_seconds": statistics.median(times[1:] or times),
            "split_elements_held": sum(local_elements(v) for v in split),
            "split_elements_whole": sum(_whole(v) for v in split),
            "head_elements_held": sum(local_elements(v) for v in head),
            "head_elements_whole": sum(_whole(v) for v in head),
            "split_variables": sorted(v.path for v in split),
            "replicated_elements": sum(_whole(v) for v in model.trainable_weights
                                       if not _is_split(v)),
            "parameters": sum(_whole(v) for v in model.weights)}


def _whole(variable) -> int:
    import math

    from tfdist._hooks.tensor_parallel import split_of

    found = split_of(variable)
    return math.prod(found.full_shape if found is not None else variable.shape)


def _block(strategy, config) -> dict:
    import keras

    seq, width, heads, batch = (config["seq"], config["width"], config["heads"],
                                config["block_batch"])
    x, y = block_data(batch * max(config["warmup"], config["steps"]), seq, width)
    model = _seeded_copy(strategy, lambda: transformer_block(seq, width, heads))
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.01), "mse")
    if config["warmup"]:  # tracing and first steps, not timed (none in --quick)
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=config["warmup"],
                  shuffle=False, verbose=0)
    times = []
    before = strategy.bytes_communicated
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=config["steps"],
              shuffle=False, verbose=0, callbacks=[_StepTimes(times)])
    layers = [v for v in model.weights if v.path.split("/")[0] in BLOCK_SPLIT_LAYERS]
    return {"bytes_per_step": (strategy.bytes_communicated - before) / config["steps"],
            "step_seconds": statistics.median(times),
            "split_layer_bytes_held": 4 * sum(local_elements(v) for v in layers),
            "split_layer_bytes_whole": 4 * sum(_whole(v) for v in layers),
            "replicated_elements": sum(_whole(v) for v in model.trainable_weights
                                       if not _is_split(v))}


def _is_split(variable) -> bool:
    from tfdist._hooks.tensor_parallel import split_of

    return split_of(variable) is not None


def worker_task(mode: str, engine: str, config: dict) -> dict:
    """On every worker: the hybrid CNN, then the transformer block, under
    ``MultiWorkerModelParallelStrategy`` (``mode="split"``) or
    ``MultiWorkerMirroredStrategy`` (``mode="replicated"``) on the same workers."""
    import tfdist

    if mode == "split":
        strategy = tfdist.MultiWorkerModelParallelStrategy(layout_map={**HEAD, **BLOCK},
                                                           engine=engine)
    else:
        strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine)
    return {"rank": strategy.rank, "workers": strategy.num_replicas_in_sync,
            "hybrid": _hybrid(strategy, config),
            "block": _block(strategy, config)}
