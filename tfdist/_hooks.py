"""Every private TensorFlow / Keras hook tfdist relies on, in one place.

Each hook says why it is needed, and ``tests/test_hooks.py`` fails loudly when a TF or
Keras upgrade removes what it touches. Modules elsewhere call these functions instead
of reaching into private names themselves.
"""

from __future__ import annotations

import contextlib
import itertools

from tfdist.cluster import TRAINING_TASK_TYPES

# Group keys a strategy instance may use before the next instance's range starts.
COLLECTIVE_KEY_STRIDE = 10_000
_collective_key_bases = itertools.count(1)


def assign_collective_key_base(strategy_cls_or_obj) -> int:
    """Gives a strategy instance its own range of collective group keys.

    Why: stock MirroredStrategy instances all start their group keys at 1, so two of
    them in one process (two models in a notebook) collide: "Shape mismatch in the
    collective instance 100". TF reads the private ``_collective_key_base`` attribute of
    the container strategy in ``MirroredExtended.__init__``; an instance attribute set
    before ``super().__init__`` shadows the class default of 0.
    """
    base = next(_collective_key_bases) * COLLECTIVE_KEY_STRIDE
    strategy_cls_or_obj._collective_key_base = base
    return base


# ---- multi-worker (tfdist.strategies.multi_worker) --------------------------------------

def collective_all_reduce_extended_class():
    """TF's ``CollectiveAllReduceExtended``, the engine of MultiWorkerMirroredStrategy.

    Why: ``tf.distribute.MultiWorkerMirroredStrategy.__init__`` builds it directly, so a
    subclass that wants its own extended object (tfdist's overridable
    ``_create_extended``) must import the class from its private module.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy

    return collective_all_reduce_strategy.CollectiveAllReduceExtended


def configure_coordination_service(jobs, register_timeout_seconds, heartbeat_timeout_seconds):
    """Configures TF's coordination service before MultiWorkerMirroredStrategy starts it.

    Why: TF's strategy configures the service only when none is configured, without a
    registration barrier, so a worker that never starts makes every other worker block
    forever in the constructor. ``cluster_register_with_barrier`` (a proto field the
    public ``configure_coordination_service`` does not take) makes every task wait at
    most ``register_timeout_seconds`` for all others, then fail with
    ``DeadlineExceededError``. Must run before TF initializes its context.

    Args:
        jobs: ``{task_type: [address, ...]}`` of the whole cluster.
        register_timeout_seconds: How long tasks wait for each other at start-up.
        heartbeat_timeout_seconds: Silence after which a task is declared dead.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    leader = "/job:chief/replica:0/task:0" if jobs.get("chief") else \
        "/job:worker/replica:0/task:0"
    coordinated = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(jobs[job]))
                   for job in TRAINING_TASK_TYPES if jobs.get(job)]
    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=leader, enable_health_check=True,
        cluster_register_timeout_in_ms=int(register_timeout_seconds * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000),
        coordinated_jobs=coordinated)
    config = ctx.coordination_service
    config.cluster_register_with_barrier = True
    return config


# ---- the Keras hand-off: one interface, one installer ----------------------------------

# Model methods around which (fit) or before which (the others) the strategy is told.
MODEL_EVENTS = {"fit": "around", "evaluate": "before", "predict": "before",
                "test_on_batch": "before", "predict_on_batch": "before",
                "save": "before", "save_weights": "before", "export": "before",
                "load_weights": "around"}
# Model methods a fit driver (parameter servers) replaces.
FIT_DRIVER_METHODS = ("fit", "evaluate", "predict")


class KerasHandoff:
    """What a tfdist strategy changes in Keras: the one interface behind every patch.

    A strategy class inherits it and overrides what it changes; every default is Keras'
    own behaviour. `install_keras_hooks` patches Keras once, and each patch asks the
    strategy running the code (`handoff_of`); for any other strategy Keras runs as it is.
    """

    #: Module whose fit/evaluate/predict replace Keras' own (parameter servers).
    keras_fit_driver: str | None = None
    #: Keras variables' assign_add/assign_sub are atomic (asynchronous ps updates).
    keras_atomic_updates = False
    #: model.save/save_weights write atomically and refuse NaN/inf weights.
    keras_safe_saves = False
    #: A LossScaleOptimizer skips or applies each step on every replica together.
    keras_global_finite_check = False

    def keras_local_update(self):
        """None, or ``f(optimizer, apply_fn, grads, variables)`` that replaces Keras'
        optimizer step in replica context; Keras' gradient all-reduce is then skipped."""
        return None

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        """Keras' gradient all-reduce in replica context; ``reduce`` is Keras' own."""
        return reduce(grads_and_vars)

    def keras_check_call(self, model, method, arguments):
        """Raises to refuse ``fit``/``evaluate``/``predict`` before anything runs.

        ``arguments``: the call's bound arguments. Not called for a `keras_fit_driver`.
        """
        del model, method, arguments

    def keras_fit_context(self, model, arguments):
        """The context manager ``fit`` runs in (``arguments``: fit's bound arguments)."""
        del model, arguments
        return contextlib.nullcontext()

    def keras_model_event(self, model, method, when):
        """Told ``"before"`` and ``"after"`` fit, and ``"before"`` the other `MODEL_EVENTS`."""


def handoff_of(strategy) -> KerasHandoff | None:
    """``strategy`` if it declares a Keras hand-off, else None."""
    return strategy if isinstance(strategy, KerasHandoff) else None


