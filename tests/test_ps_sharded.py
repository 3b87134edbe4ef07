"""Model parallelism on parameter servers: sharded variables and their optimizer slots.

One cluster (`tfdist launch --chief --workers 2 --ps 2`, an embedding partitioned in 2)
runs every check of issue 18 items 1 and 3 and returns what the chief saw:

- ``fit`` with Adam: the table's shards and each slot's shards are on ps-0 and ps-1;
- a custom loop (``tape.gradient`` + ``optimizer.apply``, steps scheduled one at a
  time through the `ClusterCoordinator`) equals the same loop on one device;
- TF's tutorial loop shape (per-worker dataset, ``apply_gradients``, ``strategy.reduce``)
  runs unchanged apart from the strategy line.
"""

import numpy as np
import pytest

from helpers import run_cluster

pytestmark = pytest.mark.timeout(200)

PS_DEVICES = ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
ROWS, DIM = 100, 8


def _embedding_model():
    import keras

    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(ROWS, DIM),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def _data(n, seed, distinct_per=None):
    """``ids`` (n, 4) and targets; with ``distinct_per=b`` no id repeats within a batch of
    b examples (Keras' Adam squares a sparse gradient's repeated rows one by one)."""
    rng = np.random.default_rng(seed)
    if distinct_per is None:
        ids = rng.integers(0, ROWS, size=(n, 4)).astype("int32")
    else:
        ids = np.concatenate([rng.permutation(ROWS)[:4 * distinct_per].reshape(-1, 4)
                              for _ in range(n // distinct_per)]).astype("int32")
    y = rng.normal(size=(ROWS,)).astype("float32")[ids].sum(1, keepdims=True)
    return ids, y


def _full(variable):
    """A Keras variable's value as one array (a sharded one is concatenated)."""
    import tensorflow as tf

    return np.asarray(tf.convert_to_tensor(variable.value))


def _layout(variable):
    """``[(device, shape), ...]`` of a variable's shards, or None if it is not sharded."""
    from tfdist._hooks.sharded.parts import sharded_parts

    parts = sharded_parts(variable)
    return None if parts is None else [(p.device, tuple(p.shape)) for p in parts]


def _slot_layouts(optimizer, table):
    """``{slot path: shard layout}`` of the optimizer variables built for ``table``."""
    name = table.path.replace("/", "_")
    return {v.path: _layout(v) for v in optimizer.variables if name in v.path}


def _custom_loop(strategy, model, optimizer, batches, use_apply_gradients):
    """The loop of TF's tutorial: one step per `coordinator.schedule`, then `join`
    (``strategy=None``: the same steps on this process's device)."""
    import tensorflow as tf

    run = strategy.run if strategy is not None else lambda fn, args: fn(*args)

    @tf.function
    def train_step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            if use_apply_gradients:
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            else:
                optimizer.apply(grads, model.trainable_variables)
            return loss

        return run(replica_fn, args=(x, y))

    for x, y in batches:
        if strategy is None:
            train_step(tf.constant(x), tf.constant(y))
        else:  # one step at a time: each sees the previous step's update, as on one device
            strategy.coordinator.schedule(train_step, args=(tf.constant(x), tf.constant(y)))
            strategy.coordinator.join()


def _loop_against_one_device(strategy, make_optimizer, use_apply_gradients, seed):
    """Trains a sharded model and a one-device copy with the same loop and batches."""
    import keras

    ids, y = _data(96, seed)
    batches = [(ids[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)]
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = _embedding_model()
        optimizer = make_optimizer()
    reference, ref_optimizer = _embedding_model(), make_optimizer()  # no strategy: one device
    for ref, var in zip(reference.weights, model.weights):
        ref.assign(_full(var))
    initial = _full(model.layers[0].embeddings)
    _custom_loop(strategy, model, optimizer, batches, use_apply_gradients)
    _custom_loop(None, reference, ref_optimizer, batches, use_apply_gradients)
    table = model.layers[0].embeddings
    return {"table": _layout(table), "slots": _slot_layouts(optimizer, table),
            "moved": float(np.abs(_full(table) - initial).max()),
            "weights": [_full(v) for v in model.weights],
            "reference": [_full(v) for v in reference.weights],
            "optimizer": {v.path: _full(v) for v in optimizer.variables},
            "ref_optimizer": {v.path: _full(v) for v in ref_optimizer.variables}}


def _tutorial_loop(strategy):
    """TF's parameter-server tutorial loop, Keras 3 spelling: per-worker dataset,
    ``apply_gradients``, a metric, ``strategy.reduce``; async steps."""
    import keras
    import tensorflow as tf

    ids, y = _data(64, 5)
    with strategy.scope():
        model = _embedding_model()
        optimizer = keras.optimizers.RMSprop(learning_rate=0.01)
        mae = keras.metrics.MeanAbsoluteError()

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(16)

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                loss = tf.nn.compute_average_loss(tf.reduce_mean((pred - labels) ** 2, axis=1))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            mae.update_state(labels, pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    coordinator = strategy.coordinator
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(6)]
    coordinator.join()
    table = model.layers[0].embeddings
    return {"losses": [float(v.fetch()) for v in losses], "mae": float(mae.result()),
            "iterations": int(optimizer.iterations.numpy()),
            "slots": _slot_layouts(optimizer, table)}


def _sharded_task():
    import keras
    import tensorflow as tf

    import tfdist

    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256, max_shards=2)
    strategy = tfdist.ParameterServerStrategy(variable_partitioner=partitioner)
    out = {}

    # fit with Adam
    ids, y = _data(128, 0)
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = _embedding_model()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.fit(ids, y, batch_size=32, epochs=1, verbose=0)
    table = model.layers[0].embeddings
    out["fit"] = {"table": _layout(table), "slots": _slot_layouts(model.optimizer, table),
                  "slot_moved": {v.path: [float(np.abs(p.numpy()).max()) for p in v.value.variables]
                                 for v in model.optimizer.variables
                                 if _layout(v) is not None}}
    # custom loops, each against the same loop on one device
    out["adam"] = _loop_against_one_device(
        strategy, lambda: keras.optimizers.Adam(0.05), use_apply_gradients=False, seed=3)
    out["momentum"] = _loop_against_one_device(
        strategy, lambda: keras.optimizers.SGD(0.05, momentum=0.9), use_apply_gradients=True,
        seed=4)
    out["tutorial"] = _tutorial_loop(strategy)
    out["embedding_fit"] = _embedding_fit(strategy)
    return out


def _embedding_fit(strategy):
    """fit, evaluate and both halves of the table trained: an Embedding across two ps."""
    import keras

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, size=(512, 4)).astype("int32")
    y = rng.normal(size=(100,)).astype("float32")[ids].sum(1, keepdims=True)
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(100, 8), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    embeddings = model.layers[0].embeddings
    shards = [(v.device, tuple(v.shape)) for v in embeddings.value.variables]
    before = [np.asarray(v) for v in embeddings.value.variables]
    history = model.fit(ids, y, batch_size=32, epochs=3, verbose=0)
    after = [np.asarray(v) for v in embeddings.value.variables]
    return {"type": type(embeddings.value).__name__, "shards": shards,
            "moved": [float(np.abs(a - b).max()) for a, b in zip(after, before)],
            "loss": history.history["loss"],
            "iterations": int(model.optimizer.iterations.numpy()),
            "evaluate": model.evaluate(ids, y, verbose=0)}


def _sync_fit_task(steps, batch):
    """Sync mode: each step sums one gradient per worker in sharded sums on the ps tasks,
    then applies them once, shard by shard, in blocks of 16 rows (as a large table's
    shards are); equals one device on the summed batch."""
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.keras import ps_steps

    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256, max_shards=2)
    strategy = tfdist.ParameterServerStrategy(variable_partitioner=partitioner, mode="sync",
                                              update_block_bytes=16 * DIM * 4)
    # The one-device step applies one sparse gradient per batch of 2 * batch, the sync step
    # a dense sum: they agree when no id repeats within a batch (see _data).
    ids, y = _data(64, 6, distinct_per=2 * batch)
    with strategy.scope():
        keras.utils.set_random_seed(6)
        model = _embedding_model()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    reference = _embedding_model()
    for ref, var in zip(reference.weights, model.weights):
        ref.assign(_full(var))
    initial = _full(model.layers[0].embeddings)
    # Worker i reads batches i, i+2, ...: step r sums batches 2r and 2r+1.
    model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch), epochs=1,
              steps_per_epoch=steps, verbose=0)
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    reference.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(2 * batch), epochs=1,
                  steps_per_epoch=steps, verbose=0)
    table = model.layers[0].embeddings
    return {"table": _layout(table), "slots": _slot_layouts(model.optimizer, table),
            "sum": _layout(ps_steps._driver(model).accumulators[id(table)]),
            "moved": float(np.abs(_full(table) - initial).max()),
            "weights": [_full(v) for v in model.weights],
            "reference": [_full(v) for v in reference.weights],
            "optimizer": [_full(v) for v in model.optimizer.variables],
            "ref_optimizer": [_full(v) for v in reference.optimizer.variables]}


