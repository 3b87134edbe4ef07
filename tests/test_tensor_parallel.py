"""tfdist.ModelParallelStrategy (tensor parallelism) on 2 logical CPUs, the "model"
axis: a column/row Dense pair, and a column layer feeding a layer that needs every
feature, end equal to one device with the same initial weights and global batch; each
replica holds half of the split kernels; bytes_communicated counts every collective;
what it cannot split is refused in one error. Also a Keras ModelParallel on a (1, 2)
mesh, Embedding and MultiHeadAttention splits, saves, and 2 workers under tfdist
launch (MultiWorkerModelParallelStrategy)."""

import math

import numpy as np
import pytest

from helpers import assert_weights_close, layout_map

from tp_jobs import (BATCH, DIM, FEATURES, HEAD, HEADS, OUTPUTS, PAIR, attention_block,
                     attention_data, gathered_as_by_workers, hybrid_cnn, image_data)
from tp_jobs import data as _data
from tp_jobs import pair as _pair
from tp_jobs import train as _train


def test_column_row_pair_matches_one_device(logical_cpus):
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
    got, trained = _train(strategy, _pair)
    ref, _ = _train(None, _pair)
    assert_weights_close(got, ref, atol=1e-5)
    # Each replica holds half of each split kernel (and of the column layer's bias).
    split = {v.path: v for v in trained.weights if split_of(v) is not None}
    assert sorted(split) == ["down/kernel", "up/bias", "up/kernel"]
    for path, (local, gathered) in gathered_as_by_workers(strategy, trained).items():
        assert local.shape == split_of(split[path]).full_shape, path
        np.testing.assert_array_equal(gathered, local, err_msg=path)
    whole = sum(math.prod(split_of(v).full_shape) for v in split.values())
    for replica in range(2):
        held = sum(math.prod(tf_value(v).values[replica].shape) for v in split.values())
        assert held * 2 == whole
    # Per step, what one replica sends: its rows of x (all-gather into the column
    # layer), the row layer's partial sums (reduce-scatter), its rows' gradient of them
    # (all-gather), and the row layer's bias gradient (all-reduce). The input needs no
    # gradient, so its reduce-scatter does not run.
    rows = BATCH // 2
    per_step = 4 * (rows * FEATURES + BATCH * OUTPUTS + rows * OUTPUTS + OUTPUTS)
    assert strategy.bytes_communicated == per_step * 2 * (32 // BATCH)


def test_a_layer_needing_every_feature_gets_the_gathered_activation(logical_cpus):
    import keras

    import tfdist

    # Element-wise layers between the pair take the split activation: no gather, the
    # bytes of the bare pair.
    def between():
        return [keras.layers.Activation("gelu"), keras.layers.LeakyReLU(0.1)]

    strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
    got, _ = _train(strategy, lambda: _pair(between=between), epochs=1)
    ref, _ = _train(None, lambda: _pair(between=between), epochs=1)
    assert_weights_close(got, ref, atol=1e-5)
    rows = BATCH // 2
    per_step = 4 * (rows * FEATURES + BATCH * OUTPUTS + rows * OUTPUTS + OUTPUTS)
    assert strategy.bytes_communicated == per_step * (32 // BATCH)
    # A normalisation (or a softmax over the features) needs them all: gathered first.
    for build in (lambda: _pair(norm=True),
                  lambda: _pair(between=lambda: [keras.layers.Activation("softmax")])):
        strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
        got, _ = _train(strategy, build, epochs=1)
        ref, _ = _train(None, build, epochs=1)
        assert_weights_close(got, ref, atol=1e-5)
        assert strategy.bytes_communicated > per_step * (32 // BATCH)


def test_predict_and_evaluate_run_split(logical_cpus):
    import keras
    import tfdist

    strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
    _, trained = _train(strategy, _pair, epochs=1)
    x, y = _data()
    plain = _pair()
    plain.set_weights(trained.get_weights())
    plain.compile(keras.optimizers.Adam(0.01), "mse")
    np.testing.assert_allclose(trained.predict(x, batch_size=BATCH, verbose=0),
                               plain.predict(x, batch_size=BATCH, verbose=0), atol=1e-5)
    np.testing.assert_allclose(trained.evaluate(x, y, batch_size=BATCH, verbose=0),
                               plain.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)
    # A direct call would read one slice: refused, not a wrong result.
    with pytest.raises(ValueError, match="Received: a"):
        trained(x[:BATCH])


def test_what_it_cannot_split_is_refused(logical_cpus):
    import keras
    import tfdist

    def normed():
        inputs = keras.Input((FEATURES,))
        h = keras.layers.LayerNormalization(name="norm")(inputs)
        return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))

    strategy = tfdist.ModelParallelStrategy(layout_map={"norm/gamma": ("model",)})
    with strategy.scope():
        model = normed()
        model.compile("adam", "mse")
    with pytest.raises(ValueError, match=r"layer 'norm' \(LayerNormalization\) with "
                                         r"'norm/gamma' laid out \('model',\)"):
        model.fit(np.zeros((4, FEATURES), "float32"), np.zeros((4, 2), "float32"), verbose=0)
    for layout, match in [(("model", "model"), "name 'model' once"),
                          ((None, "model", None), "one entry per axis")]:
        with pytest.raises(ValueError, match=match):
            with tfdist.ModelParallelStrategy(layout_map={"up/kernel": layout}).scope():
                _pair()
    with pytest.raises(ValueError, match=r"'odd/kernel' of shape \[6, 3\] cannot be split "
                                         r"on axis 1 over 2"):
        with tfdist.ModelParallelStrategy(layout_map={"odd/kernel": (None, "model")}).scope():
            keras.layers.Dense(3, name="odd").build((None, FEATURES))
    with pytest.raises(ValueError, match="Received: layout_map={}"):
        tfdist.ModelParallelStrategy(layout_map={})


def test_compression_casts_the_reduced_payloads(logical_cpus):
    import tfdist

    plain = tfdist.ModelParallelStrategy(layout_map=PAIR)
    exact, _ = _train(plain, _pair, epochs=1)
    strategy = tfdist.ModelParallelStrategy(layout_map=PAIR, compression="fp16")
    got, _ = _train(strategy, _pair, epochs=1)
    assert_weights_close(got, exact, atol=1e-2)
    # The partial sums and the bias gradient travel as fp16; the gathered rows do not.
    rows, steps = BATCH // 2, 32 // BATCH
    gathered = 4 * (rows * FEATURES + rows * OUTPUTS)
    assert plain.bytes_communicated == steps * (gathered + 4 * (BATCH * OUTPUTS + OUTPUTS))
    assert strategy.bytes_communicated == steps * (gathered + 2 * (BATCH * OUTPUTS + OUTPUTS))


def test_keras_model_parallel_on_a_1_x_2_mesh_matches_one_device(logical_cpus):
    """Backend-agnostic Keras: ModelParallel over DeviceMesh((1, 2), ["batch", "model"])."""
    import keras

    import tfdist

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(PAIR.items(), shape=(1, 2))))
    try:
        got, model = _train(None, _pair)
        assert isinstance(model.distribute_strategy, tfdist.ModelParallelStrategy)
    finally:
        keras.distribution.set_distribution(None)
    ref, _ = _train(None, _pair)
    assert_weights_close(got, ref, atol=1e-5)