def _replica_handoff() -> KerasHandoff | None:
    """The hand-off of the strategy running this replica function, if any."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    return handoff_of(context.strategy) if context else None


def install_keras_hooks() -> None:
    """Patches Keras once so that strategies can declare a `KerasHandoff`. Idempotent.

    Why each patch (all private or internal Keras behaviour, tested in
    tests/test_hooks.py):

    - ``TFOptimizer._backend_apply_gradients`` and ``_all_reduce_sum_gradients``: Keras
      3 always SUM-all-reduces gradients before ``extended.update``, with no place to
      compress or count them, and model averaging and tfdist's gradient accumulation
      must apply local gradients (`KerasHandoff.keras_local_update`,
      `KerasHandoff.keras_reduce_gradients`).
    - ``keras.Model`` methods: Keras has no strategy callback around ``fit`` nor before
      evaluate/predict/save (model averaging must average first, non-chief workers must
      write elsewhere), and Keras 3 dropped parameter-server ``fit``
      (keras-team/keras#18624; `KerasHandoff.keras_fit_driver`).
    - ``LossScaleOptimizer.check_finite``: decided per replica from local gradients, so
      workers could take different branches around the all-reduce and hang.
    - ``Variable.assign_add``/``assign_sub``: Keras reads then writes, so asynchronous
      parameter-server updates lose increments.
    """
    import keras
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    if getattr(keras.Model, "_tfdist_keras_hooks", False):
        return
    _patch_optimizer(TFOptimizer)
    for name, when in MODEL_EVENTS.items():
        setattr(keras.Model, name, _model_method(name, when, getattr(keras.Model, name)))
    _patch_loss_scale_check()
    _patch_atomic_updates()
    keras.Model._tfdist_keras_hooks = True


def _patch_optimizer(TFOptimizer) -> None:
    import functools

    original_apply = TFOptimizer._backend_apply_gradients
    original_reduce = TFOptimizer._all_reduce_sum_gradients

    def _backend_apply_gradients(self, grads, trainable_variables):
        handoff = _replica_handoff()
        update = handoff.keras_local_update() if handoff else None
        if update is None:
            return original_apply(self, grads, trainable_variables)
        return update(self, original_apply, grads, trainable_variables)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        handoff = _replica_handoff()
        if handoff is None:
            return original_reduce(self, grads_and_vars)
        if handoff.keras_local_update() is not None:
            return list(grads_and_vars)  # applied locally: no all-reduce
        return handoff.keras_reduce_gradients(list(grads_and_vars),
                                              functools.partial(original_reduce, self))

    TFOptimizer._backend_apply_gradients = _backend_apply_gradients
    TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients


def _model_method(name, when, original):
    """``keras.Model.<name>`` that follows the model's strategy's hand-off."""
    import functools
    import importlib

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        handoff = handoff_of(self.distribute_strategy)
        if handoff is None:
            return original(self, *args, **kwargs)
        if handoff.keras_fit_driver and name in FIT_DRIVER_METHODS:
            driver = importlib.import_module(handoff.keras_fit_driver)
            return getattr(driver, name)(self, *args, **kwargs)
        arguments = None
        if name in FIT_DRIVER_METHODS:
            arguments = _bound_arguments(original, (self, *args), kwargs)
            handoff.keras_check_call(self, name, arguments)
        context = (handoff.keras_fit_context(self, arguments) if name == "fit"
                   else contextlib.nullcontext())
        with context:
            handoff.keras_model_event(self, name, "before")
            if name in SAVE_METHODS and handoff.keras_safe_saves:
                result = _save_safely(original, self, args, kwargs)
            else:
                result = original(self, *args, **kwargs)
            if when == "around":
                handoff.keras_model_event(self, name, "after")
        return result

    return method


def _patch_loss_scale_check() -> None:
    import tensorflow as tf
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    original = LossScaleOptimizer.check_finite

    def check_finite(self, grads):
        finite = original(self, grads)
        handoff = _replica_handoff()
        if handoff is None or not handoff.keras_global_finite_check:
            return finite
        not_finite = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(not_finite, 0.0)

    check_finite.__doc__ = original.__doc__
    LossScaleOptimizer.check_finite = check_finite


def _patch_atomic_updates() -> None:
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.tensorflow.core import Variable

    def wrap(name, original):
        def method(self, value):
            handoff = handoff_of(tf.distribute.get_strategy())
            if in_stateless_scope() or handoff is None or not handoff.keras_atomic_updates:
                return original(self, value)
            value = self._convert_to_tensor(value, dtype=self._dtype)
            return getattr(self._value, name)(tf.cast(value, self._value.dtype))

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    Variable.assign_add = wrap("assign_add", Variable.assign_add)
    Variable.assign_sub = wrap("assign_sub", Variable.assign_sub)


# ---- saves and callbacks under tfdist strategies ------------------------------------------

SAVE_METHODS = ("save", "save_weights")


def non_finite_weights(model) -> list[str]:
    """Paths of the model's floating weights holding NaN or infinity.

    Each variable, and each shard of a sharded one, is checked where it lives (on its
    ps): only one boolean per variable or shard comes to this process, not the values.
    """
    return [v.path for v in model.weights
            if "float" in str(v.dtype) and not _is_finite(v)]


def _is_finite(variable) -> bool:
    """Whether a Keras variable (sharded or not) holds only finite values."""
    import tensorflow as tf

    for part in sharded_parts(variable) or [getattr(variable, "value", variable)]:
        with tf.device(getattr(part, "device", None) or ""):
            finite = tf.reduce_all(tf.math.is_finite(part))
        if not bool(finite):
            return False
    return True


def _save_safely(original, model, args, kwargs):
    """``model.save``/``save_weights`` to a temporary sibling, fsynced, then renamed.

    A task killed mid-save leaves the previous file whole (Keras writes in place), and
    weights with NaN or infinity are refused before anything is written, so no
    checkpoint or backup holds a state that cannot train on. Calls Keras as it is for
    file objects, ``overwrite=False`` and weight files split by ``max_shard_size``.
    Variables sharded by a partitioner (parameter servers) save like any other: Keras
    reads each whole (`tfdist._sharded_io`), and `non_finite_weights` checks each shard.
    """
    import os

    from tfdist.files import atomic_path

    arguments = dict(kwargs)
    path = args[0] if args else arguments.pop("filepath", None)
    if (not isinstance(path, (str, os.PathLike)) or arguments.get("overwrite") is False
            or arguments.get("max_shard_size") or str(path).startswith(("gs://", "s3://"))):
        return original(model, *args, **kwargs)
    bad = non_finite_weights(model)
    if bad:
        raise FloatingPointError(
            f"refusing to save {os.fspath(path)!r}: weights {bad[:5]} hold NaN or infinity, "
            "and a checkpoint of them could not train on. The previous file is kept.")
    with atomic_path(path) as temp:
        return original(model, temp, *args[1:], **arguments)


def _bound_arguments(function, args, kwargs) -> dict:
    """``{parameter: value}`` of a call, defaults left out."""
    import inspect

    try:
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)


# Keras' BackupAndRestore: its private path attributes, each relative to backup_dir.
_BACKUP_PATHS = {"_weights_path": "latest.weights.h5",
                 "_training_metadata_path": "training_metadata.json",
                 "_prev_weights_path": "latest.weights.h5.bkp",
                 "_prev_training_metadata_path": "training_metadata.json.bkp"}


@contextlib.contextmanager
def keras_callbacks_write_elsewhere(callbacks, task_name: str):
    """On a worker that is not the chief, Keras' own file callbacks write to a temp dir.

    Why: Keras 3's ``ModelCheckpoint``, ``BackupAndRestore``, ``CSVLogger`` and
    ``TensorBoard`` dropped tf-keras' multi-worker logic, so every worker writes the
    chief's path (``FileExistsError``, h5 lock errors, mixed files). As tf-keras did,
    each still runs (a save may take part in collectives) but writes under a private
    temporary directory, removed when ``fit`` ends; ``BackupAndRestore`` still
    restores from the real ``backup_dir``. Paths are public attributes except
    ``BackupAndRestore``'s, which it computes in ``__init__`` (``_BACKUP_PATHS``).
    Callbacks marked ``_tfdist_chief_aware`` (tfdist's own) are left alone.

    Args:
        callbacks: The callbacks given to ``fit`` (None, a list or a CallbackList).
        task_name: This task, e.g. ``worker-1``; names the temporary directory.
    """
    import os
    import shutil

    import keras

    from tfdist.files import private_temp_dir

    callbacks = list(getattr(callbacks, "callbacks", callbacks) or [])
    directory = None
    saved = []  # (callback, attribute, value or _MISSING)

    def temp(*parts):
        nonlocal directory
        directory = directory or private_temp_dir(task_name)
        return os.path.join(directory, *parts)

    def redirect(callback, attribute, value):
        saved.append((callback, attribute, callback.__dict__.get(attribute, _MISSING)))
        setattr(callback, attribute, value)

    def restore_then_write_to_temp(callback, backup_dir):
        original = callback.on_train_begin

        def on_train_begin(logs=None):
            original(logs)
            callback.backup_dir = backup_dir
            for attribute, name in _BACKUP_PATHS.items():
                setattr(callback, attribute, os.path.join(backup_dir, name))

        return on_train_begin

    for index, callback in enumerate(callbacks):
        if getattr(callback, "_tfdist_chief_aware", False):
            continue
        if isinstance(callback, keras.callbacks.ModelCheckpoint):
            redirect(callback, "filepath", temp(f"checkpoint-{index}",
                                                os.path.basename(callback.filepath)))
        elif isinstance(callback, keras.callbacks.CSVLogger):
            redirect(callback, "filename", temp(os.path.basename(callback.filename)))
        elif isinstance(callback, keras.callbacks.TensorBoard):
            redirect(callback, "log_dir", temp(f"tensorboard-{index}"))
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            for attribute in ("backup_dir", *_BACKUP_PATHS):
                saved.append((callback, attribute, callback.__dict__[attribute]))
            redirect(callback, "on_train_begin",
                     restore_then_write_to_temp(callback, temp(f"backup-{index}")))
    try:
        yield
    finally:
        for callback, attribute, value in reversed(saved):
            if value is _MISSING:
                callback.__dict__.pop(attribute, None)
            else:
                setattr(callback, attribute, value)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


_MISSING = object()


def dataset_batch_size(dataset) -> int | None:
    """The batch size a `tf.data.Dataset` was batched with, or None if unknown.

    Why: a global batch that does not split evenly over the replicas fails in Keras'
    first step; TF knows the batch size of a dataset (partial batches aside) only
    through the private ``compute_batch_size``, which walks the dataset graph.
    """
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import distribute

    try:
        size = int(distribute.compute_batch_size(dataset).numpy())
    except (IndexError, ValueError, tf.errors.OpError):  # e.g. an unbatched dataset
        return None
    return size if size > 0 else None


def overrides_backend_update_step(optimizer) -> bool:
    """Whether a Keras optimizer class does work outside ``update_step``.

    Why: the outer optimizer of model averaging is stepped in cross-replica context,
    where Keras' ``apply`` cannot run (it needs a replica context); tfdist calls
    ``update_step`` per variable, as ``TFOptimizer._distributed_tf_update_step`` does.
    Optimizers overriding ``_backend_update_step`` (Nadam) would lose that work.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return type(optimizer)._backend_update_step is not TFOptimizer._backend_update_step


# ---- parameter server (tfdist.strategies.parameter_server, tfdist.keras.ps_fit) ---------

def build_keras_state(model, data_spec) -> None:
    """Creates the model's, metrics' and optimizer's variables from a batch's spec.

    Why: steps traced for remote workers must not create variables, so everything has
    to exist on the ps tasks first. Keras' own fit does this with the private
    ``Trainer._symbolic_build(data_batch=...)``, which only needs ``.shape`` and
    ``.dtype`` of each element: a dataset's ``element_spec`` works.
    """
    model._symbolic_build(data_batch=data_spec)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def keras_initial_epoch(model, initial_epoch: int) -> int:
    """The epoch to start from: `BackupAndRestore` stores it in ``model._initial_epoch``.

    Why: Keras' fit reads this private attribute after ``on_train_begin``; a fit driver
    has to do the same for `keras.callbacks.BackupAndRestore` to resume.
    """
    return getattr(model, "_initial_epoch", None) or initial_epoch


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
    closure back on the shared queue and another worker runs it.
    """
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    cluster = coordinator._cluster
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


def tf_distribute_internals():
    """TF's private pieces a strategy with its own ``extended`` is built from.

    Why: `tfdist.HorovodStrategy` extends ``MirroredExtended`` (local replicas as in
    MirroredStrategy) and reroutes its reductions, gathers and input sharding; TF has
    no public base class for a strategy's ``extended``, nor public versions of these
    helpers. Returns a namespace with: ``MirroredExtended``, ``simple_broadcast``,
    ``reduce_non_distributed_value``, ``get_distributed_dataset``,
    ``get_distributed_datasets_from_function``, ``regroup``, ``is_mirrored``,
    ``CheckpointInitialValue``.
    """
    import types

    from tensorflow.python.distribute import cross_device_ops, distribute_utils, input_util
    from tensorflow.python.distribute import mirrored_strategy
    from tensorflow.python.trackable import base as trackable

    return types.SimpleNamespace(
        MirroredExtended=mirrored_strategy.MirroredExtended,
        simple_broadcast=cross_device_ops.simple_broadcast,
        reduce_non_distributed_value=cross_device_ops.reduce_non_distributed_value,
        get_distributed_dataset=input_util.get_distributed_dataset,
        get_distributed_datasets_from_function=input_util.get_distributed_datasets_from_function,
        regroup=distribute_utils.regroup,
        is_mirrored=distribute_utils.is_mirrored,
        CheckpointInitialValue=trackable.CheckpointInitialValue,
    )


def keras_uses_multi_worker_path(strategy) -> bool:
    """True if Keras 3 reduces ``strategy``'s step outputs across processes.

    Why: Keras' private ``reduce_per_replica`` averages loss/metrics with
    ``strategy.reduce`` and gathers ``predict`` outputs with ``strategy.gather`` only
    for ``tf.distribute.MultiWorkerMirroredStrategy`` instances whose
    ``extended._in_multi_worker_mode()`` is True; for any other strategy it keeps this
    process's values. `tfdist.HorovodStrategy` subclasses that class for this reason.
    """
    from keras.src.backend.tensorflow import trainer

    return bool(trainer._collective_all_reduce_multi_worker(strategy))


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


def keras_metrics_or_logs(model, logs):
    """The model's metrics read now, or ``logs`` when a custom step returned other keys.

    Why: Keras' fit uses the private ``Trainer._get_metrics_result_or_logs`` for the
    epoch logs (written for asynchronous steps, where the last step's logs are stale).
    """
    return model._get_metrics_result_or_logs(logs)


def keras_flatten_metrics(model, logs):
    """``evaluate``'s list result in Keras' order (private ``_flatten_metrics_in_order``)."""
    return model._flatten_metrics_in_order(logs)


def sharded_parts(variable):
    """The shard variables of a Keras/TF variable sharded by a partitioner, or None."""
    import tensorflow as tf

    value = getattr(variable, "value", variable)
    if isinstance(value, tf.__internal__.distribute.ShardedVariable):
        return list(value.variables)
    return None


def _join_shard_gradients(grads, parts):
    """One gradient for a sharded variable from its shards' gradients (axis 0)."""
    import tensorflow as tf

    if all(g is None for g in grads):
        return None
    if not any(isinstance(g, tf.IndexedSlices) for g in grads):
        return tf.concat([tf.zeros(p.shape, p.dtype) if g is None else g
                          for g, p in zip(grads, parts)], axis=0)
    values, indices, offset = [], [], 0
    for g, p in zip(grads, parts):
        if g is not None:
            if not isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]))
            values.append(g.values)
            indices.append(tf.cast(g.indices, tf.int64) + offset)
        offset += int(p.shape[0])
    full_shape = tf.constant([offset] + parts[0].shape.as_list()[1:], tf.int64)
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), full_shape)


