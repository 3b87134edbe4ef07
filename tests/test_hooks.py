"""Each private TF/Keras hook in tfdist/_hooks.py still exists in this TF/Keras.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect


def test_mirrored_reads_collective_key_base():
    from tensorflow.python.distribute import mirrored_strategy

    source = inspect.getsource(mirrored_strategy.MirroredExtended.__init__)
    assert "container_strategy._collective_key_base" in source, (
        "MirroredExtended no longer reads _collective_key_base: "
        "tfdist._hooks.assign_collective_key_base does nothing now")


def test_collective_key_base_is_distinct_per_instance(logical_cpus):
    import tfdist

    first = tfdist.MirroredStrategy(cross_device_ops="collective")
    second = tfdist.MirroredStrategy(cross_device_ops="collective")
    assert first.extended._collective_key_base != second.extended._collective_key_base


def test_tf_distribute_internals_for_horovod_strategy():
    import inspect

    from tensorflow.python.distribute import cross_device_ops

    from tfdist import _hooks

    internals = _hooks.tf_distribute_internals()
    for name in ("simple_broadcast", "reduce_non_distributed_value", "get_distributed_dataset",
                 "get_distributed_datasets_from_function", "regroup", "is_mirrored"):
        assert callable(getattr(internals, name)), name
    # HorovodExtended overrides these MirroredExtended members; TF must still call them.
    for name in ("_reduce_to", "_batch_reduce_to", "_gather_to_implementation",
                 "_experimental_distribute_dataset", "_distribute_datasets_from_function",
                 "_experimental_distribute_values_from_function", "_create_variable",
                 "_get_cross_device_ops", "_use_merge_call", "_in_multi_worker_mode",
                 "_input_workers_with_options", "_num_replicas_in_sync"):
        assert hasattr(internals.MirroredExtended, name), name
    assert "input_context" in inspect.signature(internals.get_distributed_dataset).parameters
    # HorovodCrossDeviceOps relies on this to stop reductions being skipped.
    assert "_num_between_graph_workers" in inspect.getsource(cross_device_ops.CrossDeviceOps.reduce)
    assert "_num_between_graph_workers" in inspect.getsource(
        cross_device_ops.CrossDeviceOps.batch_reduce)


def test_keras_multi_worker_path_follows_the_mwms_class():
    import tensorflow as tf

    from tfdist import _hooks

    class Extended:
        def __init__(self, multi_worker):
            self.multi_worker = multi_worker

        def _in_multi_worker_mode(self):
            return self.multi_worker

    class Subclass(tf.distribute.MultiWorkerMirroredStrategy):
        pass

    def fake(cls, multi_worker):
        strategy = object.__new__(cls)
        strategy._extended = Extended(multi_worker)
        return strategy

    assert _hooks.keras_uses_multi_worker_path(fake(Subclass, True))
    assert not _hooks.keras_uses_multi_worker_path(fake(Subclass, False))
    assert not _hooks.keras_uses_multi_worker_path(fake(tf.distribute.MirroredStrategy, True))
