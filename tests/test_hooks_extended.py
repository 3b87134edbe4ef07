"""The private TF extension points of tfdist/_hooks/extended.py still exist and are still
what TF calls. If one fails after an upgrade, the Horovod engine's extended would be
bypassed silently (TF's own replica ids, reductions or input sharding): rewrite the hook.
"""

import inspect


def test_mirrored_extended_still_has_every_mapped_extension_point():
    from tensorflow.python.distribute import distribute_lib, mirrored_strategy

    from tfdist._hooks.extended import own_extended_class

    stock = mirrored_strategy.MirroredExtended
    own = own_extended_class()
    assert issubclass(own, stock)
    for name in ("_num_replicas_in_sync", "_in_multi_worker_mode",
                 "_get_replica_id_in_sync_group", "_get_local_replica_id", "_use_merge_call",
                 "_create_variable", "_get_cross_device_ops", "_reduce_to", "_batch_reduce_to",
                 "_gather_to_implementation", "_experimental_distribute_dataset",
                 "_distribute_datasets_from_function",
                 "_experimental_distribute_values_from_function",
                 "_input_workers_with_options", "_container_strategy"):
        assert hasattr(stock, name), f"MirroredExtended.{name} is gone"
        assert name in own.__dict__ or name in ("_input_workers_with_options",
                                                "_container_strategy"), name
    # The public entry points still reach the private ones the hook overrides.
    public = distribute_lib.StrategyExtendedV2
    assert "_reduce_to" in inspect.getsource(public.reduce_to)
    assert "_batch_reduce_to" in inspect.getsource(public.batch_reduce_to)
    assert "self._create_variable" in inspect.getsource(distribute_lib.StrategyExtendedV2)
    # TF's __init__ sets the private state the hook reads and writes.
    init = inspect.getsource(stock.__init__) + inspect.getsource(stock._initialize_strategy)
    assert "self._devices" in inspect.getsource(mirrored_strategy) and "_devices" in init


def test_multi_worker_util_still_answers_the_task_attributes():
    from tensorflow.python.distribute import multi_worker_util
    import tensorflow as tf

    spec = multi_worker_util.normalize_cluster_spec(
        tf.train.ClusterSpec({"worker": ["a:1", "b:2"]}))
    assert multi_worker_util.worker_count(spec, "worker") == 2
    assert multi_worker_util.is_chief(spec, "worker", 0)
    assert not multi_worker_util.is_chief(spec, "worker", 1)


def test_cross_device_ops_still_reads_the_mapped_attributes():
    from tensorflow.python.distribute import cross_device_ops

    from tfdist._hooks.extended import own_cross_device_ops_class

    # Without the override, a process with one replica would skip the reduction.
    assert "_num_between_graph_workers" in inspect.getsource(cross_device_ops.CrossDeviceOps.reduce)
    assert "_canonicalize_devices" in inspect.getsource(cross_device_ops.CrossDeviceOps.__init__)

    class Two(own_cross_device_ops_class()):
        def processes(self):
            return 2

    ops = Two()
    assert ops._num_between_graph_workers == 2 and ops.canonicalize_devices is True


def test_task_attributes_are_the_ones_tf_keras_reads(logical_cpus):
    """One process, one replica: the adapter's task attributes as stock code reads them."""
    import tensorflow as tf

    from tfdist._hooks.extended import own_extended_class

    class One(own_extended_class()):
        def replicas_in_sync(self):
            return 1

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])  # any container
    extended = One(strategy, devices=["/cpu:0"])
    extended.set_task_attributes(None, rank=1, size=2)
    assert (extended._task_type, extended._task_id, extended._num_workers) == ("worker", 1, 2)
    assert not extended.is_chief_task and not extended.should_checkpoint
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"chief": ["a:1"], "worker": ["b:2"]}), task_type="chief",
        task_id=0)
    extended.set_task_attributes(resolver, rank=0, size=2)
    assert extended._task_type == "chief" and extended.is_chief_task
    assert extended._num_workers == 2