def test_saves_hold_the_unsharded_layout(logical_cpus, tmp_path):
    import keras

    import tfdist
    from tfdist._hooks.tensor_parallel import split_of

    strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
    got, trained = _train(strategy, _pair, epochs=1)
    slots = [v for v in trained.optimizer.variables if split_of(v) is not None]
    assert len(slots) == 6  # Adam's two slots of each split variable
    path = str(tmp_path / "split.keras")
    trained.save(path)
    # A plain process loads the whole weights and optimizer state...
    plain = keras.saving.load_model(path)
    assert_weights_close([np.asarray(w) for w in plain.get_weights()], got, atol=0)
    split_slots = {v.path: np.asarray(v) for v in trained.optimizer.variables}
    for variable in plain.optimizer.variables:
        np.testing.assert_array_equal(np.asarray(variable), split_slots[variable.path])
    # ...and continues as the split model does.
    x, y = _data(seed=1)
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    trained.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close([np.asarray(w) for w in trained.get_weights()],
                         [np.asarray(w) for w in plain.get_weights()], atol=1e-5)
    # A split model loads a plain save: each replica takes its slices.
    weights = str(tmp_path / "plain.weights.h5")
    plain.save_weights(weights)
    with strategy.scope():
        again = _pair()
    again.load_weights(weights)
    assert_weights_close([np.asarray(w) for w in again.get_weights()],
                         [np.asarray(w) for w in plain.get_weights()], atol=0)


