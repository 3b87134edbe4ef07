"""tfdist.HorovodStrategy and tfdist.engines.horovod.ops, run under `horovodrun -np 2 --gloo`.

Each multi-process test starts one horovodrun job (see helpers.run_horovod, which kills
its process group on timeout) and compares what the ranks return with references:
single-process training with the same global batch, tfdist.MultiWorkerMirroredStrategy
on the same problem, and hand-computed collectives.

Horovod is installed by `make test` (scripts/install_horovod.sh). If it is missing the
tests skip with the install command, except when TFDIST_REQUIRE_HOROVOD=1 (set by the
Makefile): then they fail.
"""


import numpy as np
import pytest

from helpers import (assert_weights_close, regression_data, require_horovod, run_cluster,
                     run_horovod)
from tfdist.engines.horovod import ops as comm

pytestmark = [pytest.mark.horovod]

BATCH = 16      # global batch
EPOCHS = 2
LR = 0.05
N_2X2 = 96      # samples in the 2x2 test: 6 global batches, 4 per replica
# fp16 / bf16 gradients on the wire vs float32 after 8 SGD steps (momentum 0.9); the
# measured max |diff| was 1.5e-4 (fp16) and 2.0e-3 (bf16).
FP16_ATOL = 2e-3
BF16_ATOL = 1e-2


@pytest.fixture(scope="module")
def horovod_installed():
    require_horovod()


# ---- the shared problem ---------------------------------------------------------------

def _data(n=64):
    return regression_data(n=n, features=5)


def _model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss="mse",
                  metrics=["mae"])
    return model


def _fit(model, n=64):
    x, y = _data(n)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return history.history


def _reference(n=64):
    """Single process, no strategy, the same global batch."""
    x, y = _data(n)
    model = _model(seed=0)
    history = _fit(model, n)
    return {"weights": model.get_weights(), "history": history,
            "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
            "predict": model.predict(x, batch_size=BATCH, verbose=0)}


# ---- code run in each horovod rank ----------------------------------------------------