import contextlib as _contextlib  # noqa: E402


def _shard_aware_gradient(original):
    """``GradientTape.gradient`` that takes each shard's gradient and joins them."""
    import tensorflow as tf

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        flat = tf.nest.flatten(sources)
        layout, expanded = [], []
        for source in flat:
            parts = sharded_parts(source)
            layout.append((len(expanded), parts))
            expanded.extend(parts if parts is not None else [source])
        if len(expanded) == len(flat):
            return original(self, target, sources, output_gradients, unconnected_gradients)
        grads = original(self, target, expanded, output_gradients, unconnected_gradients)
        joined = [grads[start] if parts is None else
                  _join_shard_gradients(grads[start:start + len(parts)], parts)
                  for start, parts in layout]
        return tf.nest.pack_sequence_as(sources, joined)

    gradient.__doc__ = original.__doc__
    gradient._tfdist_shard_aware = True
    return gradient


@_contextlib.contextmanager
def shard_aware_gradients():
    """``GradientTape.gradient`` works for sharded Keras variables inside this context.

    Why: see `install_shard_aware_gradients`, which does the same for good; this
    context restores the class attribute after.
    """
    import tensorflow as tf

    original = tf.GradientTape.gradient
    tf.GradientTape.gradient = _shard_aware_gradient(original)
    try:
        yield
    finally:
        tf.GradientTape.gradient = original