VOCAB_SIZE = 10


def _embedded():
    import keras

    inputs = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(VOCAB_SIZE, DIM, name="table")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    return keras.Model(inputs, keras.layers.Dense(VOCAB_SIZE, name="head")(h))


@pytest.mark.parametrize("layouts", [
    {"table/embeddings": ("model", None)},  # vocabulary-parallel, head replicated
    {"table/embeddings": ("model", None), "head/kernel": (None, "model")},  # and split head
    {"table/embeddings": (None, "model")},  # features split
], ids=["vocab", "vocab-and-head", "features"])
def test_split_embedding_matches_one_device(logical_cpus, layouts):
    import keras

    import tfdist

    def train(strategy):
        rng = np.random.default_rng(0)
        x = rng.integers(0, VOCAB_SIZE, size=(32, 3)).astype("int32")
        y = rng.integers(0, VOCAB_SIZE, size=(32,)).astype("int32")
        return _train(strategy, _embedded, x=x, y=y, seed=3,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))[0]

    assert_weights_close(train(tfdist.ModelParallelStrategy(layout_map=layouts)), train(None),
                         atol=1e-5)


def test_attention_split_by_heads_matches_one_device(logical_cpus):
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of

    def train(strategy):
        x, y = attention_data()
        return _train(strategy, attention_block, optimizer="sgd", x=x, y=y)

    strategy = tfdist.ModelParallelStrategy(layout_map={**HEADS, **PAIR})
    got, trained = train(strategy)
    ref, _ = train(None)
    assert_weights_close(got, ref, atol=1e-5)
    # Per step, in floats of one replica (b = 4 of B = 8 rows, 4 tokens of DIM = 8): the
    # attention's input rows gathered once for query, key and value (b*4*DIM), its
    # output's partial sums reduce-scattered (B*4*DIM) and their gradient's rows
    # gathered (b*4*DIM); the same three for the feed-forward pair, plus the pair's
    # input gradient reduce-scattered (B*4*DIM); and the 98 replicated weights' gradients
    # all-reduced (output bias, norm, down bias, the last Dense).
    b, rows = BATCH // 2, 4 * DIM
    per_step = 2 * (b * rows + BATCH * rows + b * rows) + BATCH * rows + 98
    assert strategy.bytes_communicated == 4 * per_step * 2 * (32 // BATCH)
    split = sorted(v.path for v in trained.weights if split_of(v) is not None)
    assert split == ["down/kernel", "mha/attention_output/kernel", "mha/key/bias",
                     "mha/key/kernel", "mha/query/bias", "mha/query/kernel", "mha/value/bias",
                     "mha/value/kernel", "up/bias", "up/kernel"]


def test_einsum_dense_column_output_gathered_and_attention_refusals(logical_cpus):
    import keras

    import tfdist

    def einsum_model():
        inputs = keras.Input((4, DIM))
        h = keras.layers.EinsumDense("abc,cd->abd", (4, 6), bias_axes="d", name="proj")(inputs)
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))

    def train(strategy, build):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(16, 4, DIM)).astype("float32")
        return _train(strategy, build, epochs=1, x=x, seed=5,
                      y=rng.normal(size=(16, 4, 2)).astype("float32"))[0]

    layouts = {"proj/kernel": (None, "model")}
    assert_weights_close(train(tfdist.ModelParallelStrategy(layout_map=layouts), einsum_model),
                         train(None, einsum_model), atol=1e-5)

    def masked():
        inputs = keras.Input((4, DIM))
        h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=3, name="mha")(
            inputs, inputs, attention_mask=keras.ops.ones((1, 4, 4), "bool"))
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))

    with pytest.raises(ValueError, match=r"Received: 'mha/attention_output/kernel' laid out "
                                         r"None"):
        half = {"mha/(query|key|value)/kernel": (None, "model", None)}
        train(tfdist.ModelParallelStrategy(layout_map=half), masked)


