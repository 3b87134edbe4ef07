"""Keras 3 ``fit``/``evaluate``/``predict`` for `tfdist.ParameterServerStrategy`.

Keras 3 dropped parameter-server support (keras-team/keras#18624). For a model built
under a `tfdist.ParameterServerStrategy`, ``model.fit`` and friends are routed here (see
`tfdist._hooks.KerasHandoff.keras_fit_driver`) and run on the chief:

* training steps are `ClusterCoordinator` closures that call the model's own
  ``train_step`` on a worker, reading that worker's shard of the input;
* ``mode="async"``: each closure applies its own update (Keras' optimizer, on the ps);
* ``mode="sync"``: a step is one closure on each of the K workers, each adding its
  gradient (times 1/K) to accumulators on the ps, then one apply of the sum from the
  chief: the same update as one step on the K-times-larger batch;
* every step has an id, and its update (or gradient sum) runs on a ps under a ledger
  of applied ids, so a step that TF's coordinator runs again after its worker died is
  applied once (see `_once`);
* callbacks, History and the progress bar get values fetched from the workers, every
  ``steps_per_dispatch`` steps, and the epoch's metrics read from the ps at its end;
* ``evaluate`` and ``predict`` send each batch to a free worker, so every batch is seen
  exactly once.

Input: a `tf.data.Dataset` (batched; worker ``i`` of K reads ``dataset.shard(K, i)``
repeated), a dataset function ``fn(input_context)`` (called once per worker with
``InputContext(num_input_pipelines=K, input_pipeline_id=i)``; its dataset is repeated),
or numpy arrays (batched by ``batch_size``, shuffled with one seed on every worker,
batches sharded over the workers).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import threading
import weakref

import numpy as np
import tensorflow as tf

from tfdist import _hooks
from tfdist.strategies._optimizer import inner_optimizer
from tfdist.strategies.parameter_server import ParameterServerUnavailableError

DEFAULT_BATCH_SIZE = 32
# Step ids the exactly-once ledger remembers (a ring): far more than steps in flight.
LEDGER_SIZE = 1 << 16
_drivers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_step_ids = itertools.count(1)  # 0 marks an empty ledger slot


# ---- inputs -----------------------------------------------------------------------------

def _is_dataset(x) -> bool:
    return isinstance(x, tf.data.Dataset)


def _is_dataset_fn(x) -> bool:
    return callable(x) and not _is_dataset(x) and not hasattr(x, "shape")


def _arrays_dataset(x, y, sample_weight):
    parts = (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
    return tf.data.Dataset.from_tensor_slices(parts)


def _num_examples(x) -> int:
    return int(tf.nest.flatten(x)[0].shape[0])


def _check_arrays(x, name):
    leaves = tf.nest.flatten(x)
    if x is None or not leaves or not all(hasattr(leaf, "shape") for leaf in leaves):
        raise ValueError(
            f"ParameterServerStrategy takes numpy arrays (or tensors), a batched "
            f"tf.data.Dataset, or a dataset function fn(input_context) as {name}. "
            f"Received: {name}={type(x).__name__}")


def _cardinality(dataset) -> int:
    return int(dataset.cardinality().numpy())


class TrainInput:
    """What the workers read in fit: a dataset function per worker, and its spec."""

    def __init__(self, strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch):
        k = strategy.num_workers
        replicas = strategy.num_replicas_in_sync
        if _is_dataset(x) or _is_dataset_fn(x):
            for name, value in (("y", y), ("sample_weight", sample_weight)):
                if value is not None:
                    raise ValueError(f"{name} must be None when x is a dataset or a dataset "
                                     f"function (put it in the dataset). Received: "
                                     f"{name}={type(value).__name__}")
        if _is_dataset(x):
            batches = _cardinality(x)
            copy_fn = _hooks.dataset_copier(x)
            shard = 0 < batches and batches >= k

            def make(i):
                def dataset_fn():
                    dataset = copy_fn()
                    return (dataset.shard(k, i) if shard else dataset).repeat()
                return dataset_fn

            self.element_spec = x.element_spec
            default_steps = batches if batches > 0 else None
        elif _is_dataset_fn(x):
            def make(i):
                context = tf.distribute.InputContext(
                    num_input_pipelines=k, input_pipeline_id=i, num_replicas_in_sync=replicas)
                return lambda: x(context).repeat()

            sample = x(tf.distribute.InputContext(k, 0, replicas))
            if not _is_dataset(sample):
                raise ValueError("a dataset function must return a tf.data.Dataset. "
                                 f"Received: {type(sample).__name__}")
            self.element_spec = sample.element_spec
            batches = _cardinality(sample)
            default_steps = batches * k if batches > 0 else None
        else:
            _check_arrays(x, "x")
            batch_size = batch_size or DEFAULT_BATCH_SIZE
            n = _num_examples(x)
            seed = int(np.random.randint(0, 2**31 - 1))

            def make(i):
                def dataset_fn():
                    dataset = _arrays_dataset(x, y, sample_weight)
                    if shuffle:
                        # One seed on every worker: the same order, then disjoint batches.
                        dataset = dataset.shuffle(n, seed=seed, reshuffle_each_iteration=True)
                    return dataset.batch(batch_size).shard(k, i).repeat() if n >= k * batch_size \
                        else dataset.batch(batch_size).repeat()
                return dataset_fn

            self.element_spec = _arrays_dataset(x, y, sample_weight).batch(batch_size).element_spec
            default_steps = math.ceil(n / batch_size)
        if steps_per_epoch is None:
            # One epoch is one pass over the data; a sync step reads K batches.
            if default_steps is not None and strategy.mode == "sync":
                default_steps = max(1, math.ceil(default_steps / k))
            if default_steps is None:
                raise ValueError("steps_per_epoch is required when the dataset is infinite or "
                                 "its length is unknown. Received: steps_per_epoch=None")
            steps_per_epoch = default_steps
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or \
                steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be an integer >= 1. "
                             f"Received: steps_per_epoch={steps_per_epoch!r}")
        self.steps_per_epoch = steps_per_epoch
        self.dataset_fns = [make(i) for i in range(k)]


def _chief_dataset(strategy, x, y, sample_weight, batch_size, steps):
    """A finite dataset iterated on the chief, whose batches are shipped to workers."""
    if _is_dataset_fn(x):
        x = x(tf.distribute.InputContext(1, 0, strategy.num_replicas_in_sync))
    if _is_dataset(x):
        if y is not None or sample_weight is not None:
            raise ValueError("y and sample_weight must be None when x is a dataset. "
                             f"Received: y={type(y).__name__}, "
                             f"sample_weight={type(sample_weight).__name__}")
        dataset = x
    else:
        _check_arrays(x, "x")
        dataset = _arrays_dataset(x, y, sample_weight).batch(batch_size or DEFAULT_BATCH_SIZE)
    if steps is not None:
        dataset = dataset.take(steps)
    elif _cardinality(dataset) == tf.data.INFINITE_CARDINALITY:
        raise ValueError("steps is required when the dataset is infinite. Received: steps=None")
    return dataset


# ---- the per-model driver ---------------------------------------------------------------

def _local(strategy, value, how):
    """One tensor from a per-replica value: the mean (logs) or concatenation (outputs)."""
    def merge(v):
        if not isinstance(v, tf.distribute.DistributedValues):
            return v
        parts = strategy.experimental_local_results(v)
        if how == "concat":
            return tf.concat(parts, axis=0)
        return tf.reduce_mean(tf.stack(parts), axis=0)

    return tf.nest.map_structure(merge, value)


def _to_python(logs):
    out = {}
    for key, value in (logs or {}).items():
        value = np.asarray(value)
        out[key] = value.item() if value.ndim == 0 else value
    return out


class _Ledger:
    """The ids of the steps whose updates were applied, kept on a ps (a ring).

    A step closure that is cut short (its worker died or was killed) is run again by
    the coordinator with the same id. Its updates may already have been applied: the
    ledger says so, and the second run applies nothing (see `_once`).
    """

    def __init__(self, strategy, anchor):
        with strategy.scope(), strategy.extended.colocate_vars_with(anchor):
            self.ids = tf.Variable(tf.zeros([LEDGER_SIZE], tf.int64), trainable=False,
                                   name="tfdist_applied_steps")
        self.device = self.ids.device


def _once(ledger, step_id, tensors, apply):
    """Runs ``apply(tensors)`` on the ps unless step ``step_id`` was applied before
    (just ``apply(tensors)`` if ``ledger`` is None: ``exactly_once=False``).

    While tracing a step. All of ``tensors`` (the gradients) are first moved to the
    ledger's ps together (one ``IdentityN``), then the check, ``apply`` and the ledger
    write run there, in that order, with nothing left to come from the worker: a worker
    that dies before every gradient has arrived applies nothing, one that dies after
    cannot stop the update. The rerun of a step then applies it only if it was not.
    """
    if ledger is None:
        return apply(tensors)
    flat = tf.nest.flatten(tensors, expand_composites=True)
    present = [i for i, t in enumerate(flat) if t is not None]
    with tf.device(ledger.device):
        moved = tf.identity_n([flat[i] for i in present]) if present else []
        for i, t in zip(present, moved):
            flat[i] = t
        tensors = tf.nest.pack_sequence_as(tensors, flat, expand_composites=True)
        slot = step_id % LEDGER_SIZE
        with tf.control_dependencies(moved):
            todo = tf.not_equal(tf.gather(ledger.ids, slot), step_id)

        def run():
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            apply(tensors)
            with tf.control_dependencies(graph.get_operations()[first:]):
                ledger.ids.scatter_update(tf.IndexedSlices(
                    tf.reshape(step_id, [1]), tf.reshape(slot, [1])))
                return tf.constant(True)

        return tf.cond(todo, run, lambda: tf.constant(False))


@contextlib.contextmanager
def _record_instead_of_apply(optimizer, records):
    """While tracing: ``optimizer.apply`` appends ``(grads, variables)`` to ``records``
    (one list per replica thread) and applies nothing."""

    def record(grads, trainable_variables=None):
        variables = optimizer.trainable_variables if trainable_variables is None else \
            list(trainable_variables)
        records.setdefault(threading.get_ident(), []).append((list(grads), variables))
        return optimizer.iterations

    optimizer.__dict__["apply"] = record
    try:
        yield
    finally:
        optimizer.__dict__.pop("apply", None)


def _train_step_applied_once(model, strategy, ledger, data, step_id):
    """``model.train_step`` on ``data``, whose optimizer update is applied once per
    ``step_id`` (see `_once`). Returns the step's logs.

    The update runs after the rest of ``train_step`` (Keras' own applies, then only
    updates metrics): the optimizer's merge_call cannot run inside the replica
    function's ``tf.cond``, so the gradients come out of ``strategy.run`` and are
    applied by a second ``strategy.run`` inside the condition.
    """
    optimizer = model.optimizer
    records = {}
    layout = []  # per apply call: (its variables, which gradients are not None)

    def replica_step(data):
        with _record_instead_of_apply(optimizer, records), _hooks.shard_aware_gradients():
            logs = model.train_step(data)
        mine = records.get(threading.get_ident(), [])
        if not layout:
            layout.extend((variables, [g is not None for g in grads])
                          for grads, variables in mine)
        return logs, [g for grads, _ in mine for g in grads if g is not None]

    logs, grads = strategy.run(replica_step, args=(data,))
    if layout:
        def apply(grads):
            def replica_apply(grads):
                grads = iter(grads)
                # A replica runs on its worker's device: keep every op of the update on
                # the ps, or a worker dying mid-update could leave it half applied.
                with tf.device(ledger.device):
                    for variables, present in layout:
                        optimizer.apply([next(grads) if p else None for p in present],
                                        variables)

            strategy.run(replica_apply, args=(grads,))

        _once(ledger, step_id, grads, apply)
    return logs


def _accumulate(accumulators, scale, grads, variables):
    """Sync mode: adds ``scale * gradient`` to each variable's accumulator on the ps."""
    for grad, var in zip(grads, variables):
        if grad is None:
            continue
        try:
            accumulator = accumulators[id(var)]
        except KeyError:
            raise ValueError(
                "sync ParameterServerStrategy can only apply gradients to the model's "
                f"trainable variables. Received a gradient for {var.path!r}") from None
        if isinstance(grad, tf.IndexedSlices):
            accumulator.scatter_add(tf.IndexedSlices(
                grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                grad.dense_shape))
        else:
            accumulator.assign_add(grad * tf.cast(scale, grad.dtype))


