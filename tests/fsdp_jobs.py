"""Training runs shared by the shard_parameters tests (in process and launched): a model
with Embedding, MultiHeadAttention, Dense and Conv2D, every kernel sharded."""

import numpy as np

from zero_jobs import compile_and_fit, compiled, fitted
from zero_jobs import make_optimizer  # noqa: F401 (re-exported for the tests)

GLOBAL_BATCH = 16
MIN_ELEMENTS = 10  # every kernel and the embedding sharded; biases and norms whole


def data(n=64):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, (n, 6)).astype("int32")
    images = rng.normal(size=(n, 6, 6, 1)).astype("float32")
    return (tokens, images), (tokens[:, 0] % 2).astype("int32")


def model(seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    tokens, images = keras.Input((6,), dtype="int32"), keras.Input((6, 6, 1))
    h = keras.layers.Embedding(20, 8)(tokens)
    h = keras.layers.LayerNormalization()(
        h + keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h))
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8, activation="relu")(h))
    c = keras.layers.Flatten()(keras.layers.Conv2D(3, 3)(images))
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([h, c]))
    return keras.Model([tokens, images], out)


def train(strategy, optimizer, epochs=2, batch_size=GLOBAL_BATCH, **opt_kwargs):
    """Trains `model`; returns ``(weights, model)``."""
    return compile_and_fit(strategy, model, *data(), optimizer, epochs, batch_size,
                           **opt_kwargs)


def element_counts(model):
    """(per local replica: elements of sharded variables it holds, their whole elements)."""
    from tfdist._hooks.fsdp import shard_of
    from tfdist.strategies.fsdp.shards import sharded_elements

    variables = list(model.weights) + list(model.optimizer.variables)
    whole = sum(int(np.prod(v.shape)) for v in variables if shard_of(v) is not None)
    return sharded_elements(model), whole


def launched_task(engine):
    """On each of 2 workers: every optimizer sharded, the counts, and (chief) the
    one-process reference; then a save in the unsharded layout."""
    import os

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine, shard_parameters=True,
                                                  min_shard_elements=MIN_ELEMENTS)
    out = {"chief": strategy.is_chief, "replicas": strategy.num_replicas_in_sync}
    for name in ("adam", "adamw", "sgd"):
        weights, trained = train(strategy, name)
        counts, whole = element_counts(trained)
        out[name] = {"weights": weights, "counts": counts, "whole": whole}
    path = os.path.join(os.environ.get("TFDIST_TEST_DIR", "/tmp"),
                        f"fsdp_{engine}_{strategy.rank}.weights.h5")
    trained.save_weights(path)  # every worker: the gather is a collective
    out["saved"] = path
    if strategy.is_chief:
        out["reference"] = {name: train(None, name)[0] for name in ("adam", "adamw", "sgd")}
    return out


def save_and_resume(strategy, path, optimizer="adam"):
    """1 epoch, saved; a new model (other seed) loads it and trains 1 more epoch."""
    _, trained = train(strategy, optimizer, epochs=1)
    trained.save_weights(path)
    again = compiled(strategy, lambda: model(seed=7), optimizer, build_optimizer=True)
    return fitted(again, *data(), batch_size=GLOBAL_BATCH, load=path)


# Batches that split over 1, 2 and 3 workers.
RESUME_N, RESUME_BATCH = 48, 12


def resume(path, strategy=None):
    """A new model (other seed) loads ``path`` (SGD momentum) and trains 1 epoch of
    `RESUME_N` samples; its weights. Sharded under ``strategy``, or in a plain process."""
    again = compiled(strategy, lambda: model(seed=7), "sgd", build_optimizer=True)
    return fitted(again, *data(RESUME_N), batch_size=RESUME_BATCH, load=path)


def resume_task(path, engine):
    """On each worker of any number: `resume`, sharded."""
    import tfdist

    return resume(path, tfdist.MultiWorkerMirroredStrategy(
        engine=engine, shard_parameters=True, min_shard_elements=MIN_ELEMENTS))
