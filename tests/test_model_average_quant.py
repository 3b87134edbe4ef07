"""``ModelAverageStrategy(outer_compression=...)``: quantised outer gradients with error
feedback, against numpy references of the same quantiser and of DiLoCo with it.

The numpy quantiser (chunks, scales, rounding half to even, int4 packing) is checked
bit for bit against `tfdist.comm.quantize`; local SGD / DiLoCo with the quantised
exchange is checked on 2 logical CPUs and on 2 workers with both engines, with the
bytes counted from shapes and the chunk size.
"""

import math

import numpy as np
import pytest

from helpers import assert_weights_close
from shared_launch import TEST_TIMEOUT, case, results as shared_results
from test_model_average import LR, fit_linear, linear_data, replica_batches
from test_model_average_fragments import linear_parts, np_outer_step, numpy_streaming_diloco

LEVELS = {"int8": 127, "int4": 7}
CAST = {"fp16": np.float16}


# ---- numpy references -----------------------------------------------------------------------

def np_quantize(x, name, chunk=1024):
    """Returns ``(payload bytes, scales, dequantised)`` of a flat float32 array."""
    x = np.asarray(x, np.float32).reshape(-1)
    n = len(x)
    if name in CAST:
        wire = x.astype(CAST[name])
        return wire.view(np.uint8), np.zeros(0, np.float32), wire.astype(np.float32)
    levels = np.float32(LEVELS[name])
    chunks = -(-n // chunk)
    padded = np.zeros(chunks * chunk, np.float32)
    padded[:n] = x
    padded = padded.reshape(chunks, chunk)
    finite = np.isfinite(padded).all(axis=1)
    absmax = np.where(np.isfinite(padded), np.abs(padded), 0).max(axis=1).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.where(finite, absmax / levels, np.nan).astype(np.float32)
        ok = (finite & (scale > 0))[:, None]
        q = np.where(ok, np.round(padded / np.where(ok, scale[:, None], 1)), 0)
    q = np.clip(q, -levels, levels).astype(np.float32)
    deq = (q * scale[:, None]).astype(np.float32).reshape(-1)[:n]
    q = q.reshape(-1)[:n].astype(np.int8)
    if name == "int8":
        payload = q.view(np.uint8)
    else:
        nibbles = (np.pad(q, (0, n % 2)) + 8).astype(np.uint8)
        payload = nibbles[0::2] | (nibbles[1::2] << 4)
    return payload, scale, deq


def np_error_feedback(delta, residual, name, chunk=1024):
    """One replica's exchange: ``(dequantised part, new residual)``."""
    total = (delta + residual).astype(np.float32)
    deq = np_quantize(total, name, chunk)[2].reshape(total.shape)
    return deq, (total - deq).astype(np.float32)


def mse_grads32(w, b, x, y):
    err = x @ w + b - y
    return (np.float32(2) * x.T @ err / np.float32(len(x)),
            np.float32(2) * err.sum(axis=0) / np.float32(len(x)))


def numpy_quantized_diloco(x, y, w0, b0, steps, period, fragments, name, replicas=2,
                           lr=LR, outer=None, delay=0, mix=1.0, saves=()):
    """Local SGD / (Streaming) DiLoCo for the linear model in float32, each fragment's
    outer gradient sent quantised with error feedback (the mean of the dequantised
    parts, summed in replica order), applied ``delay`` steps later as
    ``mix * anchor + (1 - mix) * w``; at the end an exchange in flight is applied, then
    an exact average of ``delta + residual`` (the forced average that ends ``fit``).
    After each step in ``saves`` (a backup) the same: the exchange in flight is applied,
    then the exact average sets the anchor and every replica, and zeroes the residuals."""
    f32 = np.float32
    params = [[w0.astype(f32).copy(), b0.astype(f32).copy()] for _ in range(replicas)]
    anchor = [w0.astype(f32).copy(), b0.astype(f32).copy()]
    momentum = [np.zeros_like(a) for a in anchor]
    residual = [[np.zeros_like(a) for a in anchor] for _ in range(replicas)]
    parts = linear_parts(w0.shape, fragments)
    pending = None  # (step that applies it, its row blocks)

    def apply(part):
        for i, a, b in part:
            for p in params:
                p[i][a:b] = f32(mix) * anchor[i][a:b] + f32(1 - mix) * p[i][a:b] \
                    if mix != 1 else anchor[i][a:b]

    for step in range(steps):
        for r, (xr, yr) in enumerate(replica_batches(x, y, step, replicas)):
            gw, gb = mse_grads32(params[r][0], params[r][1], xr, yr)
            params[r] = [params[r][0] - f32(lr) * gw, params[r][1] - f32(lr) * gb]
        s = step + 1
        if pending is not None and pending[0] == s:
            apply(pending[1])
            pending = None
        for f, part in enumerate(parts):
            if s % period != f * period // fragments:
                continue
            for i, a, b in part:  # each row block quantised on its own
                total = np.zeros_like(anchor[i][a:b])
                for r in range(replicas):
                    deq, residual[r][i][a:b] = np_error_feedback(
                        anchor[i][a:b] - params[r][i][a:b], residual[r][i][a:b], name)
                    total = total + deq
                g = total / f32(replicas)
                np_outer_step(anchor[i][a:b], momentum[i][a:b], g, outer)
            pending = (s + delay, part)
            if delay == 0:
                apply(part)
                pending = None
        if s in saves:
            if pending is not None:
                apply(pending[1])
                pending = None
            for i in range(2):
                anchor[i] = anchor[i] - np.mean([anchor[i] - p[i] + residual[r][i]
                                                 for r, p in enumerate(params)], axis=0)
                for r, p in enumerate(params):
                    p[i] = anchor[i].copy()
                    residual[r][i] = np.zeros_like(anchor[i])
    if pending is not None:
        apply(pending[1])
    return [anchor[i] - np.mean([anchor[i] - p[i] + residual[r][i]
                                 for r, p in enumerate(params)], axis=0) for i in range(2)]


def wide_data(features=1500, n=80):
    """Linear data with more than one chunk per kernel (inputs scaled for a stable lr)."""
    x, y = linear_data(n=n, features=features)
    return (x / np.float32(math.sqrt(features))).astype("float32"), y


def exchange_bytes(name, sizes, chunk=1024):
    """One replica's bytes per exchange, by hand: payload padded to 4, 4 per scale."""
    payload = sum(n if name == "int8" else (n + 1) // 2 if name == "int4" else 2 * n
                  for n in sizes)
    scales = sum(-(-n // chunk) for n in sizes) if name in LEVELS else 0
    return 4 * math.ceil(payload / 4) + 4 * scales


def expected_bytes(name, features, steps, period, fragments):
    """Bytes of a run: each fragment's exchanges (one quantised tensor per row block),
    then the final exact float32 flush."""
    parts = linear_parts((features, 1), fragments)
    total = 0
    for s in range(1, steps + 1):
        for f, part in enumerate(parts):
            if s % period == f * period // fragments:
                total += exchange_bytes(name, [b - a for _, a, b in part])
    return total + 4 * (features + 1)


# ---- the quantiser, in process ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "bf16"])
@pytest.mark.parametrize("n,chunk", [(1, 1024), (7, 4), (2500, 1024), (33, 16)])
def test_quantizer_matches_numpy_bit_for_bit(name, n, chunk):
    import dataclasses

    import tensorflow as tf

    from tfdist.comm.quantize import get_quantizer

    quantizer = dataclasses.replace(get_quantizer(name), chunk=chunk)
    rng = np.random.default_rng(n)
    x = (rng.normal(size=n) * rng.choice([1e-3, 1.0, 50.0], size=n)).astype(np.float32)
    if n > chunk:
        x[:chunk] = 0.0  # an all-zero chunk: scale 0, values 0
    payload, scales, deq = (t.numpy() for t in quantizer.encode(tf.constant(x)))
    if name == "bf16":  # numpy has no bfloat16: check the cast itself
        np.testing.assert_array_equal(deq, tf.cast(tf.cast(x, tf.bfloat16), tf.float32))
    else:
        ref = np_quantize(x, name, chunk)
        np.testing.assert_array_equal(payload, ref[0])
        np.testing.assert_array_equal(scales, ref[1])
        np.testing.assert_array_equal(deq, ref[2])
    decoded = quantizer.decode(tf.constant(payload), tf.constant(scales), n).numpy()
    np.testing.assert_array_equal(decoded, deq)
    assert len(payload) == quantizer.payload_bytes(n)
    if name in LEVELS:
        assert np.abs(deq - x).max() <= np.abs(x).max() / LEVELS[name] / 2 * 1.0001


@pytest.mark.parametrize("name", ["int8", "int4", "fp16"])
def test_pack_unpack_and_wire_bytes(name):
    import tensorflow as tf

    from tfdist.comm.quantize import get_quantizer

    quantizer = get_quantizer(name)
    rng = np.random.default_rng(1)
    tensors = [rng.normal(size=s).astype(np.float32) for s in ((3, 1), (1,), (40, 55))]
    words, dequantised = quantizer.pack([tf.constant(t) for t in tensors])
    assert words.dtype == tf.int32
    sizes = [t.size for t in tensors]
    assert 4 * int(words.shape[0]) == quantizer.wire_bytes(sizes) == exchange_bytes(name, sizes)
    for got, back, t in zip(dequantised, quantizer.unpack(words, [t.shape for t in tensors]),
                            tensors):
        np.testing.assert_array_equal(got.numpy(), back.numpy())
        np.testing.assert_array_equal(back.numpy(), np_quantize(t, name)[2].reshape(t.shape))


def test_non_finite_values_reach_every_replica():
    """A chunk with NaN or inf gets a NaN scale: the NaN crosses the wire (StopOnNaN)."""
    import tensorflow as tf

    from tfdist.comm.quantize import get_quantizer

    x = np.ones(2000, np.float32)
    x[5], x[1500] = np.nan, np.inf
    for name in ("int8", "int4"):
        _, scales, deq = (t.numpy() for t in get_quantizer(name).encode(tf.constant(x)))
        assert np.isnan(scales).all() and np.isnan(deq).all()
        np.testing.assert_array_equal(deq, np_quantize(x, name)[2])


@pytest.mark.unit
def test_error_feedback_carries_the_rounding():
    """Summed over exchanges, what is sent equals what was owed minus the residual."""
    rng = np.random.default_rng(2)
    residual = np.zeros(50, np.float32)
    owed, sent = np.zeros(50, np.float64), np.zeros(50, np.float64)
    for _ in range(20):
        delta = rng.normal(size=50).astype(np.float32)
        deq, residual = np_error_feedback(delta, residual, "int4")
        owed += delta
        sent += deq
    np.testing.assert_allclose(sent + residual, owed, atol=1e-4)


def test_bad_outer_compression_is_one_value_error():
    import tfdist

    with pytest.raises(ValueError, match=r"outer_compression must be one of \[None, 'fp16', "
                                         r"'bf16', 'int8', 'int4'\]. Received: "
                                         r"outer_compression='int2'"):
        tfdist.ModelAverageStrategy(period=4, outer_compression="int2")
    with pytest.raises(ValueError, match="compression='fp16', outer_compression='int8'"):
        tfdist.ModelAverageStrategy(period=4, compression="fp16", outer_compression="int8")
    with pytest.raises(ValueError, match="outer_compression"):
        tfdist.ModelAverageStrategy(
            period=4, outer_compression="int4",
            communication_options=tfdist.CommunicationOptions(compression="bf16"))


@pytest.mark.unit
def test_outer_compression_is_a_tfdist_train_config_key():
    from tfdist.config import strategy_option_names

    assert "outer_compression" in strategy_option_names("model_average")


# ---- training, 2 logical CPUs ---------------------------------------------------------------

def _outer():
    import keras

    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize("name,fragments,outer", [("int8", 1, False), ("int4", 2, True),
                                                  ("fp16", 2, False)])
def test_quantized_diloco_matches_numpy(logical_cpus, name, fragments, outer):
    import tfdist

    x, y = wide_data()
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=fragments,
                                           outer_compression=name,
                                           outer_optimizer=_outer if outer else None)
    initial, model = fit_linear(strategy, x, y, epochs=2)  # 10 steps
    ref = numpy_quantized_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=fragments, name=name,
                                 outer=(0.7, 0.9) if outer else None)
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    exact = numpy_streaming_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                   fragments=fragments, outer=(0.7, 0.9) if outer else None)
    assert max(np.abs(a - b).max() for a, b in zip(ref, exact)) > 1e-5  # it quantised
    assert strategy.bytes_communicated == expected_bytes(name, 1500, 10, 4, fragments)
    state = strategy.averaging_state(model.optimizer)
    for variable in model.trainable_weights + state.residuals:  # one model, flushed
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
    assert not any(np.any(r.numpy()) for r in state.residuals)


