"""The step driver of `tfdist.keras.ps_fit`: remote functions and their dispatch.

* training steps are `ClusterCoordinator` closures that call the model's own
  ``train_step`` on a worker, reading that worker's shard of the input;
* ``mode="async"``: each closure applies its own update (Keras' optimizer, on the ps);
* ``mode="sync"``: a step is one closure on each of the K workers, each adding its
  gradient (times 1/K) to accumulators on the ps, then one apply of the sum: the same
  update as one step on the K-times-larger batch (a `LossScaleOptimizer` checks, unscales
  and applies the sum once);
* every step has an id, and its update (or gradient sum) runs on a ps under a ledger
  of applied ids, so a step that TF's coordinator runs again after its worker died is
  applied once (see `_once`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import numpy as np
import tensorflow as tf

from tfdist._hooks.coordinator import (schedule_on_worker, wait_for_closures,
                                       wait_for_remote_value)
from tfdist._hooks.keras_optimizer import apply_replaced
from tfdist._hooks.keras_trainer import build_keras_state, compiled_loss
from tfdist._hooks.sharded.parts import sharded_parts, sharded_variable
from tfdist._hooks.tf import function_not_inlined
from tfdist.keras.optimizer import inner_optimizer

# Step ids the exactly-once ledger remembers (a ring): far more than steps in flight.
LEDGER_SIZE = 1 << 16
_drivers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_step_ids = itertools.count(1)  # 0 marks an empty ledger slot


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
        # With one ps every update is on the ledger's ps (see `_once`).
        self.alone = len(strategy.cluster.ps) == 1


def _once(ledger, step_id, tensors, apply):
    """Runs ``apply(tensors)`` on the ps unless step ``step_id`` was applied before
    (just ``apply(tensors)`` if ``ledger`` is None: ``exactly_once=False``).

    While tracing a step. All of ``tensors`` (the gradients) are first moved to the
    ledger's ps together (one ``IdentityN``). Then one function call checks the ledger,
    runs ``apply`` and writes the ledger, in that order. A worker that dies before every
    gradient has arrived applies nothing.

    The call is not inlined: inlined, the update's ops are scheduled one by one by the
    step's own executor on the ps, which stops scheduling when another of its ops fails,
    such as one waiting for the dead worker (seen: ``iterations`` and the kernel updated,
    the bias not, then all three again by the rerun). A call runs its whole body once it
    has started. With one ps the call runs there, out of the worker's reach. With
    several, a ps cannot see the others' devices, so the worker makes the call: each
    ps's part of the update is then whole, but a worker that dies in the middle may
    leave it done on some ps and not yet on others (docs/parameter_server.md).
    """
    if ledger is None:
        return apply(tensors)
    flat = tf.nest.flatten(tensors, expand_composites=True)
    present = [i for i, t in enumerate(flat) if t is not None]

    @function_not_inlined  # see above
    def check_apply_record(step_id, *moved):
        with tf.device(ledger.device):  # arguments have no device: Keras' reduce needs one
            for i, t in zip(present, tf.identity_n(list(moved)) if moved else []):
                flat[i] = t
            slot = step_id % LEDGER_SIZE
            todo = tf.not_equal(tf.gather(ledger.ids, slot), step_id)

            def run():
                graph = tf.compat.v1.get_default_graph()
                first = len(graph.get_operations())
                apply(tf.nest.pack_sequence_as(tensors, flat, expand_composites=True))
                with tf.control_dependencies(graph.get_operations()[first:]):
                    ledger.ids.scatter_update(tf.IndexedSlices(
                        tf.reshape(step_id, [1]), tf.reshape(slot, [1])))
                    return tf.constant(True)

            return tf.cond(todo, run, lambda: tf.constant(False))

    with tf.device(ledger.device):
        moved = tf.identity_n([flat[i] for i in present]) if present else []
        step_id = tf.identity(step_id)
    with tf.device(ledger.device) if ledger.alone else contextlib.nullcontext():
        return check_apply_record(step_id, *moved)


@contextlib.contextmanager
def _record_instead_of_apply(optimizer, records):
    """While tracing: ``optimizer.apply`` appends ``(grads, variables)`` to ``records``
    (one list per replica thread) and applies nothing."""

    def record(grads, trainable_variables=None):
        variables = optimizer.trainable_variables if trainable_variables is None else \
            list(trainable_variables)
        records.setdefault(threading.get_ident(), []).append((list(grads), variables))
        return optimizer.iterations

    with apply_replaced(optimizer, record):
        yield


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
        with _record_instead_of_apply(optimizer, records):
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


def _zeros_variable(like, name):
    """A non-trainable variable of zeros shaped like ``like`` (made where it lives)."""
    shape, dtype = like.shape, like.dtype
    return tf.Variable(lambda: tf.zeros(shape, dtype), trainable=False, name=name)


class _Driver:
    """The remote functions of one compiled model, built once and reused."""

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.coordinator = strategy.coordinator
        self.optimizer = model.optimizer
        self.compile_loss = compiled_loss(model)
        self.built_for = None
        self.accumulators = None
        self.ledger = None

    def ensure_built(self, element_spec):
        model, strategy = self.model, self.strategy
        with strategy.scope():
            build_keras_state(model, element_spec)
            if self.ledger is None and strategy.exactly_once:
                self.ledger = _Ledger(strategy, model.optimizer.iterations.value)
            if strategy.mode == "sync" and self.accumulators is None:
                self.accumulators = {}
                for var in model.trainable_variables:
                    name = f"tfdist_grad_sum/{var.path.replace('/', '_')}"
                    parts = sharded_parts(var)
                    if parts is None:
                        with strategy.extended.colocate_vars_with(var.value):
                            self.accumulators[id(var)] = _zeros_variable(var, name)
                        continue
                    # A sharded variable's sum is sharded alike: each shard on its ps.
                    shards = []
                    for i, part in enumerate(parts):
                        with strategy.extended.colocate_vars_with(part):
                            shards.append(_zeros_variable(part, f"{name}/part_{i}"))
                    self.accumulators[id(var)] = sharded_variable(shards)
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
                        with _record_instead_of_apply(model.optimizer, records):
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
                    parts = sharded_parts(accumulator)
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
                values = [schedule_on_worker(self.coordinator, i, train_fn,
                                             (iterator, _new_step_id()))
                          for i in range(strategy.num_workers)]
                _join(strategy)
                # Keras' optimizer needs a replica context: apply on a worker, then wait.
                self.coordinator.schedule(apply_fn, args=(_new_step_id(),))
                _join(strategy)
            last = values[-1]
            pushed = count * strategy.num_workers
        strategy.push_counter.add(pushed * self.gradient_bytes)
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
    try:
        while not wait_for_closures(strategy.coordinator, 1.0):
            strategy.raise_if_steps_timed_out()
    except tf.errors.UnavailableError as error:
        strategy.raise_if_steps_timed_out(error)
        raise


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
    while not wait_for_remote_value(remote_value, 1.0):
        strategy.raise_if_steps_timed_out()
    try:
        return remote_value.fetch()
    except tf.errors.CancelledError:
        _join(strategy)  # raises the first error of the scheduled steps, if any
        raise
    except tf.errors.UnavailableError as error:
        if not _is_worker_lost(error):
            strategy.raise_if_steps_timed_out(error)  # a frozen ps: named, not TF's words
            raise
        return None if retry is None else _fetch(strategy, retry(), retry)


def _driver(model) -> _Driver:
    strategy = model.distribute_strategy
    driver = _drivers.get(model)
    if driver is None or driver.optimizer is not model.optimizer or \
            driver.compile_loss is not compiled_loss(model):
        driver = _Driver(model, strategy)
        _drivers[model] = driver
    return driver
