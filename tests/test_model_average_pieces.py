"""Fragments that cut a variable into row blocks, against a numpy reference: a two-layer
linear network whose first kernel is 93% of the bytes, 4 fragments (three of them rows
of that kernel only), on 2 logical CPUs and on 2 workers with each engine.

Each row block has its own anchor (and error-feedback residual): its outer gradient is
``anchor - w[start:stop]``, its outer optimizer is its fragment's, and the average
writes back those rows only.
"""

import numpy as np
import pytest

from helpers import assert_weights_close
from shared_launch import TEST_TIMEOUT, case, results as shared_results
from test_model_average import GLOBAL_BATCH, LR, linear_data, replica_batches
from test_model_average_fragments import np_outer_step
from test_model_average_quant import np_error_feedback

FEATURES, HIDDEN = 30, 8
STEPS, PERIOD, FRAGMENTS = 20, 8, 4  # 160 samples, global batch 16: 10 steps an epoch
SHAPES = [(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, 1), (1,)]
# The split the strategy makes (checked below): the first kernel's rows in 4 blocks.
PARTS = [[(0, 0, 8)], [(0, 8, 16)], [(0, 16, 24)], [(0, 24, 30), (1, 0, 8), (2, 0, 8),
                                                   (3, 0, 1)]]


def split_parts():
    """``PARTS`` as `split_fragments` makes them for the network's float32 variables."""
    from tfdist.comm.fragments import split_fragments, variable_rows

    split = split_fragments([4 * int(np.prod(s)) for s in SHAPES], FRAGMENTS,
                            [variable_rows(s) for s in SHAPES])
    return [[(p.variable, p.start, p.stop) for p in fragment] for fragment in split]


def grads(params, x, y):
    """Float32 gradients of the mean squared error of ``(x @ w1 + b1) @ w2 + b2``."""
    w1, b1, w2, b2 = params
    h = x @ w1 + b1
    d_out = np.float32(2) * (h @ w2 + b2 - y) / np.float32(len(x))
    d_h = d_out @ w2.T
    return [x.T @ d_h, d_h.sum(axis=0), h.T @ d_out, d_out.sum(axis=0)]


def numpy_pieces_diloco(x, y, initial, parts, steps, period, replicas=2, lr=LR,
                        outer=None, delay=0, mix=1.0, name=None):
    """Streaming DiLoCo in float32 over row blocks ``parts[f]`` of fragment ``f``.

    After step ``s``, fragment ``f`` is exchanged if ``s % period == f * period / F``:
    for each block, the mean over replicas of ``anchor - w`` (with ``name``, each
    replica's ``delta + residual`` quantised on its own, the residual kept) steps the
    block's anchor (plain, or Keras' Nesterov SGD with ``outer=(lr, momentum)``); it is
    applied ``delay`` steps later as ``mix * anchor + (1 - mix) * w``. At the end the
    exchange in flight is applied, then the exact mean of ``anchor - w + residual``.
    """
    f32 = np.float32
    params = [[w.astype(f32).copy() for w in initial] for _ in range(replicas)]
    anchor = [w.astype(f32).copy() for w in initial]
    momentum = [np.zeros_like(a) for a in anchor]
    residual = [[np.zeros_like(a) for a in anchor] for _ in range(replicas)]
    pending = None  # (step that applies it, its blocks)

    def apply(part):
        for i, a, b in part:
            for p in params:
                p[i][a:b] = (f32(mix) * anchor[i][a:b] + f32(1 - mix) * p[i][a:b]
                             if mix != 1 else anchor[i][a:b])

    for step in range(steps):
        for r, (xr, yr) in enumerate(replica_batches(x, y, step, replicas)):
            params[r] = [w - f32(lr) * g for w, g in zip(params[r], grads(params[r], xr, yr))]
        s = step + 1
        if pending is not None and pending[0] == s:
            apply(pending[1])
            pending = None
        for f, part in enumerate(parts):
            if s % period != f * period // len(parts):
                continue
            for i, a, b in part:
                deltas = []
                for r in range(replicas):
                    delta = anchor[i][a:b] - params[r][i][a:b]
                    if name is not None:
                        delta, residual[r][i][a:b] = np_error_feedback(
                            delta, residual[r][i][a:b], name)
                    deltas.append(delta)
                g = sum(deltas[1:], deltas[0]) / f32(replicas)
                np_outer_step(anchor[i][a:b], momentum[i][a:b], g, outer)
            pending = (s + delay, part)
            if delay == 0:
                apply(part)
                pending = None
    if pending is not None:
        apply(pending[1])
    return [anchor[i] - np.mean([anchor[i] - p[i] + residual[r][i]
                                 for r, p in enumerate(params)], axis=0)
            for i in range(len(anchor))]