@pytest.mark.parametrize("name,delay,mix", [("int4", 1, 0.5), ("int8", 1, 1.0)])
def test_quantized_overlapped_syncs_match_numpy(logical_cpus, name, delay, mix):
    """With ``sync_delay``/``mix`` the exchange runs on a thread: same quantiser, same
    residuals, flushed at the end after the exchange in flight is applied."""
    import tfdist

    x, y = wide_data()
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, sync_delay=delay, mix=mix,
                                           outer_compression=name, outer_optimizer=_outer)
    initial, model = fit_linear(strategy, x, y, epochs=2)
    ref = numpy_quantized_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=2, name=name, outer=(0.7, 0.9), delay=delay,
                                 mix=mix)
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    assert strategy.bytes_communicated == expected_bytes(name, 1500, 10, 4, 2)
    for variable in model.trainable_weights:
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])


def test_bytes_shrink_by_the_claimed_factor(logical_cpus):
    import tfdist

    x, y = wide_data(features=4096)
    counted = {}
    for name in (None, "int8", "int4"):
        strategy = tfdist.ModelAverageStrategy(period=4, outer_compression=name)
        fit_linear(strategy, x, y, epochs=1)  # 5 steps: one scheduled average
        counted[name] = strategy.bytes_communicated
    flush = 4 * (4096 + 1)  # the forced average that ends fit is exact
    assert counted[None] == 2 * flush
    assert counted["int8"] - flush == 4 * math.ceil(4097 / 4) + 4 * (4 + 1)
    assert counted["int4"] - flush == 4 * math.ceil((2048 + 1) / 4) + 4 * (4 + 1)
    assert 3.9 < flush / (counted["int8"] - flush) < 4
    assert 7.8 < flush / (counted["int4"] - flush) < 8