def _assert_sharded_like_the_table(result, slot_names):
    table = result["table"]
    assert sorted(device for device, _ in table) == PS_DEVICES
    assert sum(shape[0] for _, shape in table) == ROWS
    assert all(shape[1:] == (DIM,) for _, shape in table)
    assert sorted(result["slots"]) == sorted(slot_names), result["slots"]
    for path, layout in result["slots"].items():
        assert layout == table, f"{path}: {layout} is not sharded like the table {table}"


@pytest.fixture(scope="module")
def chief():
    return run_cluster(_sharded_task, workers=2, chief=True, ps=2)[0]


@pytest.mark.multiprocess
def test_fit_with_adam_shards_every_slot_like_its_table(chief):
    fit = chief["fit"]
    _assert_sharded_like_the_table(fit, ["adam/sequential_embedding_embeddings_momentum",
                                         "adam/sequential_embedding_embeddings_velocity"])
    # each slot shard was updated on its ps (Adam's moments start at zero)
    for path, maxima in fit["slot_moved"].items():
        assert all(m > 0 for m in maxima), (path, maxima)


@pytest.mark.multiprocess
@pytest.mark.parametrize("loop, slot", [("adam", ["momentum", "velocity"]),
                                        ("momentum", ["momentum"])])
def test_custom_loop_on_sharded_variables_equals_one_device(chief, loop, slot):
    result = chief[loop]
    assert sorted(path.rsplit("_", 1)[1] for path in result["slots"]) == sorted(slot)
    _assert_sharded_like_the_table(result, list(result["slots"]))
    assert result["moved"] > 1e-3
    for i, (got, want) in enumerate(zip(result["weights"], result["reference"])):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"weight {i}")
    assert len(result["optimizer"]) == len(result["ref_optimizer"])
    for (path, got), want in zip(result["optimizer"].items(), result["ref_optimizer"].values()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=path)