def install_shard_aware_gradients() -> None:
    """``tape.gradient(loss, sources)`` works when a source is sharded. Idempotent.

    Why: a Keras 3 variable whose value a partitioner split into a `ShardedVariable`
    has no ``handle``, so ``tape.gradient(loss, model.trainable_variables)`` (Keras'
    ``train_step``, or a custom loop) fails with "'ShardedVariable' object has no
    attribute 'handle'". The patched ``GradientTape.gradient`` takes the gradient of
    each shard and joins them along axis 0 (IndexedSlices with global row indices, or a
    dense concat): one full-shape gradient per sharded variable, which the optimizer
    applies shard by shard (`install_sharded_optimizer_state`). Calls without a sharded
    source run TF's method unchanged.
    """
    import tensorflow as tf

    if not getattr(tf.GradientTape.gradient, "_tfdist_shard_aware", False):
        tf.GradientTape.gradient = _shard_aware_gradient(tf.GradientTape.gradient)


def div_partitioned(parts) -> bool:
    """Whether shards split axis 0 as ``tf.nn.embedding_lookup`` expects ("div": the
    first ``rows % n`` shards hold one row more), as TF's partitioners do."""
    rows = sum(int(p.shape[0]) for p in parts)
    base, extra = divmod(rows, len(parts))
    return [int(p.shape[0]) for p in parts] == [base + (i < extra) for i in range(len(parts))]