def _outer():
    import keras

    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def _fit(engine, delay, mix, outer, name):
    """Trains the network 2 epochs under the strategy; returns its weights and state."""
    import keras

    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=PERIOD, fragments=FRAGMENTS,
                                           sync_delay=delay, mix=mix, engine=engine,
                                           outer_compression=name,
                                           outer_optimizer=_outer if outer else None)
    x, y = linear_data(n=160, features=FEATURES)
    x = (x / np.float32(np.sqrt(FEATURES))).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(LR), "mse")
    initial = model.get_weights()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    state = strategy.averaging_state(model.optimizer)
    return {"initial": initial, "weights": model.get_weights(),
            "pieces": [[tuple(p[:3]) for p in f.pieces] for f in state.fragments],
            "anchors": [tuple(a.shape) for a in state.anchors],
            "outers": [int(o.iterations.numpy()) for o in strategy.outer_optimizers],
            "bytes": strategy.bytes_communicated}


def _check(results, delay, mix, outer, name):
    x, y = linear_data(n=160, features=FEATURES)
    x = (x / np.float32(np.sqrt(FEATURES))).astype("float32")
    ref = numpy_pieces_diloco(x, y, results[0]["initial"], PARTS, STEPS, PERIOD,
                              outer=(0.7, 0.9) if outer else None, delay=delay, mix=mix,
                              name=name)
    uncut = [[(i, 0, shape[0])] for i, shape in enumerate(SHAPES)]  # a variable each
    whole = numpy_pieces_diloco(x, y, results[0]["initial"], uncut, STEPS, PERIOD,
                                outer=(0.7, 0.9) if outer else None, delay=delay, mix=mix,
                                name=name)
    assert np.abs(ref[0] - whole[0]).max() > 1e-5  # the row blocks make a difference
    for result in results:
        assert result["pieces"] == PARTS
        assert result["anchors"] == [(8, 8), (8, 8), (8, 8), (6, 8), (8,), (8, 1), (1,)]
        if outer:
            assert result["outers"] == [2, 3, 3, 2]  # steps 8, 16 | 2, 10, 18 | ...
        assert_weights_close(result["weights"], ref, atol=1e-5)
    if name is None:  # one float32 payload per exchange of each fragment, then the flush
        sizes = [4 * sum((b - a) * int(np.prod(SHAPES[i][1:])) for i, a, b in part)
                 for part in PARTS]
        total = sum(sizes[f] for s in range(1, STEPS + 1) for f in range(FRAGMENTS)
                    if s % PERIOD == f * PERIOD // FRAGMENTS) + sum(sizes)
        assert all(r["bytes"] == total for r in results)


@pytest.mark.unit
def test_split_of_the_network_cuts_its_first_kernel():
    assert split_parts() == PARTS


@pytest.mark.parametrize("delay,mix,outer,name", [(0, 1.0, True, None),
                                                  (1, 0.5, False, "int8")])
def test_row_blocks_match_numpy(logical_cpus, delay, mix, outer, name):
    _check([_fit("tf", delay, mix, outer, name)], delay, mix, outer, name)


PIECE_CASES = [("tf", 1, 0.5, True, None), ("horovod", 1, 1.0, False, "int4")]
for _args in PIECE_CASES:
    case(_args[0], f"row blocks {_args}", _fit, *_args)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("engine,delay,mix,outer,name", PIECE_CASES)
def test_two_workers_row_blocks_match_numpy(engine, delay, mix, outer, name):
    results = shared_results(engine, f"row blocks {(engine, delay, mix, outer, name)}")
    _check(results, delay, mix, outer, name)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)  # every worker holds the same weights


def test_agreed_variables_are_those_every_row_of_which_was_averaged():
    """`StopOnNaN` checks only variables an exchange left equal on every worker."""

    from tfdist.comm.fragments import Piece
    from tfdist.strategies.averaging.fragment import agreed_variables

    pieces = [Piece(0, 0, 8, 30), Piece(0, 8, 30, 30), Piece(1, 0, 8, 8), Piece(2, 0, 1, 1)]
    variables = ["w1", "b1", "w2"]
    assert agreed_variables(pieces, variables, [0]) == []
    assert agreed_variables(pieces, variables, [1, 2, 3]) == ["b1", "w2"]
    assert agreed_variables(pieces, variables, range(4)) == ["w1", "b1", "w2"]
