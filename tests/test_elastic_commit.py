"""An elastic fit's commit read inside the train step (tfdist/strategies/elastic/fit.py,
`tfdist._hooks.keras_steps.committing_train_function`), in one process: the copy holds
the variables' values after the step, and the step is Keras' own.

A model and its twin start equal; one runs the committing train function, the other
Keras' train function and then reads its variables.
"""

import numpy as np
import pytest


def _twins(strategy, steps_per_execution):
    import keras

    models = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse",
                          metrics=["mae"], steps_per_execution=steps_per_execution)
        models.append(model)
    return models


def _batches(strategy, count):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * count, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    return list(strategy.experimental_distribute_dataset(dataset))


def _state(model):
    """What `ElasticFit` commits: the state and the metrics' local variables."""
    from tfdist.strategies.elastic.snapshot import _tf_variable

    seen, state = set(), []
    for v in (*model.variables, *model.optimizer.variables):
        if id(v) not in seen:
            seen.add(id(v))
            state.append(v)
    local = model.distribute_strategy.experimental_local_results
    metrics = [c for m in model.metrics for v in m.variables for c in local(v.value)]
    return state, metrics, lambda: [np.array(_tf_variable(v).read_value())
                                    for v in (*state, *metrics)]


def _build(model, batch):
    """fit's symbolic build (the optimizer and metrics made before the first step)."""
    model._maybe_symbolic_build(data_batch=model.distribute_strategy.reduce(
        "MEAN", batch, axis=None) if model.distribute_strategy.num_replicas_in_sync > 1
        else batch)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_the_committing_step_copies_the_variables_after_it(
        logical_cpus, replicas, steps_per_execution):
    import tensorflow as tf

    from tfdist._hooks.keras_steps import committing_train_function, remake_train_function
    from tfdist.strategies.elastic.snapshot import Snapshot

    strategy = (tf.distribute.MirroredStrategy(logical_cpus) if replicas == 2
                else tf.distribute.get_strategy())
    fused, plain = _twins(strategy, steps_per_execution)
    batches = _batches(strategy, 3 * steps_per_execution)
    for model in (fused, plain):
        _build(model, batches[0])
    state, metrics, read = _state(fused)
    snapshot = Snapshot(state, metrics, len(fused.optimizer.variables))
    assert len(snapshot.pack()) == 2  # float32 and the int64 step: one buffer each
    function = committing_train_function(fused, remake_train_function(fused),
                                         snapshot.pack)
    keras_function = remake_train_function(plain)
    _, _, read_plain = _state(plain)
    iterator, plain_iterator = iter(batches), iter(batches)
    for _ in range(3):  # the first call traces; later calls reuse the trace
        before = read()
        logs, values = function(iterator)
        plain_logs = keras_function(plain_iterator)
        copied, after = [np.array(v) for v in snapshot.unpack(values)], read()
        assert len(copied) == len(after) == len(state) + len(metrics)
        for c, a, p in zip(copied, after, read_plain()):
            np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-7)  # after the step
            np.testing.assert_allclose(c, p, rtol=1e-5, atol=1e-6)  # Keras' own step
        assert not all(np.array_equal(b, a) for b, a in zip(before, after))
        iteration = [c for c, v in zip(copied, state) if v is fused.optimizer.iterations]
        assert int(iteration[0]) == int(fused.optimizer.iterations.numpy())
        np.testing.assert_allclose(float(logs["loss"]), float(plain_logs["loss"]),
                                   rtol=1e-5)
    assert int(fused.optimizer.iterations.numpy()) == 3 * steps_per_execution
    with pytest.raises(StopIteration):
        next(iterator)


def test_the_committing_step_reads_nothing_when_the_data_ran_out(logical_cpus):
    """A call whose last step has no batch (the epoch's end) returns no copy: the
    elastic fit then commits by its own read."""
    import tensorflow as tf

    from tfdist._hooks.keras_steps import committing_train_function, remake_train_function
    from tfdist.strategies.elastic.snapshot import Snapshot

    strategy = tf.distribute.get_strategy()
    model, _ = _twins(strategy, 3)
    batches = _batches(strategy, 2)
    _build(model, batches[0])
    state, metrics, read = _state(model)
    snapshot = Snapshot(state, metrics, len(model.optimizer.variables))
    function = committing_train_function(model, remake_train_function(model), snapshot.pack)
    logs, values = function(iter(batches))
    assert values is None and "loss" in logs
    assert int(model.optimizer.iterations.numpy()) == 2
    for c, a in zip(snapshot.unpack(snapshot.read()), read()):
        np.testing.assert_array_equal(np.array(c), a)
