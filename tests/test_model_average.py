"""tfdist.ModelAverageStrategy against synchronous training and numpy references.

In-process tests run on 2 logical CPUs; the multi-worker ones run 2 workers through
tfdist.launch. The reference for local SGD is the seeds' example: linear regression with
squared loss, each replica training on its own half of every global batch.
"""


import numpy as np
import pytest

from helpers import assert_weights_close, classification_data, mlp
from shared_launch import TEST_TIMEOUT, case, results as shared_results

GLOBAL_BATCH = 16
LR = 0.05


# ---- data, model and numpy references ----------------------------------------------------

def linear_data(n=80, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (x @ w + 0.5 + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def linear_model(features=3, seed=3):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(1)])


def replica_batches(x, y, step, replicas, global_batch=GLOBAL_BATCH):
    """Replica r's share of global batch ``step``: its contiguous 1/replicas of it
    (how tf.distribute splits a global batch on one host and across workers)."""
    steps_per_epoch = len(x) // global_batch
    start = (step % steps_per_epoch) * global_batch
    local = global_batch // replicas
    return [(x[start + r * local:start + (r + 1) * local],
             y[start + r * local:start + (r + 1) * local]) for r in range(replicas)]


def mse_grads(w, b, x, y):
    err = x @ w + b - y
    return 2.0 * x.T @ err / len(x), 2.0 * err.sum(axis=0) / len(x)


def numpy_local_sgd(x, y, w0, b0, steps, period, warmup=0, replicas=2, lr=LR,
                    outer=None):
    """Local SGD by hand: each replica steps on its own data; average on schedule; a
    final plain average at the end (as fit does). ``outer=(lr, momentum)`` applies
    Keras' Nesterov SGD to ``anchor - mean`` at each scheduled average."""
    w = [w0.astype("float64").copy() for _ in range(replicas)]
    b = [b0.astype("float64").copy() for _ in range(replicas)]
    anchor = [w0.astype("float64").copy(), b0.astype("float64").copy()]
    momentum = [np.zeros_like(anchor[0]), np.zeros_like(anchor[1])]
    for step in range(steps):
        for r, (xr, yr) in enumerate(replica_batches(x, y, step, replicas)):
            gw, gb = mse_grads(w[r], b[r], xr, yr)
            w[r] = w[r] - lr * gw
            b[r] = b[r] - lr * gb
        s = step + 1
        if s <= warmup or (s - warmup) % period == 0:
            mean = [np.mean(w, axis=0), np.mean(b, axis=0)]
            if outer is None:
                anchor = mean
            else:
                outer_lr, mu = outer
                for i in range(2):
                    g = anchor[i] - mean[i]
                    momentum[i] = mu * momentum[i] - outer_lr * g
                    anchor[i] = anchor[i] + mu * momentum[i] - outer_lr * g
            w = [anchor[0].copy() for _ in range(replicas)]
            b = [anchor[1].copy() for _ in range(replicas)]
    return [np.mean(w, axis=0), np.mean(b, axis=0)]


# ---- training helpers ----------------------------------------------------------------------

def fit_linear(strategy, x, y, epochs, optimizer=None, callbacks=(), steps_per_execution=1):
    """Trains `linear_model` under ``strategy``; ``optimizer`` is a factory (Keras
    optimizers must be made inside the scope)."""
    import keras

    with strategy.scope():
        model = linear_model(x.shape[1])
        model.compile(optimizer() if optimizer else keras.optimizers.SGD(LR), "mse",
                      steps_per_execution=steps_per_execution)
    initial = model.get_weights()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return initial, model


def fit_mlp(strategy, x, y, epochs=2):
    import keras

    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def replica_values(variable):
    """Every local replica's copy of a Keras variable, as numpy arrays."""
    return [np.array(c.numpy()) for c in variable.value.values]


