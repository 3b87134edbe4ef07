"""Each private TF hook in tfdist/_hooks/coordinator.py still exists in this TensorFlow.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect


def test_cluster_coordinator_internals_for_per_worker_inputs_and_pinned_steps():
    from tensorflow.python.distribute import input_lib
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.distribute.coordinator import values

    # create_per_worker_iterators
    assert callable(cc.Worker.create_resource)
    assert "self.workers" in inspect.getsource(cc.Cluster.__init__)
    assert callable(values.PerWorkerDistributedIterator)
    assert callable(input_lib.get_iterator_spec_from_dataset)
    # schedule_on_worker: a tagged closure is handed out without counting it in flight,
    # and a normal closure is marked finished (or put back untagged) by the worker.
    source = inspect.getsource(cc._CoordinatedClosureQueue)
    for name in ("_queue_lock", "_tagged_queue", "_closures_queued_condition",
                 "_cancellation_mgr", "def _raise_if_error", "def inflight_closure_count"):
        assert name in source, name
    get = inspect.getsource(cc._CoordinatedClosureQueue.get)
    assert get.index("self._tagged_queue[tag].get") < get.index("inflight_closure_count += 1")
    assert "assert closure.tag is None" in inspect.getsource(cc._CoordinatedClosureQueue.put_back)
    assert "mark_finished()" in inspect.getsource(cc.Worker._process_closure)
    # ... and a worker known dead gets nothing pinned: it is scheduled as usual.
    assert "self._is_dead_with_error = e" in inspect.getsource(cc.Worker._on_closure_failure)
    assert "self._is_dead_with_error = False" in inspect.getsource(
        cc.Worker._on_worker_recovery)
    assert "self._is_dead_with_error = None" in inspect.getsource(cc.Worker.__init__)
    assert list(inspect.signature(cc.Closure.__init__).parameters)[:3] == \
        ["self", "function", "cancellation_mgr"]


def test_dataset_copier_rebuilds_the_dataset():
    import tensorflow as tf

    from tfdist._hooks.coordinator import dataset_copier

    dataset = tf.data.Dataset.range(10).map(lambda i: i * 2).batch(4)
    copy = tf.function(dataset_copier(dataset))()
    assert [b.numpy().tolist() for b in copy] == [b.numpy().tolist() for b in dataset]


def test_cluster_coordinator_internals_for_the_step_deadline():
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.distribute.coordinator import values

    # track_running_closures: a worker thread runs each closure through the instance's
    # _process_closure, and reports a failed worker through _on_closure_failure.
    process_queue = inspect.getsource(cc.Worker._process_queue)
    assert "self._process_closure(closure)" in process_queue
    assert "self._on_closure_failure(closure, e)" in inspect.getsource(
        cc.Worker._process_closure)
    assert "put_back(closure)" in inspect.getsource(cc.Worker._on_closure_failure)
    # wait_for_closures / wait_for_remote_value: the timeouts join() and fetch() lack.
    assert "timeout" in inspect.signature(cc._CoordinatedClosureQueue.wait).parameters
    assert "self._status_available_event.set()" in inspect.getsource(
        values.RemoteValueImpl._set_values)