def _on_a_ps(variable):
    """``[the TF variable]`` when it lives on a parameter server, else None."""
    value = getattr(variable, "value", variable)
    return [value] if "/job:ps/" in (getattr(value, "device", "") or "") else None


def install_sharded_embedding_lookup() -> None:
    """Keras' ``Embedding`` looks ids up on the parameter servers when its table is
    sharded or on a ps. Idempotent.

    Why: its ``call`` is ``ops.take(self.embeddings, ids)``, which reads a
    `ShardedVariable` whole: every step each worker copies every shard and joins them
    (3.6x the table per worker, benchmarks/sharded_embedding.md); a table on one ps is
    read whole too. TF's partitioned ``tf.nn.embedding_lookup`` gathers each id on the ps
    that holds its row. Other tables, LoRA and quantized tables run Keras' own ``call``.
    """
    import tensorflow as tf
    from keras.src.layers.core.embedding import Embedding

    if getattr(Embedding.call, "_tfdist_shard_lookup", False):
        return
    original = Embedding.call

    def call(self, inputs):
        parts = None
        if not self.lora_enabled and not getattr(self, "quantization_mode", None):
            parts = sharded_parts(self._embeddings) or _on_a_ps(self._embeddings)
        if not parts or not div_partitioned(parts):
            return original(self, inputs)
        ids = tf.convert_to_tensor(inputs)
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        return tf.cast(tf.nn.embedding_lookup(parts, ids), self.compute_dtype)

    call._tfdist_shard_lookup = True
    call._tfdist_original = original
    Embedding.call = call