class RecordReplicas:
    """Keras callback: each replica's copy of every weight after each batch."""

    def __new__(cls):
        import keras

        class _Record(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.steps = []

            def on_train_batch_end(self, batch, logs=None):
                self.steps.append([replica_values(v) for v in self.model.trainable_weights])

        return _Record()


# ---- single host, 2 logical CPUs -------------------------------------------------------

def test_period_1_equals_synchronous_mirrored(logical_cpus):
    import tfdist

    x, y = classification_data(n=64)
    got = fit_mlp(tfdist.ModelAverageStrategy(period=1), x, y).get_weights()
    ref = fit_mlp(tfdist.MirroredStrategy(), x, y).get_weights()
    assert_weights_close(got, ref, atol=1e-5)


@pytest.mark.parametrize("period,warmup,steps_per_execution", [(4, 0, 1), (3, 2, 3)])
def test_local_sgd_matches_numpy(logical_cpus, period, warmup, steps_per_execution):
    import tfdist

    x, y = linear_data(n=80)  # 5 steps an epoch; 10 steps end mid-period
    strategy = tfdist.ModelAverageStrategy(period=period, warmup_steps=warmup)
    assert strategy.num_replicas_in_sync == 2
    initial, model = fit_linear(strategy, x, y, epochs=2,
                                steps_per_execution=steps_per_execution)
    ref = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=period,
                          warmup=warmup)
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    # Not the synchronous answer: the schedule really is local.
    sync = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=1)
    assert np.abs(model.get_weights()[0] - sync[0]).max() > 1e-4


def test_replicas_diverge_between_averages_and_match_after(logical_cpus):
    import tfdist

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(period=4)
    record = RecordReplicas()
    _, model = fit_linear(strategy, x, y, epochs=2, callbacks=[record])
    assert len(record.steps) == 10
    for step, weights in enumerate(record.steps, start=1):
        for copies in weights:
            if step % 4 == 0:
                np.testing.assert_array_equal(copies[0], copies[1], err_msg=f"step {step}")
            else:
                assert np.abs(copies[0] - copies[1]).max() > 1e-4, f"step {step}"
    # fit ended at step 10, mid-period: it averaged before returning.
    for variable in model.trainable_weights:
        copies = replica_values(variable)
        np.testing.assert_array_equal(copies[0], copies[1])
    assert int(model.optimizer.iterations.numpy()) == 10


@pytest.mark.parametrize("form", ["instance", "function"])
def test_outer_nesterov_matches_numpy(logical_cpus, form):
    import keras

    import tfdist

    x, y = linear_data(n=64)  # 4 steps an epoch, 8 steps: averages at 4 and 8

    def outer():
        return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)

    strategy = tfdist.ModelAverageStrategy(
        period=4, outer_optimizer=outer() if form == "instance" else outer)
    initial, model = fit_linear(strategy, x, y, epochs=2)
    ref = numpy_local_sgd(x, y, initial[0], initial[1], steps=8, period=4,
                          outer=(0.7, 0.9))
    assert_weights_close(model.get_weights(), ref, atol=1e-5)
    plain = numpy_local_sgd(x, y, initial[0], initial[1], steps=8, period=4)
    assert np.abs(model.get_weights()[0] - plain[0]).max() > 1e-4
    (outer,) = strategy.outer_optimizers
    assert int(outer.iterations.numpy()) == 2


def test_save_restore_mid_period_resumes_exactly(logical_cpus, tmp_path):
    import keras

    import tfdist

    x, y = linear_data(n=80)  # 5 steps an epoch, period 4: each fit ends mid-period

    def optimizer():
        return keras.optimizers.SGD(LR, momentum=0.9)

    # Uninterrupted: two fits on one model.
    strategy = tfdist.ModelAverageStrategy(period=4)
    _, straight = fit_linear(strategy, x, y, epochs=1, optimizer=optimizer)
    straight.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    # Interrupted: fit, save, load into a new strategy, fit again.
    first = tfdist.ModelAverageStrategy(period=4)
    _, model = fit_linear(first, x, y, epochs=1, optimizer=optimizer)
    path = str(tmp_path / "mid_period.keras")
    model.save(path)
    second = tfdist.ModelAverageStrategy(period=4)
    with second.scope():
        restored = keras.models.load_model(path)
    assert int(restored.optimizer.iterations.numpy()) == 5
    restored.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    assert int(restored.optimizer.iterations.numpy()) == 10
    assert_weights_close(restored.get_weights(), straight.get_weights(), atol=1e-6)
    assert_weights_close([v.numpy() for v in restored.optimizer.variables],
                         [v.numpy() for v in straight.optimizer.variables], atol=1e-6)
    # The resumed run averaged the weights at step 8 (not 5 + 4), and weights and
    # momenta before returning at step 10.
    param_bytes = (3 + 1) * 4
    assert second.bytes_communicated == param_bytes + 2 * param_bytes


