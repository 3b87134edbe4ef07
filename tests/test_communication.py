"""CommunicationOptions across synchronous strategies: gradient accumulation and
fp16/bf16 compression, against single-device references (2 logical CPUs here; the
multi-worker cases run through tfdist.launch)."""

import numpy as np
import pytest

import tfdist
from helpers import assert_weights_close, classification_data, mlp, run_cluster

pytestmark = pytest.mark.timeout(300)


def _model_and_data():
    x, y = classification_data(n=96)
    return x, np.eye(3, dtype="float32")[y]


def _train(strategy, x, y, batch, steps, optimizer="sgd"):
    import keras

    scope = strategy.scope() if strategy is not None else _Null()
    with scope:
        model = mlp()
        opt = keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd" else \
            keras.optimizers.Adam(0.01)
        model.compile(opt, "mse")
    model.fit(x[:batch * steps], y[:batch * steps], batch_size=batch, epochs=1,
              shuffle=False, verbose=0)
    return model


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.unit
def test_options_validation():
    with pytest.raises(ValueError, match="accumulate_steps must be an integer >= 1. "
                                         "Received: accumulate_steps=0"):
        tfdist.CommunicationOptions(accumulate_steps=0)
    with pytest.raises(ValueError, match="compression must be None, 'fp16' or 'bf16'"):
        tfdist.CommunicationOptions(compression="int8")
    with pytest.raises(ValueError, match="given twice"):
        from tfdist.comm.options import merge_options

        merge_options(tfdist.CommunicationOptions(compression="fp16"), compression="bf16")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulate_equals_one_larger_batch_on_one_device(logical_cpus, optimizer):
    """k micro-batches of b, accumulated, equal one step with batch k*b on one device."""
    x, y = _model_and_data()
    k, b = 3, 8
    strategy = tfdist.MirroredStrategy(
        communication_options=tfdist.CommunicationOptions(accumulate_steps=k))
    got = _train(strategy, x, y, batch=b, steps=2 * k, optimizer=optimizer)
    ref = _train(None, x, y, batch=k * b, steps=2, optimizer=optimizer)
    assert int(got.optimizer.iterations.numpy()) == 2
    assert_weights_close(got.get_weights(), ref.get_weights(), atol=1e-5)
    # One all-reduce per k micro-batches.
    weight_bytes = sum(w.size * 4 for w in got.get_weights())
    assert strategy.bytes_communicated == 2 * weight_bytes


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_halves_bytes_and_stays_close(logical_cpus, compression):
    x, y = _model_and_data()
    plain = tfdist.MirroredStrategy()
    squeezed = tfdist.MirroredStrategy(compression=compression)
    ref = _train(plain, x, y, batch=16, steps=6)
    got = _train(squeezed, x, y, batch=16, steps=6)
    assert squeezed.bytes_communicated * 2 == plain.bytes_communicated
    # fp16 keeps ~3 decimal digits, bf16 ~2: stated tolerances on 6 SGD steps.
    atol = {"fp16": 1e-3, "bf16": 1e-2}[compression]
    assert_weights_close(got.get_weights(), ref.get_weights(), atol=atol)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_training_converges(logical_cpus, compression):
    import keras

    x, y = classification_data(n=256, seed=3)
    strategy = tfdist.MirroredStrategy(compression=compression)
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.02),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=15, verbose=0)
    assert history.history["accuracy"][-1] > 0.9


def _multi_worker_job(accumulate_steps, compression):
    import keras

    import tfdist
    from helpers import classification_data, mlp

    strategy = tfdist.MultiWorkerMirroredStrategy(
        communication_options=tfdist.CommunicationOptions(
            accumulate_steps=accumulate_steps, compression=compression))
    x, y = classification_data(n=96)
    y = np.eye(3, dtype="float32")[y]
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    model.fit(x[:96], y[:96], batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "iterations": int(model.optimizer.iterations.numpy()),
            "bytes": strategy.bytes_communicated}


@pytest.mark.multiprocess
def test_multi_worker_accumulate_and_compression():
    """2 workers, global batch 16, k=3: equals one device with batch 48 (atol 1e-5);
    then fp16 on the same problem halves the bytes."""
    x, y = _model_and_data()
    ref = _train(None, x, y, batch=48, steps=2)
    results = run_cluster(_multi_worker_job, 3, None, workers=2, timeout=240)
    for result in results:
        assert result["iterations"] == 2
        assert_weights_close([np.array(w) for w in result["weights"]], ref.get_weights())
    fp16 = run_cluster(_multi_worker_job, 3, "fp16", workers=2, timeout=240)
    assert fp16[0]["bytes"] * 2 == results[0]["bytes"]
    assert_weights_close([np.array(w) for w in fp16[0]["weights"]], ref.get_weights(),
                         atol=1e-3)


def test_model_average_takes_the_same_options(logical_cpus):
    strategy = tfdist.ModelAverageStrategy(
        period=2, communication_options=tfdist.CommunicationOptions(compression="bf16"))
    assert strategy.compression.name == "bf16"
    with pytest.raises(ValueError, match="accumulate_steps=2"):
        tfdist.ModelAverageStrategy(
            communication_options=tfdist.CommunicationOptions(accumulate_steps=2))