def _apply_loss_scaled(optimizer, inner, grads, variables):
    """Sync mode, finite summed gradients: Keras' `LossScaleOptimizer` step by hand.

    ``grads`` are the sum of the workers' scaled gradients; they are unscaled and
    applied by ``inner`` (the optimizer under the wrapper), then the scale grows as
    Keras grows it: doubled after ``dynamic_growth_steps`` finite steps in a row.
    """
    scale = optimizer.dynamic_scale
    inner.apply([g / tf.cast(scale, g.dtype) for g in grads], variables)

    def grow():
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(scale * 2.0)

    def count():
        optimizer.step_counter.assign_add(1)

    tf.cond(tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1), grow, count)


def _skip_loss_scaled(optimizer):
    """Sync mode, non-finite summed gradients: no update, the loss scale halved."""
    optimizer.step_counter.assign(0)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)


class _Driver:
    """The remote functions of one compiled model, built once and reused."""

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.coordinator = strategy.coordinator
        self.optimizer = model.optimizer
        self.compile_loss = getattr(model, "_compile_loss", None)
        self.built_for = None
        self.accumulators = None
        self.ledger = None

    def ensure_built(self, element_spec):
        model, strategy = self.model, self.strategy
        with strategy.scope():
            _hooks.build_keras_state(model, element_spec)
            if self.ledger is None and strategy.exactly_once:
                self.ledger = _Ledger(strategy, model.optimizer.iterations.value)
            if strategy.mode == "sync" and self.accumulators is None:
                self.accumulators = {}
                for var in model.trainable_variables:
                    value = var.value
                    sharded = _hooks.sharded_parts(var) is not None
                    colocate = contextlib.nullcontext() if sharded else \
                        strategy.extended.colocate_vars_with(value)
                    with colocate:
                        self.accumulators[id(var)] = tf.Variable(
                            tf.zeros(var.shape, var.dtype), trainable=False,
                            name=f"tfdist_grad_sum/{var.path.replace('/', '_')}")
        self.gradient_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                                  for v in model.trainable_variables)

    # -- remote functions (traced lazily by the coordinator) --

    def train_function(self):
        model, strategy = self.model, self.strategy
        if getattr(self, "_train_fn", None) is None:
            ledger = self.ledger
            if strategy.mode == "async" and ledger is None:
                def step(iterator, step_id):
                    data = next(iterator)
                    with _hooks.shard_aware_gradients():
                        outputs = strategy.run(model.train_step, args=(data,))
                    return _local(strategy, outputs, "mean")
            elif strategy.mode == "async":
                def step(iterator, step_id):
                    data = next(iterator)
                    outputs = _train_step_applied_once(model, strategy, ledger, data, step_id)
                    return _local(strategy, outputs, "mean")
            else:
                scale = 1.0 / strategy.num_workers
                accumulators = self.accumulators

                def step(iterator, step_id):
                    data = next(iterator)

                    def replica_step(data):
                        records = {}
                        with _record_instead_of_apply(model.optimizer, records), \
                                _hooks.shard_aware_gradients():
                            logs = model.train_step(data)
                        mine = records.get(threading.get_ident(), [])
                        pairs = [pair for grads, variables in mine
                                 for pair in zip(grads, variables)]
                        variables = [v for _, v in pairs]
                        # No merge_call in here: the sum can be added inside this replica.
                        _once(ledger, step_id, [g for g, _ in pairs],
                              lambda grads: _accumulate(accumulators, scale, grads, variables))
                        return logs

                    return _local(strategy, strategy.run(replica_step, args=(data,)), "mean")
            self._train_fn = tf.function(step)
        return self._train_fn

    def apply_function(self):
        """Sync mode: apply the summed gradients once, then zero them.

        Under a `keras.optimizers.LossScaleOptimizer` the sum is of scaled gradients:
        it is checked for finiteness once, then unscaled and applied by the inner
        optimizer (see `_apply_loss_scaled`), or skipped with the scale halved. The
        scale lives on the ps, so every worker scales its next loss by the same value.
        """
        if getattr(self, "_apply_fn", None) is None:
            model, accumulators, ledger = self.model, self.accumulators, self.ledger
            optimizer = model.optimizer
            inner = inner_optimizer(optimizer)
            on_ps = (lambda: contextlib.nullcontext()) if ledger is None else \
                (lambda: tf.device(ledger.device))

            def apply_sum(step_id):
                _once(ledger, step_id, [step_id], lambda _: apply_or_skip())

            def apply_or_skip():
                run = model.distribute_strategy.run
                if inner is optimizer:
                    run(apply_and_zero, args=(optimizer.apply,))
                    return
                with on_ps():
                    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                            for g in summed_gradients()])
                tf.cond(finite,
                        lambda: run(apply_and_zero, args=(apply_loss_scaled,)),
                        skip_and_zero)

            def apply_loss_scaled(grads, variables):
                _apply_loss_scaled(optimizer, inner, grads, variables)

            def apply_and_zero(apply):
                # The replica's own device is its worker's: keep the update on the ps.
                with on_ps():
                    apply(summed_gradients(), model.trainable_variables)
                    zero()

            def skip_and_zero():
                with on_ps():
                    _skip_loss_scaled(optimizer)
                    zero()

            def summed_gradients():
                grads = []
                for v in model.trainable_variables:
                    accumulator = accumulators[id(v)]
                    # Read where the sum lives: Keras' (identity) all-reduce needs a device.
                    parts = _hooks.sharded_parts(accumulator)
                    with tf.device((parts[0] if parts else accumulator).device):
                        grads.append(tf.identity(tf.convert_to_tensor(accumulator)))
                return grads

            def zero():
                for v in model.trainable_variables:
                    accumulator = accumulators[id(v)]
                    accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))

            self._apply_fn = tf.function(apply_sum)
        return self._apply_fn

    def test_function(self):
        if getattr(self, "_test_fn", None) is None:
            model, strategy = self.model, self.strategy

            def step(data):
                return _local(strategy, strategy.run(model.test_step, args=(data,)), "mean")

            self._test_fn = tf.function(step)
        return self._test_fn

    def predict_function(self):
        if getattr(self, "_predict_fn", None) is None:
            model, strategy = self.model, self.strategy

            def step(data):
                return _local(strategy, strategy.run(model.predict_step, args=(data,)),
                              "concat")

            self._predict_fn = tf.function(step)
        return self._predict_fn

    # -- dispatch --

    def start_train_steps(self, iterator, count):
        """Schedules ``count`` steps; returns the `RemoteValue` of the last one.

        Async steps are only queued. A sync step waits for its K gradients and its apply,
        so sync steps are done when this returns.
        """
        strategy = self.strategy
        train_fn = self.train_function()
        if strategy.mode == "async":
            last = None
            for _ in range(count):
                last = self.coordinator.schedule(train_fn, args=(iterator, _new_step_id()))
            pushed = count
        else:
            apply_fn = self.apply_function()
            for _ in range(count):
                values = [_hooks.schedule_on_worker(self.coordinator, i, train_fn,
                                                    (iterator, _new_step_id()))
                          for i in range(strategy.num_workers)]
                _join(strategy)
                # Keras' optimizer needs a replica context: apply on a worker, then wait.
                self.coordinator.schedule(apply_fn, args=(_new_step_id(),))
                _join(strategy)
            last = values[-1]
            pushed = count * strategy.num_workers
        strategy._bytes.add(pushed * self.gradient_bytes)
        return last

    def finish_train_steps(self, last):
        """The logs of a step started by `start_train_steps`, as Python numbers (the
        previous ones if its worker died after the step, before they were read)."""
        logs = _fetch(self.strategy, last)
        if logs is not None:
            self.last_logs = _to_python(logs)
        return getattr(self, "last_logs", {})