def test_bytes_shrink_with_period(logical_cpus):
    import tfdist

    x, y = linear_data(n=128)  # 8 steps
    counts = {}
    for period, compression in [(1, None), (4, None), (8, None), (1, "fp16"), (4, "bf16")]:
        strategy = tfdist.ModelAverageStrategy(period=period, compression=compression)
        fit_linear(strategy, x, y, epochs=1)
        counts[period, compression] = strategy.bytes_communicated
    param_bytes = (3 + 1) * 4
    assert counts[1, None] == 8 * param_bytes  # as many bytes as sync sends gradients
    for period in (4, 8):
        assert counts[1, None] == period * counts[period, None], counts
    assert counts[1, None] == 2 * counts[1, "fp16"], counts
    assert counts[1, None] == 2 * 4 * counts[4, "bf16"], counts


def test_compressed_average_is_close_and_consistent(logical_cpus):
    import tfdist

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(period=2, compression="fp16")
    initial, model = fit_linear(strategy, x, y, epochs=2)
    ref = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=2)
    assert_weights_close(model.get_weights(), ref, atol=2e-3)
    for variable in model.trainable_weights:
        copies = replica_values(variable)
        np.testing.assert_array_equal(copies[0], copies[1])


def test_average_optimizer_state(logical_cpus):
    import keras

    import tfdist

    x, y = linear_data(n=64)
    for average_state in (False, True):
        strategy = tfdist.ModelAverageStrategy(period=3,
                                               average_optimizer_state=average_state)
        record = []

        class Momenta(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                record.append(replica_values(self.model.optimizer.variables[2]))

        fit_linear(strategy, x, y, epochs=1, callbacks=[Momenta()],
                   optimizer=lambda: keras.optimizers.SGD(LR, momentum=0.9))
        after_average = record[2]  # step 3
        same = np.array_equal(after_average[0], after_average[1])
        assert same == average_state


def test_evaluate_and_predict_average_first(logical_cpus):
    import keras

    import tfdist

    x, y = linear_data(n=80)  # 5 steps an epoch, period 4: validation at step 5
    strategy = tfdist.ModelAverageStrategy(period=4)
    seen = []

    class AtTest(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen.append([replica_values(v) for v in self.model.trainable_weights])

    with strategy.scope():
        model = linear_model()
        model.compile(keras.optimizers.SGD(LR), "mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
              validation_data=(x[:16], y[:16]), callbacks=[AtTest()])
    assert len(seen) == 1
    for copies in seen[0]:
        np.testing.assert_array_equal(copies[0], copies[1])
    # train_on_batch is a local step (step 6; Keras gives every replica the whole
    # batch, so make the copies differ by hand): predict averages them first.
    model.train_on_batch(x[:16], y[:16])
    kernel = model.trainable_weights[0].value.values
    kernel[1].assign(kernel[0] + 1.0)
    expected = kernel[0].numpy() + 0.5
    model.predict(x[:16], verbose=0)
    copies = replica_values(model.trainable_weights[0])
    np.testing.assert_array_equal(copies[0], copies[1])
    np.testing.assert_allclose(copies[0], expected, atol=1e-6)


def test_argument_errors(logical_cpus):
    import keras

    import tfdist

    with pytest.raises(ValueError, match="period=0"):
        tfdist.ModelAverageStrategy(period=0)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        tfdist.ModelAverageStrategy(warmup_steps=-1)
    with pytest.raises(ValueError, match="compression='int8'"):
        tfdist.ModelAverageStrategy(compression="int8")
    with pytest.raises(ValueError, match="engine='nccl'"):
        tfdist.ModelAverageStrategy(engine="nccl")
    with pytest.raises(TypeError, match="backend"):  # removed: engine= replaces it
        tfdist.ModelAverageStrategy(backend="horovod")
    with pytest.raises(ValueError, match="outer_optimizer=0.7"):
        tfdist.ModelAverageStrategy(outer_optimizer=0.7)
    strategy = tfdist.ModelAverageStrategy(period=2)
    with strategy.scope():
        model = linear_model()
        model.compile(keras.optimizers.SGD(LR, gradient_accumulation_steps=2), "mse")
    x, y = linear_data(n=32)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)


def test_one_host_takes_a_collective_timeout(logical_cpus):
    """Issue 22's bug: on one host (no TF_CONFIG) a timeout in communication_options
    raised "MirroredStrategy.__init__() got an unexpected keyword argument
    'collective_timeout'". The code that runs on N workers runs on one: it builds, and
    fit equals local SGD done by hand."""
    import tfdist

    strategy = tfdist.ModelAverageStrategy(
        period=2, communication_options=tfdist.CommunicationOptions(timeout_seconds=30))
    assert isinstance(strategy, tfdist.ModelAverageStrategy)
    assert strategy.num_replicas_in_sync == 2 and strategy.collective_timeout == 30
    assert (strategy.rank, strategy.size, strategy.num_workers, strategy.is_chief) == (
        0, 1, 1, True)
    x, y = linear_data(n=80)  # 5 steps of 16: averages at 2 and 4, then when fit returns
    initial, model = fit_linear(strategy, x, y, epochs=1)
    expected = numpy_local_sgd(x, y, initial[0], initial[1], steps=5, period=2)
    assert_weights_close(model.get_weights(), expected, atol=1e-5)


def test_fit_refuses_steps_that_bypassed_the_local_update(logical_cpus):
    """If Keras stopped routing the optimizer step through tfdist (simulated by removing
    the strategy's handler), fit must fail instead of having trained synchronously."""
    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=4)
    strategy.keras_local_update = lambda: None
    x, y = linear_data(n=32)
    with pytest.raises(RuntimeError, match="did not go through tfdist's local update"):
        fit_linear(strategy, x, y, epochs=1)


