"""``ModelAverageStrategy(fragments=F, sync_delay=τ, mix=α)`` (Streaming DiLoCo's
overlapped syncs) against the numpy reference of tests/test_model_average_fragments.py,
on 2 logical CPUs and on 2 workers with each engine; its bad input; the count of
collectives (none in the traced step) and of exchanges (by their bytes).

A fragment's exchange starts at its step, runs on a thread while the worker takes τ
more steps, and is applied after step s + τ as ``α * global + (1 - α) * local``.
"""

import numpy as np
import pytest

from helpers import assert_weights_close, run_cluster
from shared_launch import TEST_TIMEOUT, case, results as shared_results
from test_model_average import LR, fit_linear, linear_data
from test_model_average_fragments import linear_parts, numpy_streaming_diloco

STEPS = 10  # 80 samples, global batch 16: 5 steps an epoch, 2 epochs
KERNEL_BYTES, BIAS_BYTES = 12, 4  # the linear model's variables (float32 [3, 1] and [1])


def _outer():
    import keras

    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def expected_bytes(steps, period, fragments):
    """One payload per fragment exchange (2 fragments: the kernel's first 2 rows, then
    its last row and the bias; 1: both variables), plus the final forced average."""
    sizes = [4 * sum(b - a for _, a, b in part) for part in linear_parts((3, 1), fragments)]
    exchanges = sum(size for s in range(1, steps + 1) for f, size in enumerate(sizes)
                    if s % period == f * period // fragments)
    return exchanges + KERNEL_BYTES + BIAS_BYTES


def _reference(initial, period, fragments, delay, mix, outer):
    x, y = linear_data(n=80)
    return numpy_streaming_diloco(x, y, initial[0], initial[1], steps=STEPS, period=period,
                                  fragments=fragments, delay=delay, mix=mix,
                                  outer=(0.7, 0.9) if outer else None)


def test_bad_delay_and_mix_are_one_value_error_before_anything_runs(logical_cpus):
    import keras

    import tfdist

    bad = [({"period": 4, "fragments": 2, "sync_delay": 2}, "sync_delay=2, period=4"),
           ({"period": 4, "sync_delay": -1}, "sync_delay=-1"),
           ({"period": 4, "sync_delay": 1.5}, "sync_delay=1.5"),
           ({"period": 4, "mix": 1.5}, "mix=1.5"),
           ({"period": 4, "mix": -0.1}, "mix=-0.1"),
           ({"period": 4, "mix": "half"}, "mix='half'"),
           ({"period": 4, "sync_delay": 1, "warmup_steps": 2}, "warmup_steps=2"),
           ({"period": 4, "mix": 0.5, "average_optimizer_state": True},
            "average_optimizer_state=True")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            tfdist.ModelAverageStrategy(**kwargs)
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, sync_delay=1)
    x, y = linear_data(n=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(LR), "mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=2, sync_delay=1"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("period,fragments,delay,mix,outer", [
    (4, 2, 1, 1.0, False), (4, 2, 1, 0.5, True), (8, 2, 3, 0.5, False),
    (4, 1, 2, 1.0, True), (4, 2, 0, 0.5, False)])
def test_delay_and_mix_match_numpy_streaming_diloco(logical_cpus, period, fragments, delay,
                                                     mix, outer):
    import tfdist
    from tfdist.comm.collectives import train_step_collectives

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(period=period, fragments=fragments,
                                           sync_delay=delay, mix=mix,
                                           outer_optimizer=_outer if outer else None)
    initial, model = fit_linear(strategy, x, y, epochs=2)
    ref = _reference(initial, period, fragments, delay, mix, outer)
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    today = _reference(initial, period, fragments, 0, 1.0, outer)
    assert max(np.abs(a - b).max() for a, b in zip(ref, today)) > 1e-4  # they differ
    for variable in model.trainable_weights:  # one model after fit
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
    assert strategy.bytes_communicated == expected_bytes(STEPS, period, fragments)
    count = train_step_collectives(model)
    assert (count.every_step, count.in_branches) == (0, 0)  # nothing in the traced step


def test_a_save_or_evaluate_completes_the_exchange_in_flight(logical_cpus, tmp_path):
    """A save or an evaluate at a step whose exchange is in flight applies it first,
    then averages: the reference with a forced average at that step."""
    import keras

    import tfdist

    class SaveAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step == 2:  # fragment 1 starts
                self.model.save_weights(str(tmp_path / "w.weights.h5"))
            if step == 4:  # fragment 0 starts
                self.model.evaluate(x[:16], y[:16], batch_size=16, verbose=0)

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, sync_delay=1, mix=0.5)
    initial, model = fit_linear(strategy, x, y, epochs=2, callbacks=[SaveAt()])
    ref = numpy_streaming_diloco(x, y, initial[0], initial[1], steps=STEPS, period=4,
                                 fragments=2, delay=1, mix=0.5, saves=(2, 4))
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    no_saves = _reference(initial, 4, 2, 1, 0.5, False)
    assert max(np.abs(a - b).max() for a, b in zip(ref, no_saves)) > 1e-4


def _worker_delay(engine, period, fragments, delay, mix, outer):
    import tfdist
    from tfdist.comm.collectives import train_step_collectives

    strategy = tfdist.ModelAverageStrategy(period=period, fragments=fragments,
                                           sync_delay=delay, mix=mix, engine=engine,
                                           outer_optimizer=_outer if outer else None)
    x, y = linear_data(n=80)
    initial, model = fit_linear(strategy, x, y, epochs=2)
    count = train_step_collectives(model)
    return {"initial": initial, "weights": model.get_weights(), "engine": strategy.engine,
            "bytes": strategy.bytes_communicated,
            "count": (count.every_step, count.in_branches)}


DELAY_CASES = [("tf", 4, 2, 1, 0.5, True), ("horovod", 8, 2, 2, 1.0, False)]
for _args in DELAY_CASES:
    case(_args[0], f"delay {_args}", _worker_delay, *_args)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("engine,period,fragments,delay,mix,outer", DELAY_CASES)
def test_two_workers_delay_and_mix_match_numpy(engine, period, fragments, delay, mix, outer):
    results = shared_results(engine, f"delay {(engine, period, fragments, delay, mix, outer)}")
    ref = _reference(results[0]["initial"], period, fragments, delay, mix, outer)
    for result in results:
        assert result["engine"] == engine
        assert_weights_close(result["weights"], ref, atol=1e-5)
        assert result["count"] == (0, 0)
        assert result["bytes"] == expected_bytes(STEPS, period, fragments)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)  # every worker holds the same weights