def horovod_train_task():
    """HorovodStrategy fit/evaluate/predict, broadcast, compression, raw collectives."""
    import tensorflow as tf

    import tfdist

    out = {}
    strategy = tfdist.HorovodStrategy()
    rank = strategy.rank
    out["size"], out["replicas"] = strategy.size, strategy.num_replicas_in_sync
    x, y = _data()
    with strategy.scope():
        model = _model(seed=rank)           # each rank draws different initial weights
    out["initial"] = model.get_weights()    # ... but rank 0's were broadcast
    out["history"] = _fit(model)
    out["weights"] = model.get_weights()
    out["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    out["bytes_fit"] = strategy.bytes_communicated

    # Explicit broadcast after rank 1 changed its weights.
    model.layers[0].kernel.assign(tf.fill(model.layers[0].kernel.shape, float(rank + 1)))
    strategy.broadcast_variables(model.variables, root_rank=0)
    out["after_broadcast"] = model.layers[0].kernel.numpy()

    # fp16 / bf16 on the wire: the same training, and the bytes it saves.
    for name in ("fp16", "bf16"):
        compressed = tfdist.HorovodStrategy(compression=name)
        with compressed.scope():
            model = _model(seed=0)
        _fit(model)
        out[f"{name}_weights"] = model.get_weights()
        out[f"{name}_bytes_fit"] = compressed.bytes_communicated

    # accumulate_steps=2 with half the global batch: the same as the reference batch.
    accumulating = tfdist.HorovodStrategy(accumulate_steps=2)
    with accumulating.scope():
        model = _model(seed=0)
    xa, ya = _data()
    model.fit(xa, ya, batch_size=BATCH // 2, epochs=EPOCHS, shuffle=False, verbose=0)
    out["accumulate_weights"] = model.get_weights()
    out["accumulate_iterations"] = int(model.optimizer.iterations.numpy())

    # One replica-context all-reduce of 1000 float32, counted exactly.
    def all_reduce_bytes(strat):
        before = strat.bytes_communicated
        value = tf.fill([1000], float(rank + 1))
        step = tf.function(lambda: strat.run(
            lambda: tf.distribute.get_replica_context().all_reduce("SUM", value)))
        result = strat.experimental_local_results(step())[0].numpy()
        return strat.bytes_communicated - before, result

    out["allreduce_bytes"], out["allreduce_sum"] = all_reduce_bytes(strategy)
    out["allreduce_bytes_fp16"], out["allreduce_sum_fp16"] = all_reduce_bytes(
        tfdist.HorovodStrategy(compression="fp16"))

    # Raw collectives of tfdist.engines.horovod.ops, eager and in tf.function.
    values = [tf.constant([1.0, 2.0]) * (rank + 1), tf.constant([3, 5], tf.int32) * (rank + 1)]
    out["avg"] = [t.numpy() for t in comm.allreduce(values, op="average")]
    out["sum"] = [t.numpy() for t in comm.allreduce(values, op="sum")]
    out["sum_graph"] = [t.numpy() for t in tf.function(
        lambda: comm.allreduce(values, op="sum", name="graph_sum"))()]
    out["bcast_uint32"] = comm.broadcast(tf.constant([7, 2**31 + rank], tf.uint32)).numpy()
    out["bcast_bool"] = comm.broadcast(tf.constant([rank == 0, False])).numpy()
    out["gather"] = comm.allgather(tf.fill([rank + 1, 2], float(rank))).numpy()
    scattered = tf.reshape(tf.range(8.0), [4, 2]) * (rank + 1)
    out["reducescatter"] = comm.reducescatter(scattered).numpy()
    out["reducescatter_int"] = comm.reducescatter(tf.cast(scattered, tf.int32)).numpy()
    traced = tf.function(comm.reducescatter).get_concrete_function(tf.TensorSpec([4, 2]))
    out["reducescatter_ops"] = {op.type for op in traced.graph.get_operations()
                                if op.type.startswith("Horovod")}
    out["reduce_scalar"] = float(strategy.reduce("MEAN", tf.constant(float(rank)), axis=0))

    out["model_average"] = model_average_task("horovod")
    if rank == 0:
        out["reference"] = _reference()
        out["seed_weights"] = [_model(seed=0).get_weights(), _model(seed=1).get_weights()]
    return out


def model_average_task(engine):
    """tfdist.ModelAverageStrategy(period=2) over Horovod (under horovodrun) or over TF
    collectives (2 workers via tfdist.launch): each worker reads its half of every
    global batch either way."""
    import tfdist

    strategy = tfdist.ModelAverageStrategy(period=2, engine=engine)
    x, y = _data()
    with strategy.scope():
        model = _model(seed=0)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": model.get_weights(), "bytes": strategy.bytes_communicated}


def horovod_2x2_task():
    """2 processes x 2 logical CPUs: local reduce, then Horovod across processes.

    Batches split evenly: with an uneven last batch Keras averages the replicas'
    mean losses (as with every tf.distribute strategy), which is not the global mean.
    """
    import tfdist

    tfdist.devices.use_logical_cpus(2)
    strategy = tfdist.HorovodStrategy()
    x, y = _data(N_2X2)
    with strategy.scope():
        model = _model(seed=strategy.rank)
    history = _fit(model, N_2X2)
    out = {"replicas": strategy.num_replicas_in_sync, "weights": model.get_weights(),
           "history": history,
           "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
           "predict": model.predict(x, batch_size=BATCH, verbose=0)}
    if strategy.rank == 0:
        out["reference"] = _reference(N_2X2)
    return out


def mwms_train_task():
    """The same training with tfdist.MultiWorkerMirroredStrategy (2 workers, gRPC)."""
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(seed=0)
    history = _fit(model)
    return {"weights": model.get_weights(), "history": history}


# ---- tests ----------------------------------------------------------------------------

@pytest.mark.unit
def test_missing_horovod_error_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setattr(comm, "_hvd", None)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    with pytest.raises(ImportError, match="make horovod"):
        comm.init()
    assert not comm.is_available()


def test_horovod_strategy_in_a_tf_config_job_is_refused(monkeypatch):
    """Without horovodrun, each task of a TF_CONFIG job would train alone (as inside
    tfdist.spark.run or tfdist.ray.run): refused, naming the engine to use instead."""
    import json

    import tfdist

    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 1}}))
    with pytest.raises(ValueError, match=r"TF_CONFIG names 2 training tasks: each would "
                                         r"train alone.*engine='horovod'"):
        tfdist.HorovodStrategy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset, expected", [(None, "10"), ("3", "3")])
