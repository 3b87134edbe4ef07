"""``ModelAverageStrategy(fragments=F)`` (Streaming DiLoCo, ``sync_delay=0``) against a
numpy reference written from the algorithm, on 2 logical CPUs and on 2 workers.

Fragment ``f`` of the trainable variables (split in layer order into parts of about
equal bytes, a variable cut into row blocks where a boundary falls inside it) averages
``f * H / F`` steps into each period of ``H`` steps, with its own outer optimizer;
``fit`` ends with a full plain average.
"""

import numpy as np
import pytest

from helpers import assert_weights_close
from shared_launch import TEST_TIMEOUT, case, results as shared_results
from test_model_average import (LR, fit_linear, linear_data, mse_grads, numpy_local_sgd,
                                replica_batches)


def linear_parts(kernel_shape, fragments):
    """The linear model's fragments as ``(variable, start, stop)`` row blocks: float32
    kernel ``kernel_shape`` and bias ``[1]``, split by `split_fragments`."""
    from tfdist.comm.fragments import split_fragments

    rows = int(kernel_shape[0])
    split = split_fragments([4 * int(np.prod(kernel_shape)), 4], fragments, [rows, 1])
    return [[(p.variable, p.start, p.stop) for p in fragment] for fragment in split]


def np_outer_step(anchor, momentum, g, outer):
    """In place on the blocks: the plain average (``outer`` None: ``anchor - g``), or the
    Nesterov SGD outer step ``outer = (learning_rate, momentum)`` on the outer gradient."""
    if outer is None:
        anchor[...] = anchor - g
        return
    outer_lr, mu = np.float32(outer[0]), np.float32(outer[1])
    momentum[...] = mu * momentum - outer_lr * g
    anchor[...] = anchor + mu * momentum - outer_lr * g


def numpy_streaming_diloco(x, y, w0, b0, steps, period, fragments, warmup=0, replicas=2,
                           lr=LR, outer=None, delay=0, mix=1.0, saves=()):
    """Streaming DiLoCo for the linear model (kernel, bias).

    Each replica steps on its own data. After step ``s``, fragment ``f`` (its row
    blocks ``parts[f]``, `linear_parts`) is exchanged if ``s <= warmup`` or ``(s - warmup) % period == f *
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
    parts = linear_parts(w0.shape, fragments)
    pending = None  # (step that applies it, its row blocks)

    def apply(part):
        for i, a, b in part:
            for p in params:
                p[i][a:b] = mix * anchor[i][a:b] + (1 - mix) * p[i][a:b]

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
            for i, a, b in part:
                mean = np.mean([p[i][a:b] for p in params], axis=0)
                if outer is None:
                    anchor[i][a:b] = mean
                else:
                    np_outer_step(anchor[i][a:b], momentum[i][a:b], anchor[i][a:b] - mean,
                                  outer)
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


def _blocks(split):
    return [[(p.variable, p.start, p.stop) for p in fragment] for fragment in split]


@pytest.mark.unit
def test_split_fragments_by_bytes_in_order():
    from tfdist.comm.fragments import fragment_offset, split_fragments

    # Without rows (or with one row each) a fragment holds whole variables, as before.
    assert _blocks(split_fragments([12, 4], 2)) == [[(0, 0, 1)], [(1, 0, 1)]]
    assert _blocks(split_fragments([10, 10, 10, 10], 2, [1, 1, 1, 1])) == [
        [(0, 0, 1), (1, 0, 1)], [(2, 0, 1), (3, 0, 1)]]
    assert _blocks(split_fragments([100, 1, 1, 1], 3)) == [
        [(0, 0, 1)], [(1, 0, 1)], [(2, 0, 1), (3, 0, 1)]]
    assert _blocks(split_fragments([5], 1, [5])) == [[(0, 0, 5)]]
    # A boundary between variables stays there: every piece is whole.
    split = split_fragments([40, 40, 40, 40], 2, [10, 10, 10, 10])
    assert all(p.whole for fragment in split for p in fragment)
    assert _blocks(split) == [[(0, 0, 10), (1, 0, 10)], [(2, 0, 10), (3, 0, 10)]]
    # A boundary inside a variable cuts it between rows (the earlier row on a tie).
    assert _blocks(split_fragments([12, 4], 2, [3, 1])) == [[(0, 0, 2)],
                                                             [(0, 2, 3), (1, 0, 1)]]
    assert _blocks(split_fragments([100, 1, 1, 1], 3, [10, 1, 1, 1])) == [
        [(0, 0, 3)], [(0, 3, 7)], [(0, 7, 10), (1, 0, 1), (2, 0, 1), (3, 0, 1)]]
    with pytest.raises(ValueError, match="fragments=3"):
        split_fragments([1, 1], 3, [100, 100])
    with pytest.raises(ValueError, match="fragments=0"):
        split_fragments([1, 1], 0)
    assert [fragment_offset(f, 8, 4) for f in range(4)] == [0, 2, 4, 6]


@pytest.mark.unit
def test_split_fragments_cuts_a_dominant_variable_into_equal_row_blocks():
    """The digits CNN's variables (its dense kernel is 96% of the bytes): 4 fragments of
    about a quarter each; every row in exactly one piece; one-row variables never cut."""
    from tfdist.comm.fragments import split_fragments, variable_rows

    shapes = [(3, 3, 1, 32), (32,), (3, 3, 32, 64), (64,), (1600, 64), (64,), (64, 10),
              (10,), (), (1, 7)]
    sizes = [4 * int(np.prod(shape)) for shape in shapes]
    rows = [variable_rows(shape) for shape in shapes]
    assert rows[-2:] == [1, 1]
    split = split_fragments(sizes, 4, rows)
    sent = [sum(sizes[p.variable] * (p.stop - p.start) // p.rows for p in f) for f in split]
    assert sum(sent) == sum(sizes)
    assert max(sent) <= 0.26 * sum(sizes) and max(sent) - min(sent) <= 2 * 64 * 4
    covered = {}
    for fragment in split:
        for p in fragment:
            covered.setdefault(p.variable, []).extend(range(p.start, p.stop))
    assert covered == {i: list(range(r)) for i, r in enumerate(rows)}
    assert [p.variable for p in split[1]] == [4] and len(split[2]) == 1  # the kernel's rows
    assert all(p.whole for f in split for p in f if p.variable != 4)
    for count in (1, 2, 3, 4, 5, 10):  # never an empty fragment
        assert all(split_fragments(sizes, count, rows))
    assert _blocks(split_fragments(sizes, 10, [1] * 10)) == [[(i, 0, 1)] for i in range(10)]


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


FRAGMENT_CASES = [(False, "tf"), (True, "tf"), (True, "horovod")]
for _outer, _engine in FRAGMENT_CASES:
    case(_engine, f"fragments outer={_outer}", _worker_fragments, _outer, _engine)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("outer,engine", FRAGMENT_CASES)
def test_two_workers_fragments_match_numpy(outer, engine):
    results = shared_results(engine, f"fragments outer={outer}")
    x, y = linear_data(n=80)
    initial = results[0]["initial"]
    ref = numpy_streaming_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=2, outer=(0.7, 0.9) if outer else None)
    for result in results:
        assert_weights_close(result["weights"], ref, atol=1e-5)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)  # every worker holds the same weights


@pytest.mark.unit
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
