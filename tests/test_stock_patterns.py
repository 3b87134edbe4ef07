"""What TF's distributed tutorials and Keras read on a strategy is the same under tfdist.

Each snippet is an attribute read or a call taken from TF's tutorials ("Custom training
loop with Keras and MultiWorkerMirroredStrategy", "Multi-worker training with Keras"),
TF's own ``distributed_file_utils`` (the write-path rule of tf.keras' callbacks) and
Keras 3's trainer. `stock_snapshot` runs them all on one strategy; the tests compare the
snapshot of every tfdist strategy and engine with stock TF's (or ``engine="tf"``, which
is TF's class) on the same cluster. The next held-out failure should be added here.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import run_cluster

GLOBAL_BATCH = 16


def _is_chief(task_type, task_id, cluster_spec):
    """TF's CTL tutorial: who writes the real checkpoint."""
    return (task_type is None or task_type == "chief"
            or (task_type == "worker" and task_id == 0
                and "chief" not in cluster_spec.as_dict()))


def _write_filepath(filepath, task_type, task_id, cluster_spec):
    """TF's CTL tutorial: the chief writes ``filepath``, the others a temporary path."""
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = os.path.join(dirpath, f"workertemp_{task_id}")
    return os.path.join(dirpath, base)


def _resolver_snapshot(resolver):
    if resolver is None:
        return None
    return {"task_type": resolver.task_type, "task_id": resolver.task_id,
            # Ports differ between jobs: the spec's jobs, and whether it is TF_CONFIG's.
            "cluster_spec": {job: len(addresses) for job, addresses
                             in resolver.cluster_spec().as_dict().items()},
            "cluster_spec_is_tf_config": resolver.cluster_spec().as_dict() == json.loads(
                os.environ.get("TF_CONFIG", '{"cluster": {}}'))["cluster"],
            "rpc_layer": resolver.rpc_layer, "num_accelerators": resolver.num_accelerators(),
            "environment": resolver.environment,
            "write_filepath": _write_filepath("/ckpt/model", resolver.task_type,
                                              resolver.task_id, resolver.cluster_spec())}


def stock_snapshot(strategy):
    """The attributes and calls stock code uses on ``strategy``, as plain values."""
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer
    from tensorflow.python.keras.distribute import distributed_file_utils

    extended = strategy.extended
    contexts = []

    def dataset_fn(context):
        contexts.append((context.num_input_pipelines, context.input_pipeline_id,
                         context.get_per_replica_batch_size(GLOBAL_BATCH)))
        return tf.data.Dataset.range(8).batch(2)

    strategy.distribute_datasets_from_function(dataset_fn)

    def replica_fn():
        context = tf.distribute.get_replica_context()
        return tf.cast(context.replica_id_in_sync_group, tf.float32) + 1.0

    per_replica = strategy.run(replica_fn)
    return {
        "resolver": _resolver_snapshot(strategy.cluster_resolver),
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "should_checkpoint": extended.should_checkpoint,
        "should_save_summary": extended.should_save_summary,
        "should_init": getattr(extended, "should_init", None),
        "experimental_should_init": getattr(extended, "experimental_should_init", None),
        "experimental_between_graph": extended.experimental_between_graph,
        "in_multi_worker_mode": extended._in_multi_worker_mode(),
        "num_worker_devices": len(extended.worker_devices),
        "task": (getattr(extended, "_task_type", None), getattr(extended, "_task_id", None)),
        "num_workers": getattr(extended, "_num_workers", None),
        "is_chief": getattr(extended, "_is_chief", None),
        "keras_multi_worker": bool(trainer._collective_all_reduce_multi_worker(strategy)),
        "tf_keras_write_dirpath": distributed_file_utils.write_dirpath("/ckpt", strategy),
        "input_contexts": contexts,
        "local_results": len(strategy.experimental_local_results(per_replica)),
        "sum_of_replica_ids": float(strategy.reduce("SUM", per_replica, axis=None)),
    }


# ---- one process: the local devices ---------------------------------------------------


@pytest.mark.parametrize("name", ["mirrored", "model_average"])
def test_one_host_strategies_read_like_stock_mirrored(logical_cpus, name):
    import tensorflow as tf

    import tfdist

    strategy = {"mirrored": tfdist.MirroredStrategy,
                "model_average": lambda: tfdist.ModelAverageStrategy(period=1)}[name]()
    ours = stock_snapshot(strategy)
    stock = stock_snapshot(tf.distribute.MirroredStrategy(logical_cpus))
    assert ours == stock


# ---- 2 launched workers: both engines against engine="tf" ------------------------------


# Each launched worker splits its CPU in two: logical CPUs are not replicas of a
# multi-worker strategy (stock: one CPU per worker), under every engine.
LOGICAL_CPUS = 2


def _split_cpu():
    """As a user does before a multi-worker strategy (TF's API: it starts no runtime,
    which the multi-worker strategy must configure first)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_CPUS)])


def _two_worker_snapshots(engine):
    """On each of 2 workers of 2 logical CPUs: MultiWorkerMirroredStrategy's snapshot,
    then (Horovod only: TF's collectives are configured once per process) model
    averaging's."""
    import tfdist

    _split_cpu()
    out = {"multi_worker": stock_snapshot(tfdist.MultiWorkerMirroredStrategy(engine=engine))}
    if engine == "horovod":
        out["model_average"] = stock_snapshot(tfdist.ModelAverageStrategy(period=1,
                                                                          engine=engine))
    return out


def _stock_two_worker_snapshot():
    import tensorflow as tf

    _split_cpu()
    return stock_snapshot(tf.distribute.MultiWorkerMirroredStrategy())


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_ctl_tutorial_pattern_is_the_same_under_both_engines():
    # The three launches at once: each is mostly its two workers' start-ups.
    with ThreadPoolExecutor(max_workers=3) as pool:
        launches = [pool.submit(run_cluster, _two_worker_snapshots, "tf", timeout=180),
                    pool.submit(run_cluster, _two_worker_snapshots, "horovod", timeout=180),
                    pool.submit(run_cluster, _stock_two_worker_snapshot, timeout=180)]
        tf_engine, horovod, stock = [launch.result() for launch in launches]
    for rank in (0, 1):
        assert tf_engine[rank]["multi_worker"] == stock[rank]
        assert horovod[rank]["multi_worker"] == stock[rank], rank
        assert horovod[rank]["model_average"] == stock[rank], rank
    resolver = stock[1]["resolver"]
    assert (resolver["task_type"], resolver["task_id"]) == ("worker", 1)
    assert resolver["write_filepath"] == "/ckpt/workertemp_1/model"
    assert resolver["cluster_spec"] == {"worker": 2} and resolver["cluster_spec_is_tf_config"]
    assert stock[0]["should_checkpoint"] and not stock[1]["should_checkpoint"]
    # Stock's replicas: one CPU per worker (TF's distributed-input tutorial: a global
    # batch of 16 is 8 per replica, 2 replicas in sync).
    assert stock[0]["num_replicas_in_sync"] == 2 and stock[0]["num_worker_devices"] == 1
    assert stock[0]["input_contexts"] == [(2, 0, GLOBAL_BATCH // 2)]