def install_shard_sized_initialization() -> None:
    """Under a strategy with a variable partitioner, Keras variables tell TF their shape.
    Idempotent.

    Why: Keras 3 creates ``tf.Variable(lambda: initializer(shape))`` without ``shape=``,
    so TF's parameter-server strategy computes the whole initial value on the chief,
    then ships a slice to each ps (5x the table on the chief for a 2-shard table,
    benchmarks/sharded_embedding.md). Given the shape, TF runs the initializer inside
    each shard's creation on its ps, passing the shard's ``partition_shape`` and
    ``partition_offset``; `initial_rows` then draws that shard's rows only, and other
    initializers compute the whole value, of which TF keeps the shard's rows. Either
    way the values equal the unsharded ones.
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow.core import Variable

    if getattr(Variable._initialize_with_initializer, "_tfdist_shaped", False):
        return
    original = Variable._initialize_with_initializer

    def _initialize_with_initializer(self, initializer):
        strategy = tf.distribute.get_strategy()
        if getattr(strategy.extended, "_variable_partitioner", None) is None:
            return original(self, initializer)
        shape, dtype = self._shape, self._dtype

        def initial_value(partition_shape=None, partition_offset=None):
            # TF's protocol: called once per shard with these; a full value is sliced.
            if partition_shape is not None:
                rows = initial_rows(initializer, shape, dtype, partition_shape,
                                    partition_offset)
                if rows is not None:
                    return rows
            return initializer(shape, dtype=dtype)

        self._value = tf.Variable(
            initial_value, shape=shape, dtype=dtype, trainable=self.trainable,
            name=self.name, aggregation=self._map_aggregation(self.aggregation),
            synchronization=self._map_synchronization(self.synchronization))

    _initialize_with_initializer._tfdist_shaped = True
    _initialize_with_initializer._tfdist_original = original
    Variable._initialize_with_initializer = _initialize_with_initializer


# float32 values of a Philox uniform or normal draw per counter step (TF's CPU kernels).
_FLOAT32_PER_PHILOX_STEP = 4


def _draws_elementwise(initializer) -> bool:
    """Whether ``initializer`` is one stateless uniform or normal draw of its shape,
    scaled and shifted (Keras' RandomUniform, RandomNormal, and VarianceScaling with a
    uniform or untruncated normal draw: Glorot/He/LeCun uniform), with an int seed."""
    import keras

    init = keras.initializers
    kind = type(initializer)
    if not isinstance(getattr(initializer, "seed", None), int):
        return False  # a SeedGenerator draws anew on each call
    if kind in (init.RandomUniform, init.RandomNormal):
        return True
    return isinstance(initializer, init.VarianceScaling) and \
        kind.__call__ is init.VarianceScaling.__call__ and \
        initializer.distribution in ("uniform", "untruncated_normal")


def initial_rows(initializer, shape, dtype, partition_shape, partition_offset):
    """The rows of ``initializer(shape, dtype)`` that one shard holds, computed alone;
    None where that is not known to be possible (the caller computes the whole value).

    Keras' constant initializers are called at the shard's shape. A random draw of
    Keras (`_draws_elementwise`) calls ``tf.random.stateless_uniform``/``_normal`` on
    the whole shape: while it runs those draw the shard's rows only, from TF's own
    key and counter advanced past the rows before (Philox makes 4 float32 values per
    counter step), then scale and shift them as TF does. The values are the whole
    draw's rows, bit for bit (tests/test_hooks.py checks it against the whole draw).
    """
    import numpy as np
    import keras
    import tensorflow as tf

    init = keras.initializers
    rows_shape = [int(d) for d in partition_shape]
    if type(initializer) in (init.Zeros, init.Ones, init.Constant):
        return initializer(tuple(rows_shape), dtype=dtype)
    whole = tuple(int(d) for d in shape)
    skip, rest = divmod(int(partition_offset[0]) * int(np.prod(whole[1:])),
                        _FLOAT32_PER_PHILOX_STEP)
    if rest or tf.as_dtype(dtype) != tf.float32 or not _draws_elementwise(initializer):
        return None

    def rows_of(raw_op, scale_and_shift):
        def draw(shape, seed, *args, **kwargs):
            if tuple(int(d) for d in shape) != whole:
                raise ValueError(f"a draw of shape {shape}, not the variable's {whole}")
            key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
            low = counter[0] + tf.constant(skip, tf.uint64)  # a 128-bit counter: carry
            counter = tf.stack([low, counter[1] + tf.cast(low < counter[0], tf.uint64)])
            values = raw_op(shape=rows_shape, key=key, counter=counter, alg=1,  # Philox
                            dtype=tf.float32)
            return scale_and_shift(values, *args, **kwargs)
        return draw

    def uniform(values, minval=0, maxval=None, dtype=None, name=None, alg=None):
        low = tf.convert_to_tensor(minval, tf.float32)
        high = tf.convert_to_tensor(1 if maxval is None else maxval, tf.float32)
        return tf.add(values * (high - low), low)

    def normal(values, mean=0.0, stddev=1.0, dtype=None, name=None, alg=None):
        return tf.add(values * tf.convert_to_tensor(stddev, tf.float32),
                      tf.convert_to_tensor(mean, tf.float32))

    saved = tf.random.stateless_uniform, tf.random.stateless_normal
    tf.random.stateless_uniform = rows_of(tf.raw_ops.StatelessRandomUniformV2, uniform)
    tf.random.stateless_normal = rows_of(tf.raw_ops.StatelessRandomNormalV2, normal)
    try:
        value = initializer(whole, dtype=dtype)
    finally:
        tf.random.stateless_uniform, tf.random.stateless_normal = saved
    return value if list(value.shape) == rows_shape else None


# Elementwise Keras optimizers: one update_step per shard of a sharded variable, on that
# shard of the variable, gradient and slots. Others (Lamb's norms, Muon, Adafactor's
# factored moments) update a sharded variable as a whole.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
                          "Adadelta", "Ftrl", "Lion")


def updates_shard_by_shard(optimizer) -> bool:
    """Whether ``optimizer``'s update_step is one of `ELEMENTWISE_OPTIMIZERS`'."""
    import keras

    step = type(optimizer).update_step
    return any(step is getattr(keras.optimizers, name).update_step
               for name in ELEMENTWISE_OPTIMIZERS)


def sharded_slots(optimizer, variable) -> list:
    """The optimizer variables created (sharded) for the sharded ``variable``."""
    return list(getattr(optimizer, "_tfdist_sharded_slots", {}).get(
        optimizer._var_key(variable), []))


def _shard_gradient(grad, offset, part):
    """Rows ``offset:offset + rows(part)`` of a full-shape gradient, as ``part``'s."""
    import tensorflow as tf

    rows = int(part.shape[0])
    if not isinstance(grad, tf.IndexedSlices):
        return grad[offset:offset + rows]
    indices = tf.cast(grad.indices, tf.int64)
    mine = tf.logical_and(indices >= offset, indices < offset + rows)
    return tf.IndexedSlices(tf.boolean_mask(grad.values, mine),
                            tf.boolean_mask(indices, mine) - offset,
                            tf.constant(part.shape.as_list(), tf.int64))


