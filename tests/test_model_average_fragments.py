"""``ModelAverageStrategy(fragments=F)`` (Streaming DiLoCo, ``sync_delay=0``) against a
numpy reference written from the algorithm, on 2 logical CPUs and on 2 workers.

Fragment ``f`` of the trainable variables (split in layer order into parts of about
equal bytes) averages ``f * H / F`` steps into each period of ``H`` steps, with its own
outer optimizer; ``fit`` ends with a full plain average.
"""

import numpy as np
import pytest

from helpers import assert_weights_close, require_horovod, run_cluster
from test_model_average import (LR, fit_linear, linear_data, mse_grads, numpy_local_sgd,
                                replica_batches)


def numpy_streaming_diloco(x, y, w0, b0, steps, period, fragments, warmup=0, replicas=2,
                           lr=LR, outer=None, delay=0, mix=1.0, saves=()):
    """Streaming DiLoCo for the linear model (kernel, bias).

    Each replica steps on its own data. After step ``s``, fragment ``f`` (its variables
    ``parts[f]``) is exchanged if ``s <= warmup`` or ``(s - warmup) % period == f *
    period / fragments``: its anchor takes the mean, or with ``outer=(lr, momentum)``
    Keras' Nesterov SGD step with ``anchor - mean`` as gradient. The result is applied
    ``delay`` steps later as ``w = mix * anchor + (1 - mix) * w`` on every replica.
    After each step in ``saves`` (a save), and at the end, an exchange in flight is
    applied at once, then every variable is averaged plainly (anchor = mean).
    """
    params = [[w0.astype("float64").copy(), b0.astype("float64").copy()]
              for _ in range(replicas)]
    anchor = [w0.astype("float64").copy(), b0.astype("float64").copy()]
    momentum = [np.zeros_like(a) for a in anchor]
    parts = [[0], [1]] if fragments == 2 else [[0, 1]]
    pending = None  # (step that applies it, variable indices)

    def apply(part):
        for i in part:
            for p in params:
                p[i] = mix * anchor[i] + (1 - mix) * p[i]

    for step in range(steps):
        for r, (xr, yr) in enumerate(replica_batches(x, y, step, replicas)):
            gw, gb = mse_grads(params[r][0], params[r][1], xr, yr)
            params[r] = [params[r][0] - lr * gw, params[r][1] - lr * gb]
        s = step + 1
        if pending is not None and pending[0] == s:
            apply(pending[1])
            pending = None
        for f, part in enumerate(parts):
            if not (s <= warmup or (s - warmup) % period == f * period // fragments):
                continue
            for i in part:
                mean = np.mean([p[i] for p in params], axis=0)
                if outer is None:
                    anchor[i] = mean
                else:
                    outer_lr, mu = outer
                    g = anchor[i] - mean
                    momentum[i] = mu * momentum[i] - outer_lr * g
                    anchor[i] = anchor[i] + mu * momentum[i] - outer_lr * g
            pending = (s + delay, part)
            if delay == 0:
                apply(part)
                pending = None
        if s in saves and s < steps:
            if pending is not None:
                apply(pending[1])
                pending = None
            for i in range(2):
                anchor[i] = np.mean([p[i] for p in params], axis=0)
                for p in params:
                    p[i] = anchor[i].copy()
    if pending is not None:
        apply(pending[1])
    return [np.mean([p[i] for p in params], axis=0) for i in range(2)]


def test_split_fragments_by_bytes_in_order():
    from tfdist.comm.fragments import fragment_offset, split_fragments

    assert split_fragments([12, 4], 2) == [[0], [1]]
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split_fragments([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert split_fragments([5], 1) == [[0]]
    with pytest.raises(ValueError, match="fragments=3"):
        split_fragments([1, 1], 3)
    assert [fragment_offset(f, 8, 4) for f in range(4)] == [0, 2, 4, 6]


def test_bad_fragments_are_one_value_error_before_anything_runs(logical_cpus):
    import keras

    import tfdist

    with pytest.raises(ValueError, match="fragments"):
        tfdist.ModelAverageStrategy(period=4, fragments=0)
    with pytest.raises(ValueError, match="period must be a multiple of fragments"):
        tfdist.ModelAverageStrategy(period=6, fragments=4)
    with pytest.raises(ValueError, match="average_optimizer_state"):
        tfdist.ModelAverageStrategy(period=4, fragments=2, average_optimizer_state=True)
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=4)
    x, y = linear_data(n=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # 2 variables
        model.compile(keras.optimizers.SGD(LR), "mse")
    with pytest.raises(ValueError, match=r"number of trainable variables \(2\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("outer", [False, True])
def test_fragments_match_numpy_streaming_diloco(logical_cpus, outer):
    import keras

    import tfdist

    x, y = linear_data(n=80)  # 5 steps an epoch, 10 steps
    make = (lambda: keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)) if outer else None
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, outer_optimizer=make)
    initial, model = fit_linear(strategy, x, y, epochs=2)
    ref = numpy_streaming_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=2, outer=(0.7, 0.9) if outer else None)
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    one = numpy_streaming_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=1, outer=(0.7, 0.9) if outer else None)
    assert np.abs(ref[1] - one[1]).max() > 1e-5  # the fragments make a difference
    for variable in model.trainable_weights:  # one model after fit
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
    if outer:
        assert [int(o.iterations.numpy()) for o in strategy.outer_optimizers] == [2, 3]


def test_one_fragment_is_todays_algorithm_bit_for_bit(logical_cpus):
    import tfdist

    x, y = linear_data(n=80)
    results = []
    for kwargs in ({}, {"fragments": 1}):
        _, model = fit_linear(tfdist.ModelAverageStrategy(period=4, **kwargs), x, y, epochs=2)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    initial = fit_linear(tfdist.ModelAverageStrategy(period=4), x, y, epochs=0)[0]
    assert_weights_close(results[1], numpy_local_sgd(x, y, initial[0], initial[1],
                                                     steps=10, period=4), atol=1e-5)


def _worker_fragments(outer, engine="tf"):
    import keras

    import tfdist

    make = (lambda: keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)) if outer else None
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, outer_optimizer=make,
                                           engine=engine)
    x, y = linear_data(n=80)
    initial, model = fit_linear(strategy, x, y, epochs=2)
    return {"initial": initial, "weights": model.get_weights()}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("outer,engine", [(False, "tf"), (True, "tf"), (True, "horovod")])
def test_two_workers_fragments_match_numpy(outer, engine):
    if engine == "horovod":
        require_horovod()
    results = run_cluster(_worker_fragments, outer, engine, workers=2, timeout=240)
    x, y = linear_data(n=80)
    initial = results[0]["initial"]
    ref = numpy_streaming_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=2, outer=(0.7, 0.9) if outer else None)
    for result in results:
        assert_weights_close(result["weights"], ref, atol=1e-5)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)  # every worker holds the same weights


def test_fragments_is_a_tfdist_train_config_key():
    from tfdist.config import strategy_option_names

    assert "fragments" in strategy_option_names("model_average")


def test_fit_still_checks_the_global_batch(logical_cpus):
    """keras_check_call keeps the data-parallel checks (a batch the replicas cannot split)."""
    import keras

    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=2, fragments=2)
    x, y = linear_data(n=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(LR), "mse")
    with pytest.raises(ValueError, match="batch"):
        model.fit(x, y, batch_size=15, epochs=1, verbose=0)
