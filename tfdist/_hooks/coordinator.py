"""Hooks into TF's ``ClusterCoordinator``: per-worker inputs, pinned steps, deadlines.

Iterators that read a different dataset on each worker, a closure scheduled on one
chosen worker, a dataset rebuilt on a remote worker, the start time of each running
closure, and waits with a timeout where ``join``/``fetch`` have none. Used by the
parameter-server strategy and its fit driver; ``tests/test_hooks_coordinator.py`` fails
loudly when a TF upgrade removes what they touch.
"""

from __future__ import annotations


def create_per_worker_iterators(coordinator, dataset_fns):
    """One iterator per worker, worker ``i`` iterating ``dataset_fns[i]()``.

    Why: ``ClusterCoordinator.create_per_worker_dataset`` runs the same dataset
    function on every worker, so workers cannot read different shards (and
    ``input_context`` is always pipeline 0 of 1). This does what it does, per worker:
    ``Worker.create_resource`` registers the iterator so the coordinator rebuilds it
    when a worker restarts, and each `RemoteValue` gets the iterator's type spec.

    Returns:
        A ``PerWorkerValues`` of iterators, to pass to ``coordinator.schedule``.
    """
    from tensorflow.python.distribute import input_lib
    from tensorflow.python.distribute.coordinator import values as values_lib

    import tensorflow as tf

    workers = coordinator._cluster.workers
    if len(dataset_fns) != len(workers):
        raise ValueError(f"need one dataset function per worker ({len(workers)}). "
                         f"Received: {len(dataset_fns)}")
    remote_values = []
    for worker, dataset_fn in zip(workers, dataset_fns):
        concrete = tf.function(dataset_fn).get_concrete_function()

        def make_iterator(concrete=concrete):
            return iter(concrete())

        remote = worker.create_resource(make_iterator)
        remote._type_spec = input_lib.get_iterator_spec_from_dataset(
            coordinator.strategy, concrete.structured_outputs)
        remote_values.append(remote)
    return values_lib.PerWorkerDistributedIterator(tuple(remote_values))


def schedule_on_worker(coordinator, worker_index: int, fn, args=()):
    """Like ``coordinator.schedule(fn, args)``, but runs on worker ``worker_index``.

    Why: synchronous parameter-server steps need one gradient from each worker, and
    ``schedule`` gives a closure to whichever worker is free. The coordinator's closure
    queue has per-worker tagged queues (used to build resources); a normal `Closure` is
    put there and counted in flight, so ``join()`` waits for it and the worker marks it
    finished. Its tag is then cleared: if the worker dies, the coordinator puts the
    closure back on the shared queue and another worker runs it. A worker already
    known dead (``Worker._is_dead_with_error``, set when one of its closures failed,
    cleared when it is back) gets nothing pinned: its thread only waits for it to come
    back, so the closure is scheduled as usual, for any worker (a parameter-server job
    that carries on without a worker would wait for it forever).
    """
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    cluster = coordinator._cluster
    if cluster.workers[worker_index]._is_dead_with_error:
        return coordinator.schedule(fn, args=args)
    closure_queue = cluster.closure_queue
    strategy = coordinator.strategy
    with strategy.scope():
        strategy.extended._being_scheduled = True
        try:
            closure = cluster_coordinator.Closure(
                fn, closure_queue._cancellation_mgr, args=args, kwargs=None)
        finally:
            strategy.extended._being_scheduled = False
    remote_value = closure.build_output_remote_value()
    with closure_queue._queue_lock:
        closure_queue._raise_if_error()
        closure_queue.inflight_closure_count += 1
        closure.tag = None
        closure_queue._tagged_queue[worker_index].put(closure, block=False)
        closure_queue._closures_queued_condition.notify_all()
    return remote_value


def dataset_copier(dataset):
    """A function that rebuilds ``dataset`` wherever it runs (on a remote worker).

    Why: a `tf.data.Dataset` made on the chief is a variant tensor on the chief, which
    cannot be sent to another task. TF's ``PerWorkerDatasetFromDataset`` serializes the
    dataset graph and rebuilds it on each worker with private helpers; these are they.
    """
    from tensorflow.python.distribute.coordinator import values as values_lib

    graph_def = values_lib.serialize_dataset_to_graph(dataset)
    element_spec = dataset.element_spec
    return lambda: values_lib.deserialize_dataset_from_graph(graph_def, element_spec)


def track_running_closures(coordinator) -> dict:
    """``{worker index: (token, time.monotonic() at start)}`` of the steps running now.

    Why: TF's ``ClusterCoordinator`` has no step deadline. A closure sent to a frozen
    worker never returns (cancelling it does not interrupt the remote call; only the
    worker's death does), so ``fit`` would hang. Each ``Worker`` runs its closures, one
    at a time, in ``Worker._process_closure`` on its own thread; wrapping that method
    per instance records when each started. When the worker fails, TF calls
    ``Worker._on_closure_failure`` after putting the closure back in the queue; from
    then on that thread only waits for the worker to come back, so the entry is
    dropped there. ``token`` is new for every closure.
    """
    import time

    running = {}
    for worker in coordinator._cluster.workers:
        process, failed = worker._process_closure, worker._on_closure_failure

        def process_closure(closure, index=worker.worker_index, process=process):
            token = object()
            running[index] = (token, time.monotonic())
            try:
                return process(closure)
            finally:
                if running.get(index, (None,))[0] is token:
                    del running[index]

        def on_closure_failure(closure, error, index=worker.worker_index, failed=failed):
            running.pop(index, None)
            return failed(closure, error)

        worker._process_closure = process_closure
        worker._on_closure_failure = on_closure_failure
    return running


def wait_for_closures(coordinator, timeout: float) -> bool:
    """``coordinator.join()`` for at most ``timeout`` seconds: True once all are done.

    Why: ``ClusterCoordinator.join`` has no timeout; its closure queue's ``wait`` has
    one (it raises the first step error, like ``join``).
    """
    return coordinator._cluster.closure_queue.wait(timeout)


def wait_for_remote_value(remote_value, timeout: float) -> bool:
    """True once ``remote_value`` has its result or error (``fetch`` will not block).

    Why: ``RemoteValue.fetch`` has no timeout; ``RemoteValueImpl`` sets the private
    event ``_status_available_event`` when its closure is done or has failed.
    """
    return remote_value._status_available_event.wait(timeout)
