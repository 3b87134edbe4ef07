"""tfdist.MirroredStrategy on 2 logical CPUs against one device, same global batch."""

import contextlib

import numpy as np
import pytest

from helpers import assert_weights_close, classification_data, mlp

GLOBAL_BATCH = 16


def _compile(model, optimizer):
    import keras

    opt = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
           "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer]()
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def _fit(strategy, x, y, optimizer, use_dataset, batchnorm):
    import tensorflow as tf

    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = mlp(batchnorm=batchnorm)
        _compile(model, optimizer)
    if use_dataset:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        history = model.fit(data, epochs=2, verbose=0)
        ev = model.evaluate(data, verbose=0)
    else:
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        ev = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    pred = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    return model.get_weights(), history.history, ev, pred


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("optimizer,use_dataset,batchnorm", [
    ("sgd", False, False), ("adam", True, False), ("sgd", True, True), ("adam", False, True)])
def test_mirrored_matches_single_device(logical_cpus, optimizer, use_dataset, batchnorm):
    import tfdist

    x, y = classification_data(n=64)
    strategy = tfdist.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 2
    got = _fit(strategy, x, y, optimizer, use_dataset, batchnorm)
    ref = _fit(None, x, y, optimizer, use_dataset, batchnorm)
    assert_weights_close(got[0], ref[0])
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[1][key], ref[1][key], atol=1e-5)
    np.testing.assert_allclose(got[2], ref[2], atol=1e-5)
    np.testing.assert_allclose(got[3], ref[3], atol=1e-5)


@pytest.mark.parametrize("cross_device_ops", [None, "collective"])
def test_two_strategies_in_one_process(logical_cpus, cross_device_ops):
    """Two models under two instances. Stock TF's collective default fails here with
    "Shape mismatch in the collective instance"."""
    import keras

    import tfdist

    x, y = classification_data(n=32)
    for width in (8, 12):
        strategy = tfdist.MirroredStrategy(cross_device_ops=cross_device_ops)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(width),
                                      keras.layers.Dense(3)])
            _compile(model, "sgd")
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])


def test_bad_device_is_named(logical_cpus):
    import tfdist

    with pytest.raises(ValueError, match="/cpu:7"):
        tfdist.MirroredStrategy(devices=["/cpu:7"])


def test_gpus_on_a_host_without_gpus_run_on_the_cpu_as_in_stock(logical_cpus):
    """TF's distributed-training guide builds MirroredStrategy(devices=["/gpu:0",
    "/gpu:1"]) anywhere: TF soft-places the replicas on the CPU. tfdist does too, says
    so, and trains as one device (stock's collective all-reduce hangs in fit there)."""
    import keras
    import tensorflow as tf

    import tfdist

    assert not tf.config.list_logical_devices("GPU")  # this suite's hosts
    stock = tf.distribute.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    with pytest.warns(UserWarning, match=r"this host has no GPU: the replicas on "
                      r"\['/gpu:0', '/gpu:1'\] run on the CPU") as caught:
        strategy = tfdist.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    assert caught[0].filename == __file__
    assert strategy.num_replicas_in_sync == stock.num_replicas_in_sync == 2
    assert strategy.extended.worker_devices == stock.extended.worker_devices
    x, y = classification_data(n=64)
    weights = []
    for scope in (strategy, None):
        keras.utils.set_random_seed(1)
        with scope.scope() if scope is not None else contextlib.nullcontext():
            model = mlp()
            model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, np.eye(3)[y], batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert_weights_close(weights[0], weights[1])


def test_logical_cpus_cannot_change_after_start(logical_cpus):
    import tfdist

    assert tfdist.devices.use_logical_cpus(2) == logical_cpus
    with pytest.raises(RuntimeError, match="already initialized with 2"):
        tfdist.devices.use_logical_cpus(3)
    with pytest.raises(ValueError, match="n=0"):
        tfdist.devices.use_logical_cpus(0)


def test_bytes_counter_counts_one_gradient_payload_per_step(logical_cpus):
    import keras

    import tfdist

    x, y = classification_data(n=64)
    strategy = tfdist.MirroredStrategy()
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, np.eye(3)[y], batch_size=16, epochs=1, verbose=0)
    weight_bytes = sum(w.size * 4 for w in model.get_weights())
    steps = 64 // 16
    # Gradients once per step, plus the scalar loss reductions for the logs.
    assert steps * weight_bytes <= strategy.bytes_communicated < steps * (weight_bytes + 64)


def test_one_process_names(logical_cpus):
    """rank, size, num_workers and is_chief mean the same on every strategy: here one
    process that computes the steps."""
    import tfdist

    strategy = tfdist.MirroredStrategy()
    assert (strategy.rank, strategy.size, strategy.num_workers, strategy.is_chief) == (
        0, 1, 1, True)
