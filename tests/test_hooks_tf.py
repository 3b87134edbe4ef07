"""Each private TF hook in tfdist/_hooks/tf.py still exists in this TensorFlow.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect


def test_mirrored_reads_collective_key_base():
    from tensorflow.python.distribute import mirrored_strategy

    source = inspect.getsource(mirrored_strategy.MirroredExtended.__init__)
    assert "container_strategy._collective_key_base" in source, (
        "MirroredExtended no longer reads _collective_key_base: "
        "tfdist._hooks.tf.assign_collective_key_base does nothing now")


def test_collective_key_base_is_distinct_per_instance(logical_cpus):
    import tfdist

    first = tfdist.MirroredStrategy(cross_device_ops="collective")
    second = tfdist.MirroredStrategy(cross_device_ops="collective")
    assert first.extended._collective_key_base != second.extended._collective_key_base


def test_tf_distribute_internals_for_horovod_strategy():
    import inspect

    from tensorflow.python.distribute import cross_device_ops

    from tfdist._hooks.tf import tf_distribute_internals

    internals = tf_distribute_internals()
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


def test_multi_worker_strategy_init_is_still_what_tfdist_replays():
    """tfdist builds the extended object itself; TF's __init__ must still only do that."""
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    from tfdist._hooks.tf import collective_all_reduce_extended_class

    assert collective_all_reduce_extended_class() is cars.CollectiveAllReduceExtended
    assert tf.distribute.MultiWorkerMirroredStrategy is cars.CollectiveAllReduceStrategy
    source = inspect.getsource(cars.CollectiveAllReduceStrategy.__init__)
    assert "CollectiveAllReduceExtended(" in source and "super(CollectiveAllReduceStrategy" \
        in source, "MultiWorkerMirroredStrategy.__init__ changed: re-check tfdist's __init__"
    assert hasattr(cars.CollectiveAllReduceExtended, "_in_multi_worker_mode")


def test_multi_worker_keeps_a_preconfigured_coordination_service():
    """tfdist configures the coordination service first; TF must not overwrite it."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    from tensorflow.python.eager import context

    fields = coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    for field in ("cluster_register_with_barrier", "cluster_register_timeout_in_ms",
                  "heartbeat_timeout_in_ms", "coordinated_job_list"):
        assert field in fields, f"coordination config lost {field}"
    source = inspect.getsource(cars.CollectiveAllReduceExtended._initialize_multi_worker)
    assert "context.context().coordination_service is None" in source
    assert "cluster_register_timeout_in_ms" in inspect.signature(
        context.Context.configure_coordination_service).parameters
    assert isinstance(context.Context.coordination_service, property)


def test_tf_data_compute_batch_size():
    import tensorflow as tf

    from tfdist._hooks.tf import dataset_batch_size

    batched = tf.data.Dataset.range(10).batch(4).prefetch(2)
    assert dataset_batch_size(batched) == 4, (
        "TF's compute_batch_size changed: the uneven-global-batch check misses datasets")


def test_exactly_once_call_is_kept_out_of_line():
    """tfdist.keras.ps_steps._once relies on tf.function's private ``_noinline``
    attribute (a step's update must run as one call, not inlined into the step)."""
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import attributes

    assert attributes.NO_INLINE == "_noinline", "review tfdist.keras.ps_steps._once"
    inner = tf.function(lambda x: x + 1, autograph=False,
                        experimental_attributes={"_noinline": True})
    outer = tf.function(lambda x: inner(x) * 2, autograph=False)
    graph = outer.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    calls = [op for op in graph.get_operations() if "PartitionedCall" in op.type]
    assert len(calls) == 1, [op.type for op in graph.get_operations()]
    callee = library[calls[0].get_attr("f").name]
    assert callee.attr["_noinline"].b, "TF dropped _noinline: review ps_steps._once"


def test_function_not_inlined_is_one_call_with_noinline():
    import tensorflow as tf

    from tfdist._hooks.tf import function_not_inlined

    inner = function_not_inlined(lambda x: x + 1)
    outer = tf.function(lambda x: inner(x) * 2, autograph=False)
    graph = outer.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    calls = [op for op in graph.get_operations() if "PartitionedCall" in op.type]
    assert len(calls) == 1, [op.type for op in graph.get_operations()]
    assert library[calls[0].get_attr("f").name].attr["_noinline"].b
    assert float(outer(tf.constant(1.0))) == 4.0


def test_op_error_message_is_rewritten():
    """TF prints an OpError's private ``_message``: renaming a path must change it."""
    import tensorflow as tf

    from tfdist._hooks.tf import rewrite_op_error_message

    error = tf.errors.NotFoundError(None, None, "no file /d/.tmp-1-m.keras")
    rewrite_op_error_message(error, lambda m: m.replace(".tmp-1-m.keras", "m.keras"))
    assert error.message == "no file /d/m.keras" and str(error) == "no file /d/m.keras"


def test_checked_collective_extended_routes_variable_creation(logical_cpus):
    """MultiWorkerExtended names a model mismatch from ``tfdist_create_variable``."""
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    from tfdist._hooks.tf import (checked_collective_extended_class, in_multi_worker_mode,
                                  replica_id_in_sync_group)

    checked = checked_collective_extended_class()
    assert issubclass(checked, cars.CollectiveAllReduceExtended)
    assert callable(getattr(cars.CollectiveAllReduceExtended, "_create_variable", None)), (
        "TF removed CollectiveAllReduceExtended._create_variable: a worker whose model "
        "differs is no longer named")
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy()
    seen = []
    original = type(strategy.extended).tfdist_create_variable
    type(strategy.extended).tfdist_create_variable = (
        lambda self, create, name: seen.append(name) or original(self, create, name))
    try:
        with strategy.scope():
            tf.Variable(1.0, name="weight")
    finally:
        type(strategy.extended).tfdist_create_variable = original
    assert seen == ["weight"]
    assert in_multi_worker_mode(strategy.extended) is False
    ids = [int(replica_id_in_sync_group(strategy.extended, i)) for i in range(2)]
    assert ids == [0, 1]


def test_call_time_value_is_fresh_on_every_call_of_the_outermost_function():
    """Group collectives take their instance keys this way (a partial last batch would
    otherwise meet the shapes TF cached for the key)."""
    import itertools

    import tensorflow as tf
    from tensorflow.python.framework import func_graph

    from tfdist._hooks.tf import call_time_value

    assert callable(getattr(func_graph.FuncGraph, "capture_call_time_value", None)), (
        "FuncGraph.capture_call_time_value is gone: tfdist._hooks.tf.call_time_value "
        "must be rewritten")
    counter = itertools.count(7)

    @tf.function
    def inner():
        return call_time_value(lambda: next(counter), tf.int32)

    @tf.function
    def outer():  # a function traced inside another, and a value inside a cond
        direct = tf.cond(tf.constant(True), lambda: call_time_value(lambda: 100, tf.int32),
                         lambda: tf.constant(0))
        return inner() + direct

    assert [int(outer()) for _ in range(3)] == [107, 108, 109]
    assert int(call_time_value(lambda: 41, tf.int32)) == 41  # eager: the value itself