@pytest.mark.multiprocess
def test_sharded_embedding_across_two_ps_trains(chief):
    result = chief["embedding_fit"]
    assert result["type"] == "ShardedVariable"
    assert sorted(device for device, _ in result["shards"]) == PS_DEVICES
    assert [shape for _, shape in result["shards"]] == [(50, 8), (50, 8)]
    assert all(m > 1e-3 for m in result["moved"])  # both halves were trained
    assert result["iterations"] == 3 * 16
    assert result["loss"][-1] < 0.5 * result["loss"][0]
    assert np.isfinite(result["evaluate"])


@pytest.mark.multiprocess
def test_tutorial_loop_runs_with_sharded_slots(chief):
    tutorial = chief["tutorial"]
    assert tutorial["iterations"] == 6
    assert all(np.isfinite(tutorial["losses"])) and np.isfinite(tutorial["mae"])
    assert len(tutorial["slots"]) == 1  # RMSprop's velocity
    for layout in tutorial["slots"].values():
        assert sorted(device for device, _ in layout) == PS_DEVICES
        assert sum(shape[0] for _, shape in layout) == ROWS


@pytest.mark.multiprocess
def test_sync_fit_with_sharded_sums_and_slots_equals_one_device_on_summed_batch():
    result = run_cluster(_sync_fit_task, 4, 8, workers=2, chief=True, ps=2)[0]
    _assert_sharded_like_the_table(result, list(result["slots"]))
    assert len(result["slots"]) == 2  # Adam's momentum and velocity
    assert result["sum"] == result["table"]  # the gradient sums are sharded alike
    assert result["moved"] > 1e-3
    for i, (got, want) in enumerate(zip(result["weights"], result["reference"])):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"weight {i}")
    for i, (got, want) in enumerate(zip(result["optimizer"], result["ref_optimizer"])):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"optimizer {i}")