def test_forced_average_flushes_on_a_scheduled_step(logical_cpus):
    """``average`` runs at a scheduled average step too: it sends the residuals."""
    import tfdist

    x, y = wide_data()
    strategy = tfdist.ModelAverageStrategy(period=5, outer_compression="int4")
    initial, model = fit_linear(strategy, x, y, epochs=1)  # 5 steps: fit ends averaged
    ref = numpy_quantized_diloco(x, y, initial[0], initial[1], steps=5, period=5,
                                 fragments=1, name="int4")
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    state = strategy.averaging_state(model.optimizer)
    assert not any(np.any(r.numpy()) for r in state.residuals)
    assert strategy.average(model) is False  # flushed at this step already


def test_evaluate_averages_compressed_and_a_save_flushes(logical_cpus, tmp_path):
    """Before evaluate (and so each validation) the forced average is a compressed
    exchange with error feedback; before a save it is exact and zeroes the residuals."""
    import tfdist

    x, y = wide_data()
    strategy = tfdist.ModelAverageStrategy(period=4, outer_compression="int4")
    _, model = fit_linear(strategy, x, y, epochs=1)  # 5 steps; fit's end flushes
    state = strategy.averaging_state(model.optimizer)
    model.train_on_batch(x[:16], y[:16])  # step 6: local, no average
    before = strategy.bytes_communicated
    model.evaluate(x, y, batch_size=16, verbose=0)
    assert strategy.bytes_communicated - before == exchange_bytes("int4", [1500, 1])
    assert any(np.any(r.numpy()) for r in state.residuals)  # the rounding is carried
    for variable in model.trainable_variables:  # one model on both replicas
        first, second = strategy.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy())
    before = strategy.bytes_communicated
    model.save_weights(str(tmp_path / "w.weights.h5"))
    assert strategy.bytes_communicated - before == 4 * (1500 + 1)  # exact
    assert not any(np.any(r.numpy()) for r in state.residuals)
    before = strategy.bytes_communicated
    model.evaluate(x, y, batch_size=16, verbose=0)  # nothing ran since: no exchange
    assert strategy.bytes_communicated == before