def _new_step_id():
    """A step id no other closure of this process has (the ledger tells reruns by it)."""
    return tf.constant(next(_step_ids), tf.int64)


def _join(strategy):
    """``coordinator.join()``, or the strategy's `StepTimeoutError` (see ``step_timeout``)."""
    while not _hooks.wait_for_closures(strategy.coordinator, 1.0):
        strategy.raise_if_steps_timed_out()


def _is_worker_lost(error) -> bool:
    """A worker died after its step finished, before the chief read the result."""
    text = str(error)
    return isinstance(error, tf.errors.UnavailableError) and "/job:worker/" in text and \
        "/job:ps/" not in text


def _fetch(strategy, remote_value, retry=None):
    """Fetches a step's result; when it was cancelled, raises the error that caused it
    (or the strategy's `StepTimeoutError`).

    TF copies a result to the chief lazily, so a worker that dies after finishing a step
    takes the result with it (the step itself is done). Then ``retry()`` schedules the
    step again and its result is fetched; without ``retry`` this returns None.
    """
    while not _hooks.wait_for_remote_value(remote_value, 1.0):
        strategy.raise_if_steps_timed_out()
    try:
        return remote_value.fetch()
    except tf.errors.CancelledError:
        _join(strategy)  # raises the first error of the scheduled steps, if any
        raise
    except tf.errors.UnavailableError as error:
        if not _is_worker_lost(error):
            raise
        return None if retry is None else _fetch(strategy, retry(), retry)