def test_mixed_precision_matches_one_device(logical_cpus):
    import keras

    import tfdist

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        got, trained = _train(tfdist.ModelParallelStrategy(layout_map=PAIR), _pair, epochs=1)
        ref, _ = _train(None, _pair, epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(trained.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(got, ref, atol=1e-4)  # float16 activations on both sides


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["tf", pytest.param("horovod", marks=pytest.mark.horovod)])
def test_two_workers_split_the_model_axis_across_processes(engine, tmp_path):
    """2 workers of one replica each, both engines: the pair, the attention block and
    the hybrid CNN end equal to one process and on both workers; each holds half of the
    split elements; the chief's save loads in a plain process and on one host's 2
    replicas."""
    import keras

    import tfdist
    from helpers import require_horovod, run_cluster
    from tfdist._hooks.tensor_parallel import split_of

    from tp_jobs import launched_task

    if engine == "horovod":
        require_horovod()
    chief, other = run_cluster(launched_task, engine, timeout=280,
                               env={"TFDIST_TEST_DIR": str(tmp_path)})
    plain = keras.saving.load_model(chief["saved"])
    assert_weights_close([np.asarray(w) for w in plain.get_weights()], chief["hybrid"],
                         atol=0)
    with tfdist.ModelParallelStrategy(layout_map=HEAD).scope():
        split = keras.saving.load_model(chief["saved"])
    assert split_of(split.get_layer("head_up").kernel) is not None
    assert_weights_close([np.asarray(w) for w in split.get_weights()], chief["hybrid"],
                         atol=0)
    assert chief["chief"] and not other["chief"] and chief["replicas"] == 2
    for name in ("pair", "attention", "hybrid"):
        assert_weights_close(chief[name], other[name], atol=0)
        assert_weights_close(chief[name], chief["reference"][name], atol=1e-5)
    for result in (chief, other):
        assert result["held"] * 2 == result["whole"]
    rows = BATCH // 2  # as on one host: the same collectives, across the processes
    per_step = 4 * (rows * FEATURES + BATCH * OUTPUTS + rows * OUTPUTS + OUTPUTS)
    assert chief["bytes"] == other["bytes"] == per_step * 2 * (32 // BATCH)


def test_hybrid_cnn_matches_one_device(logical_cpus):
    """The seeds' hybrid: the convolutions data-parallel over the replicas (each its rows
    of the batch, gradients all-reduced), the fully-connected head split over "model"."""
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of

    x, y = image_data()
    strategy = tfdist.ModelParallelStrategy(layout_map=HEAD)
    got, trained = _train(strategy, hybrid_cnn, x=x, y=y)
    ref, _ = _train(None, hybrid_cnn, x=x, y=y)
    assert_weights_close(got, ref, atol=1e-5)
    split = sorted(v.path for v in trained.weights if split_of(v) is not None)
    assert split == ["head_down/kernel", "head_up/bias", "head_up/kernel"]


def test_multi_worker_refusals_before_joining(monkeypatch):
    import tfdist
    from tfdist import env

    with pytest.raises(ValueError, match="Received: shard_optimizer_state=True"):
        tfdist.MultiWorkerModelParallelStrategy(layout_map=PAIR, shard_optimizer_state=True)
    with pytest.raises(ValueError, match="Received: accumulate_steps=2"):
        tfdist.MultiWorkerModelParallelStrategy(layout_map=PAIR, accumulate_steps=2)
    monkeypatch.setenv(env.ELASTIC_ADDR, "127.0.0.1:1")
    with pytest.raises(ValueError, match="cannot re-form split variables.*Received: tfdist "
                                         "launch --min-workers"):
        tfdist.MultiWorkerModelParallelStrategy(layout_map=PAIR)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_keras_model_parallel_on_a_1_x_2_mesh():
    """Backend-agnostic Keras under tfdist launch: each worker one device of the mesh,
    reading its rows of each global batch (the bytes show b = B/2 rows gathered)."""
    from helpers import run_cluster

    from tp_jobs import keras_launched_task

    results = run_cluster(keras_launched_task, timeout=280)
    reference, _ = _train(None, _pair)
    for result in results:
        assert result["strategy"] == "MultiWorkerModelParallelStrategy"
        assert result["devices"] == ["cpu:0", "cpu:1"]
        assert_weights_close(result["weights"], reference, atol=1e-5)
        rows = BATCH // 2
        per_step = 4 * (rows * FEATURES + BATCH * OUTPUTS + rows * OUTPUTS + OUTPUTS)
        assert result["bytes"] == per_step * 2 * (32 // BATCH)