# ---- 2 workers -------------------------------------------------------------------------------

def _worker(name, fragments, engine, delay):
    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=4, fragments=fragments, sync_delay=delay,
                                           outer_compression=name, engine=engine)
    x, y = wide_data()
    initial, model = fit_linear(strategy, x, y, epochs=2)
    return {"initial": initial, "weights": model.get_weights(),
            "bytes": strategy.bytes_communicated}


QUANT_CASES = [("int8", 1, "tf", 0), ("int4", 2, "tf", 0), ("int8", 2, "horovod", 0),
               ("int4", 1, "horovod", 0), ("int4", 2, "horovod", 1)]
for _args in QUANT_CASES:
    case(_args[2], f"quantized {_args}", _worker, *_args)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("name,fragments,engine,delay", QUANT_CASES)
def test_two_workers_quantized_match_numpy(name, fragments, engine, delay):
    results = shared_results(engine, f"quantized {(name, fragments, engine, delay)}")
    x, y = wide_data()
    initial = results[0]["initial"]
    ref = numpy_quantized_diloco(x, y, initial[0], initial[1], steps=10, period=4,
                                 fragments=fragments, name=name, delay=delay)
    for result in results:
        assert_weights_close(result["weights"], ref, atol=1e-5)
        assert result["bytes"] == expected_bytes(name, 1500, 10, 4, fragments)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)  # every worker holds the same weights