def _driver(model) -> _Driver:
    strategy = model.distribute_strategy
    driver = _drivers.get(model)
    if driver is None or driver.optimizer is not model.optimizer or \
            driver.compile_loss is not getattr(model, "_compile_loss", None):
        driver = _Driver(model, strategy)
        _drivers[model] = driver
    return driver


_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


@contextlib.contextmanager
def _clear_ps_errors(strategy):
    """Turns the coordinator's "ps unavailable" errors into one clear error."""
    try:
        yield
    except tf.errors.UnavailableError as error:
        tasks = sorted({f"ps-{t}" for t in _PS_TASK.findall(str(error))})
        if not tasks and _is_worker_lost(error):
            raise  # a worker's, which TF did not handle: not a ps failure
        which = ", ".join(tasks) if tasks else "a parameter server (or the connection to it)"
        raise ParameterServerUnavailableError(
            f"{which} became unavailable during training; the variables it held are lost. "
            "Restart the job (e.g. `tfdist launch --max-restarts 1 ...`) and resume from the "
            "chief's checkpoint (keras.callbacks.BackupAndRestore or tf.train.Checkpoint). "
            f"Cause: {type(error).__name__}: {str(error).splitlines()[0][:300]}") from error


def _callback_list(model, callbacks, verbose, epochs, steps, history):
    import keras

    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks, add_history=history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model)