# A shard's update runs on blocks of at most this many bytes of rows, one block after
# the other: Keras' dense updates (Adam's moments decay on every row) would otherwise
# make several shard-sized temporaries on the ps.
UPDATE_BLOCK_BYTES = 16 << 20
_row_block_ids = itertools.count()


class _RowBlock:
    """Rows ``start:start + rows`` of a variable, as a Keras optimizer uses a variable:
    read with a gather and written with scatters, so no op touches the other rows."""

    def __init__(self, source, start, rows):
        import tensorflow as tf

        self.source, self.start, self.rows = source, start, rows
        self.shape = tf.TensorShape([rows]).concatenate(source.shape[1:])
        self.dtype, self.device = source.dtype, source.device
        self.name = f"{source.name}/rows_{start}"
        self.writes = []  # the scatter ops that updated these rows
        self._unique_id = f"tfdist_rows_{next(_row_block_ids)}"  # Keras' _var_key

    def _indices(self):
        import tensorflow as tf

        return tf.range(self.start, self.start + self.rows, dtype=tf.int64)

    def __tf_tensor__(self, dtype=None, name=None):
        import tensorflow as tf

        value = self.source.sparse_read(self._indices())
        return value if dtype is None else tf.cast(value, dtype)

    def _slices(self, value):
        import tensorflow as tf

        if isinstance(value, tf.IndexedSlices):
            return tf.cast(value.indices, tf.int64) + self.start, value.values
        return self._indices(), tf.convert_to_tensor(value, self.dtype)

    def _scatter(self, op, value):
        indices, updates = self._slices(value)
        write = op(resource=self.source.handle, indices=indices, updates=updates)
        self.writes.append(write)
        return write

    def assign(self, value):
        import tensorflow as tf

        return self._scatter(tf.raw_ops.ResourceScatterUpdate, value)

    def assign_add(self, value):
        import tensorflow as tf

        return self._scatter(tf.raw_ops.ResourceScatterAdd, value)

    def assign_sub(self, value):
        import tensorflow as tf

        return self._scatter(tf.raw_ops.ResourceScatterSub, value)

    scatter_update, scatter_add, scatter_sub = assign, assign_add, assign_sub