@pytest.mark.unit
def test_delay_and_mix_are_tfdist_train_config_keys():
    from tfdist.config import strategy_option_names

    assert {"sync_delay", "mix"} <= strategy_option_names("model_average")


def _resume_task(result_dir, kill_at, outer_compression=None):
    """3 epochs of 5 steps with BackupAndRestore; worker-1 SIGKILLs itself after step
    ``kill_at`` of the first attempt, with its fragment's exchange in flight."""
    import os
    import signal

    import keras

    import tfdist
    from tfdist.keras import callbacks as cbs

    me, attempt = os.environ["TFDIST_TASK"], int(os.environ["TFDIST_RESTART"])
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, sync_delay=1, mix=0.5,
                                           outer_compression=outer_compression,
                                           startup_timeout=60, collective_timeout=60)

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (attempt == 0 and me == "worker-1"
                    and int(self.model.optimizer.iterations.numpy()) == kill_at):
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = linear_data(n=80)
    initial, model = fit_linear(strategy, x, y, epochs=3,
                                callbacks=[cbs.BackupAndRestore(), Kill()])
    return {"task": me, "attempt": attempt, "initial": initial,
            "weights": model.get_weights(),
            "iterations": int(model.optimizer.iterations.numpy())}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_kill_with_an_exchange_in_flight_resumes_to_uninterrupted_weights(tmp_path, capfd):
    """Worker-1 dies after step 6 (fragment 1's exchange started there, due after step
    7); the restarted job resumes from the backup of epoch 1 (step 5, saved after the
    exchange then in flight was applied) and ends at the uninterrupted run's weights,
    whose saves at steps 5 and 10 apply the exchange in flight and average (with int4:
    exactly, flushing the error-feedback residuals, so the backup holds them all).
    One case (int4) covers both: the exchange in flight and the residuals."""
    outer_compression = "int4"
    results = run_cluster(_resume_task, str(tmp_path), 6, outer_compression, timeout=280,
                          stream=None, max_restarts=1, backup_dir=str(tmp_path / "backup"))
    log = capfd.readouterr().err
    assert "restart 1/1: worker-1 exited with code -9 (signal SIGKILL)" in log, log[-2000:]
    x, y = linear_data(n=80)
    initial = results[0]["initial"]
    from test_model_average_quant import numpy_quantized_diloco

    ref = numpy_quantized_diloco(x, y, initial[0], initial[1], steps=15, period=4,
                                 fragments=2, name=outer_compression, delay=1, mix=0.5,
                                 saves=(5, 10))
    for result in results:
        assert result["attempt"] == 1 and result["iterations"] == 15, result
        assert_weights_close(result["weights"], ref, atol=1e-5)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)