def test_model_average_quiets_horovods_cycle_unless_set(horovod_installed, preset, expected):
    """Between averages Horovod would negotiate every 1 ms: ModelAverageStrategy sets a
    10 ms cycle before Horovod starts, and keeps a cycle the user set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k != "HOROVOD_CYCLE_TIME" and not k.startswith("TF_CONFIG")}
    if preset is not None:
        env["HOROVOD_CYCLE_TIME"] = preset
    script = ("import os, tfdist; s = tfdist.ModelAverageStrategy(period=2, engine='horovod'); "
              "print('cycle', s.num_workers, os.environ.get('HOROVOD_CYCLE_TIME'))")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"cycle 1 {expected}" in out.stdout.splitlines()


def test_allreduce_rejects_unknown_op():
    with pytest.raises(ValueError, match="Received: op='max'"):
        comm.allreduce([], op="max")


@pytest.fixture(scope="module")
def horovod_results(horovod_installed):
    return run_horovod(horovod_train_task, np=2, timeout=200)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_fit_matches_single_process_reference(horovod_results):
    rank0, rank1 = horovod_results
    assert (rank0["size"], rank0["replicas"]) == (2, 2)
    reference = rank0["reference"]
    # Identical on both ranks, and equal to one process with the same global batch.
    assert_weights_close(rank0["weights"], rank1["weights"], atol=0)
    assert_weights_close(rank0["weights"], reference["weights"], atol=1e-5)
    for key in ("loss", "mae"):   # epoch loss/metrics are global averages on every rank
        np.testing.assert_allclose(rank0["history"][key], reference["history"][key], atol=1e-5)
        np.testing.assert_allclose(rank1["history"][key], reference["history"][key], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_accumulate_steps_equals_the_larger_batch(horovod_results):
    reference = horovod_results[0]["reference"]
    for result in horovod_results:
        assert result["accumulate_iterations"] == EPOCHS * 64 // BATCH
        assert_weights_close(result["accumulate_weights"], reference["weights"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_evaluate_and_predict_cover_the_whole_dataset(horovod_results):
    reference = horovod_results[0]["reference"]
    for result in horovod_results:
        np.testing.assert_allclose(result["evaluate"], reference["evaluate"], atol=1e-5)
        np.testing.assert_allclose(result["predict"], reference["predict"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_initial_weights_come_from_rank_0(horovod_results):
    rank0, rank1 = horovod_results
    seed0, seed1 = rank0["seed_weights"]
    assert not np.allclose(seed0[0], seed1[0])
    assert_weights_close(rank0["initial"], seed0, atol=0)
    assert_weights_close(rank1["initial"], seed0, atol=0)
    # After rank 1 overwrote a kernel, broadcast_variables restores rank 0's.
    np.testing.assert_array_equal(rank1["after_broadcast"], np.ones_like(seed0[0]))


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_compression_within_tolerance_and_counts_fewer_bytes(horovod_results):
    rank0, rank1 = horovod_results
    for name in ("fp16", "bf16"):
        assert_weights_close(rank0[f"{name}_weights"], rank1[f"{name}_weights"], atol=0)
    assert_weights_close(rank0["fp16_weights"], rank0["weights"], atol=FP16_ATOL)
    # bf16 keeps 7 mantissa bits (fp16: 10): a looser bound.
    assert_weights_close(rank0["bf16_weights"], rank0["weights"], atol=BF16_ATOL)
    # ... but compression must have changed something (it is not a no-op).
    assert not np.array_equal(rank0["fp16_weights"][0], rank0["weights"][0])
    assert rank0["fp16_bytes_fit"] < rank0["bytes_fit"]
    # A single all-reduce of 1000 float32: 4000 bytes, 2000 with fp16.
    assert rank0["allreduce_bytes"] == 4000
    assert rank0["allreduce_bytes_fp16"] == 2000
    np.testing.assert_allclose(rank0["allreduce_sum"], np.full(1000, 3.0))
    np.testing.assert_allclose(rank0["allreduce_sum_fp16"], np.full(1000, 3.0))


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_raw_collectives_against_numpy(horovod_results):
    for result in horovod_results:
        np.testing.assert_allclose(result["avg"][0], [1.5, 3.0])
        np.testing.assert_array_equal(result["avg"][1], [4, 7])       # (3+6)//2, (5+10)//2
        assert result["avg"][1].dtype == np.int32
        for key in ("sum", "sum_graph"):
            np.testing.assert_allclose(result[key][0], [3.0, 6.0])
            np.testing.assert_array_equal(result[key][1], [9, 15])
        np.testing.assert_array_equal(result["bcast_uint32"], [7, 2**31])
        np.testing.assert_array_equal(result["bcast_bool"], [True, False])
        np.testing.assert_array_equal(result["gather"], [[0, 0], [1, 1], [1, 1]])
    summed = np.arange(8.0).reshape(4, 2) * 3
    for rank, result in enumerate(horovod_results):
        np.testing.assert_array_equal(result["reducescatter"], summed[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(result["reducescatter_int"], summed[2 * rank:2 * rank + 2])
        assert result["reducescatter_int"].dtype == np.int32
        # Not Gloo's reduce-scatter, whose rank-0 block is sometimes wrong
        # (scripts/gloo_reducescatter.py): an alltoall and a local sum.
        assert result["reducescatter_ops"] == {"HorovodAlltoall"}, result["reducescatter_ops"]
        assert result["reduce_scalar"] == 0.5


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_fit_matches_multi_worker_mirrored(horovod_results):
    mwms = run_cluster(mwms_train_task, workers=2, timeout=150)
    for result in mwms:
        assert_weights_close(result["weights"], horovod_results[0]["weights"], atol=1e-5)
        np.testing.assert_allclose(result["history"]["loss"],
                                   horovod_results[0]["history"]["loss"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_two_local_devices_per_process_match_reference(horovod_installed):
    results = run_horovod(horovod_2x2_task, np=2, timeout=200)
    reference = results[0]["reference"]
    assert reference["predict"].shape == (N_2X2, 1)
    for result in results:
        assert result["replicas"] == 4
        assert_weights_close(result["weights"], reference["weights"], atol=1e-5)
        np.testing.assert_allclose(result["history"]["loss"], reference["history"]["loss"],
                                   atol=1e-5)
        np.testing.assert_allclose(result["evaluate"], reference["evaluate"], atol=1e-5)
        np.testing.assert_allclose(result["predict"], reference["predict"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_model_average_over_horovod_equals_tf_collectives(horovod_results):
    tf_results = run_cluster(model_average_task, "tf", workers=2, timeout=150)
    hvd_results = [r["model_average"] for r in horovod_results]
    assert_weights_close(hvd_results[0]["weights"], hvd_results[1]["weights"], atol=0)
    for result in tf_results:
        assert_weights_close(result["weights"], hvd_results[0]["weights"], atol=1e-5)
    # Not plain synchronous SGD (momentum is local): it must differ from the reference.
    assert not np.allclose(hvd_results[0]["weights"][0],
                           horovod_results[0]["reference"]["weights"][0], atol=1e-4)
    assert hvd_results[0]["bytes"] > 0