@pytest.mark.unit
def test_schedule():
    from tfdist.comm.averaging import is_average_step

    assert [s for s in range(1, 13) if is_average_step(s, 4, 0)] == [4, 8, 12]
    assert [s for s in range(1, 13) if is_average_step(s, 4, 3)] == [1, 2, 3, 7, 11]
    assert [s for s in range(1, 5) if is_average_step(s, 1, 0)] == [1, 2, 3, 4]


def bn_model():
    """An MLP with an unsynchronized BatchNorm (as Keras' tf_distribute_training_test)."""
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.BatchNormalization(momentum=0.5),
                             keras.layers.Dense(3)])


def fit_bn(strategy, epochs=2):
    """Fits `bn_model`; returns its weights, each replica's non-trainable weights after
    fit and after every step, with each non-trainable weight as its replicas' mean."""
    import keras

    x, y = classification_data(n=64)
    steps = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append([replica_values(v) for v in self.model.non_trainable_weights])

    with strategy.scope():
        model = bn_model()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[Record()])
    replicas = [replica_values(v) for v in model.non_trainable_weights]
    means = {v.path: np.mean(r, axis=0) for v, r in zip(model.non_trainable_weights, replicas)}
    weights = [means.get(v.path, np.asarray(v.numpy())) for v in model.weights]
    return {"weights": weights, "replicas": replicas, "steps": steps}


def assert_replicas_equal(values_per_variable):
    for copies in values_per_variable:
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])


def test_period_1_with_batchnorm_equals_synchronous_mirrored(logical_cpus):
    """BatchNorm's moving statistics are averaged with the weights: every replica holds
    the same after every step, the replicas' mean of stock mirrored's (which updates each
    replica's own copy and aggregates none)."""
    import tfdist

    got = fit_bn(tfdist.ModelAverageStrategy(period=1))
    ref = fit_bn(tfdist.MirroredStrategy())
    assert len(got["steps"]) == 8
    for step in got["steps"]:
        assert_replicas_equal(step)
    assert_replicas_equal(got["replicas"])
    assert_weights_close(got["weights"], ref["weights"], atol=1e-5)