def test_backup_resumes_exactly_with_int4_fragments(logical_cpus, tmp_path):
    """Every backup flushes the residuals: a resume equals the uninterrupted run."""
    import keras

    import tfdist
    from test_model_average import GLOBAL_BATCH, _StopAfterEpoch, linear_model
    from tfdist.keras.callbacks import BackupAndRestore

    x, y = wide_data(n=64)  # 4 steps an epoch, epochs end mid-period

    def run(backup_dir, interrupt_after=None):
        strategy = tfdist.ModelAverageStrategy(period=8, fragments=2,
                                               outer_compression="int4",
                                               outer_optimizer=_outer)
        with strategy.scope():
            model = linear_model(x.shape[1])
            model.compile(keras.optimizers.SGD(LR), "mse")
        callbacks = [BackupAndRestore(str(backup_dir))]
        if interrupt_after is not None:
            callbacks.append(_StopAfterEpoch(interrupt_after))
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return model

    straight = run(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", interrupt_after=1)
    resumed = run(tmp_path / "resumed")
    assert int(resumed.optimizer.iterations.numpy()) == 12
    assert_weights_close(resumed.get_weights(), straight.get_weights(), atol=1e-5)


def test_accounted_all_gather_counts_one_replica_part(logical_cpus):
    import tensorflow as tf

    import tfdist
    from tfdist.comm.communicator import Accounted, Communicator, StrategyCommunicator

    strategy = tfdist.MirroredStrategy()
    communicator = Accounted(StrategyCommunicator())
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([3], ctx.replica_id_in_sync_group + 1))

    @tf.function
    def gather():
        return communicator.all_gather(strategy, value)

    np.testing.assert_array_equal(gather().numpy(), [1, 1, 1, 2, 2, 2])
    assert communicator.bytes == 12  # one replica's int32[3]

    class ReduceOnly(Communicator):
        def all_reduce(self, distribution, values, destinations, op="mean"):
            return values

    with pytest.raises(NotImplementedError, match="ReduceOnly cannot all-gather"):
        Accounted(ReduceOnly()).all_gather(strategy, value)
