"""Model averaging between averages: no collective, no waiting for a slower peer.

Two workers under tfdist.launch, period 8, worker 1 sleeping after each batch. The
count of cross-worker collectives in a non-averaging step (read from the traced step's
graph) must be zero, with each engine; a wide-margin wall-clock ratio backs it up. The
epoch's logs are the mean over workers; the per-step logs are each worker's own.
"""

import numpy as np
import pytest

from helpers import classification_data, mlp, require_horovod, run_cluster
from shared_launch import TEST_TIMEOUT, case, results as shared_results

PERIOD = 8
GLOBAL_BATCH = 16
SLEEP = 0.15


class _StepClock:
    """Keras callback: the time between batch ends, each batch's loss, and a sleep."""

    def __new__(cls, sleep):
        import time

        import keras

        class _Clock(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.intervals, self.losses, self._last = [], [], None

            def on_train_batch_begin(self, batch, logs=None):
                if self._last is None:
                    self._last = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.losses.append(float(logs["loss"]))
                if sleep:
                    time.sleep(sleep)
                now = time.perf_counter()
                self.intervals.append(now - self._last)
                self._last = now

        return _Clock()


def straggler_task(engine, period=PERIOD, sleep=SLEEP, epochs=2):
    """One worker of two: fits an MLP; worker 1 sleeps ``sleep`` s after each batch."""
    import keras

    import tfdist
    from tfdist.comm.collectives import train_step_collectives

    strategy = tfdist.ModelAverageStrategy(period=period, engine=engine)
    x, y = classification_data(n=256)
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    clock = _StepClock(sleep if strategy.rank == 1 else 0.0)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[clock])
    count = train_step_collectives(model)
    # Interval i ends with optimizer step i + 1; the first one includes tracing.
    inner = [t for i, t in enumerate(clock.intervals)
             if i > 0 and (i + 1) % period and (i % (len(x) // GLOBAL_BATCH))]
    return {"engine": strategy.engine, "every_step": count.every_step,
            "in_branches": count.in_branches, "op_types": count.op_types,
            "median_inner": float(np.median(inner)), "losses": clock.losses,
            "history": history.history, "weights": model.get_weights()}


def _check(results, engine):
    fast, slow = results
    for result in results:
        assert result["engine"] == engine
        # The count: a non-averaging step issues no collective; the average does.
        assert result["every_step"] == 0, result
        assert result["in_branches"] > 0, result
    # Epoch logs: the same mean over workers on both; per-step logs: each its own.
    for key in fast["history"]:
        np.testing.assert_allclose(fast["history"][key], slow["history"][key], rtol=1e-6)
    assert fast["losses"] != slow["losses"]
    for a, b in zip(fast["weights"], slow["weights"]):
        np.testing.assert_array_equal(a, b)  # fit ends with one model
    # Backed by time, with a wide margin: the fast worker does not wait for the sleeper.
    assert fast["median_inner"] < 0.5 * slow["median_inner"], (
        fast["median_inner"], slow["median_inner"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_straggler_costs_the_fast_worker_nothing_between_averages_tf():
    _check(run_cluster(straggler_task, "tf", workers=2, timeout=240), "tf")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_straggler_costs_the_fast_worker_nothing_between_averages_horovod():
    require_horovod()
    _check(run_cluster(straggler_task, "horovod", workers=2, timeout=240), "horovod")


def uneven_task(n):
    """One worker of two: an epoch whose last global batch has one sample."""
    import keras

    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=4)
    x, y = classification_data(n=n)
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return {"steps": int(model.optimizer.iterations.numpy()), "history": history.history}


case("auto", "model_average uneven last batch", uneven_task, 241)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_last_batch_for_one_worker_only_keeps_the_workers_in_step():
    """241 samples, global batch 16: the last batch is one sample, so one worker gets an
    empty batch; without the per-batch agreement both still take 16 steps an epoch."""
    first, second = shared_results("auto", "model_average uneven last batch")
    assert first["steps"] == second["steps"] == 32
    assert first["history"] == second["history"]