# ---- two workers through tfdist.launch -------------------------------------------------

def _worker_fit(period, mode):
    """Runs in each worker: trains with ModelAverageStrategy over TF_CONFIG."""
    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=period)
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    if mode == "mlp":
        x, y = classification_data(n=64)
        model = fit_mlp(strategy, x, y)
        initial = None
    else:
        x, y = linear_data(n=80)
        initial, model = fit_linear(strategy, x, y, epochs=2)
    return {"initial": initial, "weights": model.get_weights(),
            "replicas": [replica_values(v)[0] for v in model.trainable_weights],
            "bytes": strategy.bytes_communicated}


case("auto", "model_average period 1 mlp", _worker_fit, 1, "mlp")
case("auto", "model_average period 4 linear", _worker_fit, 4, "linear")


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_workers_period_1_equals_synchronous(logical_cpus):
    import tfdist

    results = shared_results("auto", "model_average period 1 mlp")
    x, y = classification_data(n=64)
    ref = fit_mlp(tfdist.MirroredStrategy(), x, y).get_weights()
    for result in results:
        assert_weights_close(result["weights"], ref, atol=1e-5)


def _worker_fit_bn():
    import tfdist

    result = fit_bn(tfdist.ModelAverageStrategy(period=1))
    result["replicas"] = [r[0] for r in result["replicas"]]
    del result["steps"]
    return result


case("auto", "model_average period 1 batchnorm", _worker_fit_bn)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_workers_period_1_with_batchnorm_equals_synchronous(logical_cpus):
    import tfdist

    results = shared_results("auto", "model_average period 1 batchnorm")
    ref = fit_bn(tfdist.MirroredStrategy())
    assert_weights_close(results[0]["replicas"], results[1]["replicas"], atol=0)
    for result in results:
        assert_weights_close(result["weights"], ref["weights"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_workers_period_4_matches_numpy():
    results = shared_results("auto", "model_average period 4 linear")
    x, y = linear_data(n=80)
    initial = results[0]["initial"]
    ref = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=4)
    for result in results:
        assert_weights_close(result["weights"], ref, atol=1e-5)
        # each worker holds the same (averaged) copy
        assert_weights_close(result["replicas"], results[0]["replicas"], atol=0)
    # averages at steps 4 and 8, one before fit returned at step 10
    assert results[0]["bytes"] == 3 * (3 + 1) * 4


class _StopAfterEpoch:
    """A callback class that interrupts fit once ``epoch`` has ended (and been backed up)."""

    def __new__(cls, epoch):
        import keras

        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, end, logs=None):
                if end == epoch:
                    raise KeyboardInterrupt(f"interrupted after epoch {end}")

        return Stop()


@pytest.mark.parametrize("period, outer", [(2, False), (3, False), (3, True)])
def test_adam_backup_resumes_exactly(logical_cpus, tmp_path, period, outer):
    """Per-replica optimizer state is averaged into the backup, and the outer optimizer's
    momentum (SlowMo) is in it: a resume equals the uninterrupted run whether an epoch
    ends on a scheduled average (period 2) or not."""
    import keras

    import tfdist
    from tfdist.keras.callbacks import BackupAndRestore

    x, y = linear_data(n=64)  # 4 steps an epoch

    def run(backup_dir, interrupt_after=None):
        strategy = tfdist.ModelAverageStrategy(
            period=period,
            outer_optimizer=(lambda: keras.optimizers.SGD(0.5, momentum=0.9)) if outer else None)
        with strategy.scope():
            model = linear_model()
            model.compile(keras.optimizers.Adam(LR), "mse")
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
    if outer:
        [resumed_outer] = resumed.distribute_strategy.outer_optimizers
        [straight_outer] = straight.distribute_strategy.outer_optimizers
        assert int(resumed_outer.iterations.numpy()) == int(straight_outer.iterations.numpy())
        assert_weights_close([v.numpy() for v in resumed_outer.variables],
                             [v.numpy() for v in straight_outer.variables], atol=1e-5)