def _update_in_row_blocks(optimizer, variable, shard, grad, learning_rate):
    """``optimizer.update_step(grad, shard)`` (inside `_shard_view`), on blocks of
    rows when the shard is larger than the strategy's ``update_block_bytes`` (default
    `UPDATE_BLOCK_BYTES`; None: never).

    Elementwise, so each row's result is the one the whole shard's update gives, bit
    for bit. Each block starts after the one before has finished (control
    dependencies: without them TF runs them all at once, and their temporaries add up
    to the shard's), so one block's temporaries are freed before the next.
    """
    import numpy as np
    import tensorflow as tf

    block_bytes = getattr(tf.distribute.get_strategy(), "update_block_bytes",
                          UPDATE_BLOCK_BYTES)
    row_bytes = shard.dtype.size * int(np.prod(shard.shape[1:]))
    rows = int(shard.shape[0])
    per_block = rows if block_bytes is None else max(1, block_bytes // max(1, row_bytes))
    if rows <= per_block:
        return optimizer.update_step(grad, shard, learning_rate)

    slots = sharded_slots(optimizer, variable)
    shard_slots = [slot._value for slot in slots]
    indices = optimizer._trainable_variables_indices
    previous = []  # the writes of the block before: the next one starts after them
    for start in range(0, rows, per_block):
        block = _RowBlock(shard, start, min(per_block, rows - start))
        views = [block] + [_RowBlock(value, start, block.rows) for value in shard_slots]
        indices[block._unique_id] = optimizer._get_variable_index(variable)
        for slot, view in zip(slots, views[1:]):
            slot._value = view
        try:
            with tf.control_dependencies(previous):
                optimizer.update_step(_shard_gradient(grad, start, block), block,
                                      learning_rate)
        finally:
            for slot, value in zip(slots, shard_slots):
                slot._value = value
            del indices[block._unique_id]
        previous = [write for view in views for write in view.writes]


@_contextlib.contextmanager
def _shard_view(optimizer, variable, index, part):
    """While ``optimizer.update_step(grad, part)`` is traced for shard ``index`` of
    ``variable``: ``part`` has ``variable``'s slots, each seen as its own shard ``index``."""
    slots = sharded_slots(optimizer, variable)
    indices = optimizer._trainable_variables_indices
    key = optimizer._var_key(part)
    added = key not in indices  # a shard may share its key with the sharded variable
    indices[key] = optimizer._get_variable_index(variable)
    saved = [slot._value for slot in slots]
    for slot, value in zip(slots, saved):
        slot._value = value.variables[index]
    try:
        yield
    finally:
        for slot, value in zip(slots, saved):
            slot._value = value
        if added:
            del indices[key]


def install_sharded_optimizer_state() -> None:
    """Keras optimizer slots of a sharded variable are sharded alike, on the same ps.

    Why: Keras' ``TFOptimizer.add_variable_from_reference`` creates each slot (Adam's
    moments, momentum, ...) under ``colocate_vars_with(variable.value)``; for a
    `ShardedVariable` that puts ONE unsharded copy on the chief (TF 2.21). Patched:

    - ``add_variable_from_reference`` for a sharded variable makes the slot a Keras
      variable whose value is a `ShardedVariable` with one shard per shard of the
      variable, each colocated with it (same rows, same ps), initialized by Keras'
      initializer at the shard's shape (a ``variable_creator_scope`` around Keras'
      own method). The optimizer's variables keep Keras' order and names, so saved
      optimizer state reads as the unsharded one's.
    - ``_distributed_tf_update_step``: for `ELEMENTWISE_OPTIMIZERS`, the full-shape
      gradient of a sharded variable is cut into its shards' rows, and
      ``update_step`` runs once per shard, through ``extended.update(shard, ...)``
      (colocated with the shard: the update runs on its ps), with the slots swapped to
      their shard (`_shard_view`: the private ``_trainable_variables_indices``, and the
      Keras variables' ``_value``, while tracing). Other optimizers update the whole
      `ShardedVariable` (`allow_sharded_updates`). Variables that are not sharded keep
      Keras' path.
    """
    import functools

    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers import base_optimizer

    if getattr(TFOptimizer, "_tfdist_sharded_state", False):
        return
    original_add = TFOptimizer.add_variable_from_reference
    original_update = TFOptimizer._distributed_tf_update_step

    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        parts = sharded_parts(reference_variable)
        if parts is None:
            return original_add(self, reference_variable, name=name, initializer=initializer)
        init = keras.initializers.get(initializer)

        def creator(next_creator, **kwargs):
            shards = []
            for i, part in enumerate(parts):
                kw = dict(kwargs, shape=part.shape, name=f"{kwargs.get('name')}/part_{i}",
                          initial_value=functools.partial(init, tuple(part.shape),
                                                          dtype=kwargs.get("dtype")))
                if tf.distribute.has_strategy():  # its creator colocates (no partitioning)
                    kw.update(colocate_with=part, use_resource=True)
                    shards.append(next_creator(**kw))
                else:
                    with tf.device(part.device):
                        shards.append(next_creator(**kw))
            return tf.__internal__.distribute.ShardedVariable(shards)

        with tf.init_scope(), tf.variable_creator_scope(creator):
            slot = base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)
        self.__dict__.setdefault("_tfdist_sharded_slots", {}).setdefault(
            self._var_key(reference_variable), []).append(slot)
        return slot

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        sharded = [(g, v) for g, v in grads_and_vars if sharded_parts(v) is not None]
        if not sharded or not updates_shard_by_shard(self):
            return original_update(self, distribution, grads_and_vars, learning_rate)
        original_update(self, distribution, [(g, v) for g, v in grads_and_vars
                                             if sharded_parts(v) is None], learning_rate)
        for grad, var in sharded:
            offset = 0
            for index, part in enumerate(sharded_parts(var)):
                def update_shard(shard, grad, learning_rate, var=var, index=index):
                    with _shard_view(self, var, index, shard):
                        _update_in_row_blocks(self, var, shard, grad, learning_rate)

                distribution.extended.update(
                    part, update_shard, args=(_shard_gradient(grad, offset, part),
                                              learning_rate), group=False)
                offset += int(part.shape[0])

    add_variable_from_reference.__doc__ = original_add.__doc__
    add_variable_from_reference._tfdist_original = original_add
    _distributed_tf_update_step._tfdist_original = original_update
    TFOptimizer.add_variable_from_reference = add_variable_from_reference
    TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step
    TFOptimizer._tfdist_sharded_state = True


def allow_sharded_updates(extended) -> None:
    """Lets ``strategy.extended.update`` take a `ShardedVariable` (Keras' optimizer).

    Why: Keras 3's TF optimizer updates each variable with ``extended.update(var, fn)``;
    the parameter-server extended's private ``_update`` colocates ``fn`` with ``var``,
    which a `ShardedVariable` refuses ("doesn't support being used as a reference").
    For a sharded variable ``fn`` runs uncolocated: its assign/scatter ops update each
    shard on that shard's own ps. Other variables keep TF's path.
    """
    import tensorflow as tf
    from tensorflow.python.distribute import distribute_lib

    original = extended._update

    def _update(var, fn, args, kwargs, group):
        if not isinstance(var, tf.__internal__.distribute.ShardedVariable):
            return original(var, fn, args, kwargs, group)
        with distribute_lib.UpdateContext(var.variables[0].device):
            result = fn(var, *extended._select_single_value(args),
                        **extended._select_single_value(kwargs))
        return result if group else tf.nest.map_structure(extended._local_results, result)

    extended._update = _update


def set_initial_epoch(model, epoch: int) -> None:
    """Makes the running ``fit`` start at ``epoch`` (used to resume from a backup).

    Why: Keras 3 has no public way for a callback to move ``fit``'s first epoch; its own
    ``BackupAndRestore`` sets the private ``model._initial_epoch`` in
    ``on_train_begin``, which the TF trainer reads right after
    (``initial_epoch = self._initial_epoch or initial_epoch``).
    """
    model._initial_epoch = int(epoch)


# ---- synchronous strategies: compression, byte counting, accumulation ------------------

def keras_distributed_update(optimizer, distribution, grads, variables) -> None:
    """Applies already-reduced ``grads`` with the Keras optimizer in cross-replica context.

    Why: tfdist's gradient accumulation all-reduces once per k micro-batches inside a
    cross-replica ``cond`` and then needs Keras' per-variable update without its
    all-reduce. That is ``TFOptimizer._distributed_tf_update_step``, a private method.
    """
    optimizer._distributed_tf_update_step(distribution, list(zip(grads, variables)),
                                          optimizer.learning_rate)


# ---- parameter server: step deadline (tfdist.strategies.parameter_server) ---------------


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