def _dispatch_size(model, strategy, default):
    if strategy.steps_per_dispatch is not None:
        return strategy.steps_per_dispatch
    spe = getattr(model, "steps_per_execution", 1) or 1
    return spe if spe > 1 else default


# ---- fit / evaluate / predict -----------------------------------------------------------

def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`keras.Model.fit` on a parameter-server cluster (same arguments)."""
    strategy = model.distribute_strategy
    if not model.compiled:
        raise ValueError("You must call `compile()` before calling `fit()`.")
    if validation_split:
        raise ValueError("validation_split is not supported with ParameterServerStrategy; "
                         f"pass validation_data. Received: validation_split={validation_split}")
    if class_weight is not None:
        raise ValueError("class_weight is not supported with ParameterServerStrategy; use "
                         "sample weights in the dataset. Received: class_weight="
                         f"{class_weight!r}")
    data = TrainInput(strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
    driver = _driver(model)
    driver.ensure_built(data.element_spec)
    steps = data.steps_per_epoch
    default_dispatch = 4 * strategy.num_workers if strategy.mode == "async" else 1
    dispatch = _dispatch_size(model, strategy, default_dispatch)
    callbacks = _callback_list(model, callbacks, verbose, epochs, steps, history=True)

    with _clear_ps_errors(strategy):
        iterator = _hooks.create_per_worker_iterators(driver.coordinator, data.dataset_fns)
        model.stop_training = False
        callbacks.on_train_begin()
        initial_epoch = _hooks.keras_initial_epoch(model, initial_epoch)
        logs, training_logs = {}, None
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            # The next dispatch is queued before the last one's logs are fetched, so the
            # workers never wait for the chief.
            step, pending = 0, None
            while step < steps:
                count = min(dispatch, steps - step)
                if pending is None:
                    callbacks.on_train_batch_begin(step)
                handle = driver.start_train_steps(iterator, count)
                if pending is not None:
                    logs = driver.finish_train_steps(pending[1])
                    callbacks.on_train_batch_end(pending[0], logs)
                    if model.stop_training:
                        pending = None
                        break
                    callbacks.on_train_batch_begin(step)
                pending = (step + count - 1, handle)
                step += count
            if pending is not None:
                logs = driver.finish_train_steps(pending[1])
                callbacks.on_train_batch_end(pending[0], logs)
            _join(strategy)
            epoch_logs = _to_python(_hooks.keras_metrics_or_logs(model, logs))
            if validation_data is not None and _should_eval(epoch, validation_freq):
                val_x, val_y, val_sw = _unpack(validation_data)
                val_logs = evaluate(model, val_x, val_y, sample_weight=val_sw,
                                    batch_size=validation_batch_size or batch_size,
                                    steps=validation_steps, callbacks=callbacks,
                                    return_dict=True)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            if model.stop_training:
                break
        if epochs > 0 and model.optimizer is not None:
            model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=training_logs)
    return model.history


def _unpack(validation_data):
    if _is_dataset(validation_data) or _is_dataset_fn(validation_data):
        return validation_data, None, None
    if isinstance(validation_data, (list, tuple)) and len(validation_data) in (2, 3):
        parts = tuple(validation_data) + (None,) * (3 - len(validation_data))
        return parts
    raise ValueError("validation_data must be a dataset, a dataset function, or a tuple "
                     f"(x, y) or (x, y, sample_weight). Received: {type(validation_data)}")


def _should_eval(epoch, validation_freq):
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return (epoch + 1) in validation_freq


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """`keras.Model.evaluate` on a parameter-server cluster: each batch runs once, on a
    free worker."""
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    strategy = model.distribute_strategy
    if not model.compiled:
        raise ValueError("You must call `compile()` before calling `evaluate()`.")
    dataset = _chief_dataset(strategy, x, y, sample_weight, batch_size, steps)
    driver = _driver(model)
    driver.ensure_built(dataset.element_spec)
    num_batches = _cardinality(dataset)
    callbacks = _callback_list(model, callbacks, verbose, 1,
                               num_batches if num_batches > 0 else None, history=False)
    test_fn = driver.test_function()
    window = 4 * strategy.num_workers
    logs = {}
    with _clear_ps_errors(strategy):
        model.reset_metrics()
        callbacks.on_test_begin()
        pending = []
        for step, batch in enumerate(dataset):
            if not pending:
                callbacks.on_test_batch_begin(step)
            pending.append(driver.coordinator.schedule(test_fn, args=(batch,)))
            if len(pending) == window:
                logs = _to_python(_fetch(strategy, pending[-1])) or logs
                callbacks.on_test_batch_end(step, logs)
                pending = []
        if pending:
            logs = _to_python(_fetch(strategy, pending[-1])) or logs
            callbacks.on_test_batch_end(step, logs)
        _join(strategy)
        logs = _to_python(_hooks.keras_metrics_or_logs(model, logs))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return _hooks.keras_flatten_metrics(model, logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`keras.Model.predict` on a parameter-server cluster; outputs keep the input order."""
    strategy = model.distribute_strategy
    dataset = _chief_dataset(strategy, x, None, None, batch_size, steps)
    driver = _driver(model)
    if not model.built:
        with strategy.scope():
            _hooks.build_keras_state(model, dataset.element_spec)
    num_batches = _cardinality(dataset)
    callbacks = _callback_list(model, callbacks, verbose, 1,
                               num_batches if num_batches > 0 else None, history=False)
    predict_fn = driver.predict_function()
    outputs = []
    with _clear_ps_errors(strategy):
        callbacks.on_predict_begin()
        remote = []
        for step, batch in enumerate(dataset):
            callbacks.on_predict_batch_begin(step)
            remote.append((step, batch, driver.coordinator.schedule(predict_fn, args=(batch,))))
        for step, batch, value in remote:
            def retry(batch=batch):
                return driver.coordinator.schedule(predict_fn, args=(batch,))

            batch_outputs = tf.nest.map_structure(np.asarray, _fetch(strategy, value, retry))
            callbacks.on_predict_batch_end(step, {"outputs": batch_outputs})
            outputs.append(batch_outputs)
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("predict got no data: the input is empty.")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)
