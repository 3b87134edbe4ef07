"""What a split layer reads from the layer itself (issue 39), on 2 logical CPUs against
one device (same initial weights and global batch, weights at atol 1e-5, Adam and SGD),
through tfdist.ModelParallelStrategy and keras.distribution.ModelParallel on a (1, 2)
mesh: a column layer's activation that is not element-wise (softmax, log_softmax, a
callable; an Activation(callable) between a column and a row layer) sees every feature,
and so does an activity regularizer; an EinsumDense whose kernel's first axis is an
output letter is column-parallel (tp_mesh_jobs.py trains it on the 2 x 2 mesh); a split
Embedding takes negative ids and raises on an id out of range as one device does; a
regularizer or constraint on a split variable is refused by name."""

import functools
import re

import numpy as np
import pytest

from helpers import assert_weights_close

from tp_jobs import train
from tp_layer_jobs import (ACTIVATIONS, activations_data, activations_model, keras_run,
                           optimizer_for, run_einsum_heads)


def _activations(strategy, optimizer):
    x, y = activations_data()
    return train(strategy, activations_model, optimizer=lambda: optimizer_for(optimizer),
                 x=x, y=y, loss="categorical_crossentropy")


@functools.lru_cache(maxsize=None)
def _one_device(optimizer):
    return _activations(None, optimizer)[0]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_activations_needing_every_feature_see_them_all(logical_cpus, optimizer):
    import tfdist

    got, model = _activations(tfdist.ModelParallelStrategy(layout_map=ACTIVATIONS), optimizer)
    assert_weights_close(got, _one_device(optimizer), atol=1e-5)
    x, _ = activations_data()
    # The split softmax head's rows sum to 1, as one device's (2.0 when each replica
    # normalised its own columns).
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0).sum(-1), 1.0,
                               atol=1e-5)


def test_keras_model_parallel_applies_them_on_every_feature(logical_cpus):
    import tfdist

    x, y = activations_data()
    got, strategy = keras_run(ACTIVATIONS, (1, 2), activations_model, x=x, y=y,
                              loss="categorical_crossentropy")
    assert isinstance(strategy, tfdist.ModelParallelStrategy)
    assert_weights_close(got, _one_device("adam"), atol=1e-5)


def test_einsum_dense_split_on_an_output_letter_is_split_by_heads(logical_cpus):
    """keras-hub Gemma's query/key/value: "btd,ndh->btnh" laid out ("model", None, None)
    (n, the heads, is an output letter: column-parallel, its bias "nh" split alike)."""
    import tfdist

    from tp_layer_jobs import EINSUM_HEADS

    runs = run_einsum_heads(lambda: tfdist.ModelParallelStrategy(layout_map=EINSUM_HEADS),
                            keras_shape=(1, 2))
    for name in ("adam", "sgd", "keras"):
        assert_weights_close(runs[name][0], runs[name][1], atol=1e-5)
    assert runs["keras"][2] == "ModelParallelStrategy"
    assert runs["split"] == ["attention_output/kernel", "query/bias", "query/kernel"]


def _lookup(strategy, ids=None):
    """A vocabulary of 16 looked up (the same initial weights) under ``strategy`` (None:
    one device); with ``ids``, the error of fitting on them: ``(class, what it names)``."""
    import contextlib

    import keras

    def build():
        inputs = keras.Input((3,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(16, 4, name="table")(inputs))
        return keras.Model(inputs, keras.layers.Dense(1, name="out")(h))

    keras.utils.set_random_seed(0)
    initial = build().get_weights()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        for variable, value in zip(model.weights, initial):
            variable.assign(value)  # a split variable takes its slice
        model.compile("sgd", "mse")
    if ids is None:
        return model
    with pytest.raises(Exception) as raised:
        model.fit(ids, np.zeros((len(ids), 1), "float32"), batch_size=8, shuffle=False,
                  verbose=0)
    found = re.search(r"indices\[\d+,\d+\] = -?\d+ is not in \[0, 16\)", str(raised.value))
    return type(raised.value), found.group(0) if found else str(raised.value)[:300]


@pytest.mark.parametrize("bad, named", [(17, 17), (-20, -4)])  # Keras adds 16 to an id < 0
def test_vocab_parallel_lookup_of_an_id_out_of_range_raises_as_one_device(logical_cpus, bad,
                                                                          named):
    import tensorflow as tf

    import tfdist

    ids = np.arange(24, dtype="int32").reshape(8, 3) % 16
    ids[5, 1] = bad  # a row of replica 1
    expected = _lookup(None, ids)
    assert expected == (tf.errors.InvalidArgumentError,
                        f"indices[5,1] = {named} is not in [0, 16)")
    got = _lookup(tfdist.ModelParallelStrategy(
        layout_map={"table/embeddings": ("model", None)}), ids)
    assert got == expected


@pytest.mark.parametrize("layout", [("model", None), (None, "model")],
                         ids=["vocab", "features"])
def test_split_lookup_of_a_negative_id_counts_from_the_end_as_one_device(logical_cpus,
                                                                         layout):
    import tfdist

    ids = np.arange(24, dtype="int32").reshape(8, 3) % 16
    ids[1, 0], ids[6, 2] = -1, -16
    want = _lookup(None).predict(ids, batch_size=8, verbose=0)
    got = _lookup(tfdist.ModelParallelStrategy(layout_map={"table/embeddings": layout}))
    np.testing.assert_allclose(got.predict(ids, batch_size=8, verbose=0), want, atol=1e-6)


@pytest.mark.parametrize("options, named", [
    ({"kernel_regularizer": "l2"}, r"'up/kernel' regularizer=L2\(l2=0\.01\)"),
    ({"kernel_constraint": "non_neg"}, r"'up/kernel' constraint=NonNeg\(\)"),
    ({"bias_constraint": "max_norm"}, r"'up/bias' constraint=MaxNorm\(max_value=2"),
], ids=["regularizer", "constraint", "bias-constraint"])
def test_a_regularizer_or_constraint_on_a_split_variable_is_named(logical_cpus, options,
                                                                   named):
    import keras

    import tfdist

    with tfdist.ModelParallelStrategy(layout_map={"up/kernel": (None, "model")}).scope():
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, name="up", **options)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
        model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"does not apply a (regularizer|constraint) to a "
                                         r"split variable.*Received: layer 'up' with " + named):
        model.fit(np.zeros((8, 6), "float32"), np.zeros((8, 1), "float32"), verbose=0)
