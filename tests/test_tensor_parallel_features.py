"""What tensor parallelism keeps doing (issue #34, "everything else keeps working"):
clipping by norm over whole variables, attention masks with heads split, restarts
(``tfdist launch --max-restarts``) and several hosts, each compared with one device
holding the same initial weights and seeing the same global batch (atol 1e-5)."""

import contextlib

import numpy as np
import pytest

from helpers import assert_weights_close

from tp_jobs import BATCH, PAIR, data, pair


def _fit(strategy, build, optimizer, x, y, epochs=2, loss="mse"):
    """Trains ``build()`` from weights seeded 1; returns its weights."""
    import keras

    keras.utils.set_random_seed(1)
    initial = build().get_weights()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        for variable, value in zip(model.weights, initial):
            variable.assign(value)  # a split variable takes its slice
        model.compile(optimizer(), loss)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def _first_gradients(build, x, y):
    """One device: ``{path: gradient}`` of the first global batch at the initial weights."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    model = build()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:BATCH], model(x[:BATCH]))
    grads = tape.gradient(loss, model.trainable_variables)
    return {v.path: np.asarray(g) for v, g in zip(model.trainable_variables, grads)}


@pytest.mark.parametrize("clip", ["global_clipnorm", "clipnorm"])
def test_clipping_by_norm_sees_whole_variables(logical_cpus, clip):
    """SGD (Adam would undo most of a global scale): the split gradients' norms are
    those of whole variables, as on one device; a replica's slice alone is smaller."""
    import keras

    import tfdist

    x, y = data()
    grads = _first_gradients(pair, x, y)
    whole = float(np.sqrt(sum(np.sum(g ** 2) for g in grads.values())))
    if clip == "global_clipnorm":
        limit = whole / 4
        assert whole > limit
    else:
        limit = 0.3
        # The split kernels' whole norms bite; each replica's half alone would give
        # another factor (the up kernel's halves, the down kernel's rows).
        for path, axis in (("up/kernel", 1), ("down/kernel", 0)):
            halves = np.split(grads[path], 2, axis=axis)
            assert np.linalg.norm(grads[path]) > limit
            assert all(np.linalg.norm(h) < np.linalg.norm(grads[path]) for h in halves)

    def optimizer():
        return keras.optimizers.SGD(0.1, **{clip: limit})

    strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
    got = _fit(strategy, pair, optimizer, x, y)
    ref = _fit(None, pair, optimizer, x, y)
    unclipped = _fit(None, pair, lambda: keras.optimizers.SGD(0.1), x, y)
    assert_weights_close(got, ref, atol=1e-5)
    assert max(np.max(np.abs(a - b)) for a, b in zip(ref, unclipped)) > 1e-3  # it bit
