"""What every synchronous tfdist strategy does with gradients: one all-reduce through
its communicator, and local gradient accumulation (`CommunicationOptions`).

Each strategy holds ``self.communicator``, an `tfdist.comm.communicator.Accounted`
communicator: compression on the wire and byte counting happen there, once per
reduction, whatever the engine. Every step, Keras' gradient all-reduce hands the
gradients to `SyncGradientsMixin.keras_reduce_gradients`, which sends them through
one ``merge_call`` to ``communicator.all_reduce(..., op="sum")`` (None gradients are
left out, IndexedSlices travel as they are).

Accumulation does not use Keras' ``gradient_accumulation_steps``: Keras puts the
all-reduce inside a ``cond`` in replica context, which MirroredStrategy rejects
("merge_call called while defining a new graph"). Here each replica adds its gradient
to a local (ON_READ) accumulator, then one unconditional ``merge_call`` decides in
cross-replica context whether this is the k-th micro-batch; only then are the sums
all-reduced through the communicator (once per k) and applied.

With ``shard_optimizer_state=True`` the optimizer step is replaced too: gradients are
reduce-scattered and each replica updates its slice: the model's optimizer is wrapped in
a `tfdist.strategies.zero.optimizer.ShardedOptimizer` (which owns the slices and saves
them whole) at ``fit`` or a load.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from tfdist._hooks import keras_optimizer
from tfdist._hooks.fsdp import shard_of
from tfdist.checks import check_bool
from tfdist.comm.accounting import ByteCounter
from tfdist.comm.communicator import Accounted, StrategyCommunicator, per_replica
from tfdist.comm.options import CommunicationOptions
from tfdist.keras import handoff
from tfdist.keras.optimizer import inner_optimizer, sharded_wrapper
from tfdist.strategies import state
from tfdist.strategies._fit import KerasFitMixin


def _local_accumulators(variables) -> list:
    """One replica-local (ON_READ) zero accumulator per variable; call in the scope."""
    with tf.init_scope():
        return [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                            synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM,
                            name="tfdist_grad_accumulator")
                for v in variables]


def check_save_freq(callbacks, accumulate_steps: int) -> None:
    """Refuses, before fit runs, a callback that saves every ``save_freq`` batches
    inside an accumulation (the partial sums are no save's: `AccumulationState`)."""
    for callback in callbacks or ():
        save_freq = getattr(callback, "save_freq", "epoch")
        if isinstance(save_freq, int) and save_freq % accumulate_steps:
            raise ValueError(
                f"{type(callback).__name__} would save inside an accumulation of "
                f"accumulate_steps={accumulate_steps}, whose gradient sums no save holds: "
                f"use a save_freq that divides by {accumulate_steps}, or 'epoch'. "
                f"Received: save_freq={save_freq}")


class SyncGradientsMixin(KerasFitMixin):
    """Mixed into a strategy class; call `_init_sync_gradients` in its ``__init__``.

    The strategy then all-reduces gradients through ``self.communicator`` (which casts
    floating gradients to the compression dtype and counts the bytes each worker
    contributes: `bytes_communicated`), and sums ``accumulate_steps`` micro-batches
    locally before each all-reduce.
    """

    #: Set by `_init_sync_gradients`; False for strategies that do not call it.
    shard_optimizer_state = False
    #: `tfdist.strategies.fsdp.shards.ParameterSharding` with ``shard_parameters=True``, else None.
    parameter_sharding = None

    @property
    def save_needs_every_worker(self) -> bool:
        """Whether a save runs collectives, so that every worker must call it, as in
        stock TF's multi-worker saving: sharded optimizer state is gathered."""
        return self.shard_optimizer_state or self.parameter_sharding is not None

    def _init_sync_gradients(self, options: CommunicationOptions,
                             communicator: Accounted | None = None,
                             cross_device_ops=None, shard_optimizer_state: bool = False,
                             sharding: dict | None = None) -> None:
        """Sets ``communication`` and ``communicator``; call outside any scope.

        Args:
            options: The strategy's `CommunicationOptions`.
            communicator: The accounted communicator (an engine's), or None for one
                over ``cross_device_ops``.
            cross_device_ops: None (the strategy's own ``batch_reduce_to``), or the
                cross-device ops to reduce with when ``batch_reduce_to`` itself goes
                through ``communicator`` (`tfdist.HorovodStrategy`).
            shard_optimizer_state: Each replica keeps 1/N of the optimizer state
                (`tfdist.strategies.zero.sharded_state`).
            sharding: None, or the `tfdist.strategies.fsdp.shards.ParameterSharding`
                arguments (``shard_parameters=True``).
        """
        self.shard_optimizer_state = check_bool("shard_optimizer_state", shard_optimizer_state)
        self.shard_optimizer_state = shard_optimizer_state
        self.communication = options
        self.communicator = communicator or Accounted(
            StrategyCommunicator(cross_device_ops), options.compression_policy,
            ByteCounter())
        self._accumulators = {}
        # Micro-batches seen, a plain host counter (whatever scope this runs in).
        self._micro_steps = ByteCounter("tfdist_micro_steps")
        handoff.install_keras_hooks()
        if sharding is not None:
            from tfdist._hooks.fsdp import install_parameter_hooks
            from tfdist.strategies.fsdp.shards import ParameterSharding

            self.parameter_sharding = ParameterSharding(self, **sharding)
            install_parameter_hooks()

    @property
    def bytes_communicated(self) -> int:
        """Gradient bytes this worker has all-reduced (after compression)."""
        return self.communicator.bytes

    # ---- every step: replaces Keras' own all-reduce --------------------------------------

    keras_clip_after_reduce = True  # clipping as on one device (see docs/zero.md)

    def keras_reduce_gradients(self, grads_and_vars, reduce):
        if not any(grad is not None for grad, _ in grads_and_vars):
            return reduce(grads_and_vars)  # Keras' own error: no gradients at all
        # A sharded parameter's gradient was reduce-scattered by its gather's gradient.
        whole = [grad is not None and shard_of(var) is None for grad, var in grads_and_vars]
        present = [grad for (grad, _), keep in zip(grads_and_vars, whole) if keep]
        reduced = iter(tf.distribute.get_replica_context().merge_call(
            self._all_reduce_sum, args=(present,)) if present else [])
        out = [(next(reduced) if keep else grad, var)
               for (grad, var), keep in zip(grads_and_vars, whole)]
        optimizer = getattr(reduce, "args", (None,))[0]  # Keras' reduce, bound to it
        if (self.parameter_sharding is not None and optimizer is not None
                and (optimizer.clipnorm or optimizer.global_clipnorm)):
            from tfdist.strategies.fsdp.shards import clip_sharded

            clipped = clip_sharded(self, self.communicator, optimizer,
                                   [g for g, _ in out], [shard_of(v) is not None
                                                         for _, v in out])
            out = [(g, v) for g, (_, v) in zip(clipped, out)]
        return out

    def _all_reduce_sum(self, distribution, grads):
        """Cross-replica: each gradient summed over every replica, by the communicator."""
        return self.communicator.all_reduce(distribution, list(grads), [None] * len(grads),
                                            op="sum")

    # ---- accumulate_steps > 1: replaces Keras' optimizer step (see module docstring) ----

    def keras_local_update(self):
        if self.communication.accumulate_steps > 1:
            return self._accumulate_apply
        if self.shard_optimizer_state:
            return self._sharded_apply
        return None

    def keras_check_call(self, model, method, arguments):
        super().keras_check_call(model, method, arguments)
        if method == "fit":
            check_save_freq(arguments.get("callbacks"), self.communication.accumulate_steps)
            self._prepare_sharding(model)
        sharding = self.parameter_sharding
        if sharding is not None and sharding.reshard_after_forward:
            from tfdist._hooks.fsdp import regather_in_backward

            regather_in_backward(model)

    def _prepare_sharding(self, model):
        """Before fit or a load: the model's optimizer wrapped in a `ShardedOptimizer`
        (a `LossScaleOptimizer`'s inner one, as Keras nests them)."""
        from tfdist.strategies.zero.optimizer import (ShardedLossScaleOptimizer,
                                                         ShardedOptimizer)

        optimizer = getattr(model, "optimizer", None)
        if not self.shard_optimizer_state or optimizer is None:
            return
        outer = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
        target = outer.inner_optimizer if outer is not None else optimizer
        if isinstance(target, ShardedOptimizer):
            return
        with self.scope():  # its counters mirrored, as the optimizer's own
            wrapped = ShardedOptimizer(target)
            if outer is not None:  # the loss scale outside, as compile nests them
                wrapped = ShardedLossScaleOptimizer(
                    wrapped, initial_scale=outer.initial_scale,
                    dynamic_growth_steps=outer.dynamic_growth_steps, name=outer.name)
        model.optimizer = wrapped

    def keras_model_event(self, model, method, when):
        super().keras_model_event(model, method, when)
        if method in ("save", "save_weights") and when == "before":
            state.check_save(self.state_components(model))
        if method == "load_weights" and when == "before" and self.shard_optimizer_state:
            self._prepare_sharding(model)
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None and not optimizer.built and model.trainable_variables:
                optimizer.build(model.trainable_variables)  # no slots: loads the counters

    def state_components(self, model) -> list:
        """What this strategy's training state is made of (`tfdist.strategies.state`):
        elastic commits, rollbacks and joiner broadcasts collect it from these."""
        from tfdist.strategies import _components as components

        found = [components.KerasState(model), components.MetricsState(self, model)]
        if self.communication.accumulate_steps > 1:
            found.append(components.AccumulationState(
                self, self.communication.accumulate_steps, self._micro_steps.variable,
                self._accumulators, functools.partial(self._ensure_accumulators,
                                                      inner_optimizer(model.optimizer),
                                                      model.trainable_variables, None)))
        if self.shard_optimizer_state:
            found.append(components.ShardedSlotsState(model, self, self._gather_whole))
        return found

    def _gather_whole(self, parts):
        """One tensor per local replica, all-gathered whole (a commit's read)."""
        return self.communicator.all_gather(self, per_replica(parts, always_wrap=True))

    def sharded_optimizer_state(self, optimizer):
        """The `tfdist.strategies.zero.sharded_state.ShardedOptimizerState` of ``optimizer`` (the
        model's, wrapped or not), or None before its first sharded step."""
        wrapper = sharded_wrapper(optimizer)
        return None if wrapper is None else wrapper.state

    def _sharded_apply(self, optimizer, apply_fn, grads, variables):
        del apply_fn
        tf.distribute.get_replica_context().merge_call(
            functools.partial(self._merge_sharded, optimizer, list(variables)),
            args=(list(grads),))

    def _merge_sharded(self, optimizer, variables, distribution, grads):
        _wrapper_of(optimizer).sharded_update(distribution, self.communicator, grads,
                                              variables)

    def _accumulate_apply(self, optimizer, apply_fn, grads, variables):
        del apply_fn
        if (optimizer.weight_decay and not self.shard_optimizer_state) or (
                optimizer.use_ema or optimizer.gradient_accumulation_steps):
            raise ValueError("accumulate_steps does not combine with the optimizer's "
                             "weight_decay, use_ema or gradient_accumulation_steps. Received: "
                             f"weight_decay={optimizer.weight_decay}, "
                             f"use_ema={optimizer.use_ema}")
        if not self.shard_optimizer_state:  # the sharded step keeps Keras' variables
            variables = [getattr(v, "value", v) for v in variables]
        owner = inner_optimizer(optimizer)  # the key state_components uses too
        context = tf.distribute.get_replica_context()
        context.merge_call(functools.partial(self._ensure_accumulators, owner, variables))
        sums = self._accumulators[id(owner)]
        totals = [acc.read_value() + tf.convert_to_tensor(g) for acc, g in zip(sums, grads)]
        is_update = context.merge_call(
            functools.partial(self._merge_accumulated, optimizer, variables), args=(totals,))
        for acc, total in zip(sums, totals):
            acc.assign(total * (1 - tf.cast(is_update, total.dtype)))

    def _ensure_accumulators(self, optimizer, variables, distribution):
        if id(optimizer) not in self._accumulators:
            with self.scope():
                self._accumulators[id(optimizer)] = _local_accumulators(variables)

    def _merge_accumulated(self, optimizer, variables, distribution, totals):
        """Cross-replica: on every k-th micro-batch, all-reduce the sums and apply them."""
        steps = self.communication.accumulate_steps
        is_update = tf.equal(tf.math.floormod(self._micro_steps.add(1), steps), 0)

        def update():
            if self.shard_optimizer_state:
                _wrapper_of(optimizer).sharded_update(
                    distribution, self.communicator, list(totals), variables,
                    scale=1 / steps)
                return tf.constant(True)
            if any(shard_of(v) is not None for v in variables):
                grads = self._accumulated_with_slices(distribution, optimizer, totals,
                                                      variables)
                keras_optimizer.keras_distributed_update(optimizer, distribution, grads,
                                                         variables)
                return tf.constant(True)
            reduced = self.communicator.all_reduce(distribution, list(totals), variables,
                                                   op="sum")
            grads = [tf.cast(distribution.experimental_local_results(r)[0], v.dtype) / steps
                     for r, v in zip(reduced, variables)]
            grads = keras_optimizer.clip_gradients(optimizer, grads)
            keras_optimizer.keras_distributed_update(optimizer, distribution, grads, variables)
            return tf.constant(True)

        def skip():
            # Keras' apply() adds 1 to iterations after this: net zero until an update.
            keras_optimizer.undo_step_count(optimizer)
            return tf.constant(False)

        return tf.cond(is_update, update, skip)

    def _accumulated_with_slices(self, distribution, optimizer, totals, variables):
        """Cross-replica, ``shard_parameters`` with ``accumulate_steps``: the summed
        micro-batch gradients divided by k (and clipped by value); whole variables'
        all-reduced once, sharded variables' slices (reduce-scattered at every
        micro-batch) kept per replica."""
        if optimizer.clipnorm or optimizer.global_clipnorm:
            raise ValueError(
                "shard_parameters=True with accumulate_steps does not clip by norm yet. "
                f"Received: clipnorm={optimizer.clipnorm}, "
                f"global_clipnorm={optimizer.global_clipnorm}")
        steps = self.communication.accumulate_steps
        whole = [i for i, v in enumerate(variables) if shard_of(v) is None]
        reduced = dict(zip(whole, self.communicator.all_reduce(
            distribution, [totals[i] for i in whole], [variables[i] for i in whole],
            op="sum") if whole else []))

        def finish(value, dtype):
            value = tf.cast(value, dtype) / steps
            limit = optimizer.clipvalue
            return tf.clip_by_value(value, -limit, limit) if limit else value

        grads = []
        for i, (total, variable) in enumerate(zip(totals, variables)):
            if i in reduced:
                grads.append(finish(distribution.experimental_local_results(reduced[i])[0],
                                    variable.dtype))
            else:
                grads.append(per_replica([finish(t, variable.dtype) for t in
                                          distribution.experimental_local_results(total)],
                                         always_wrap=True))
        return grads


def _wrapper_of(optimizer):
    """The `ShardedOptimizer` a sharded step runs for (refuses a bare optimizer)."""
    wrapper = sharded_wrapper(optimizer)
    if wrapper is None:
        raise ValueError("shard_optimizer_state=True steps a tfdist.keras.ShardedOptimizer "
                         "(fit wraps the model's optimizer). Received: "
                         f"optimizer={type(optimizer).__name__}")
    return wrapper
