"""The state components (`tfdist.strategies.state`) of synchronous training.

- `KerasState`: the model's and optimizer's variables, held equal by every member.
- `MetricsState`: each worker's own copies of the metrics' variables (their sums over
  the workers are read at an epoch's end).
- `AccumulationState` (``accumulate_steps``): the micro-step counter (shared) and each
  replica's gradient sums (own). A commit lands only where the sums are zero (at an
  accumulation boundary), so a rollback restores zeros and any replica count can take
  over: the sums of a lost member are never needed.
- `ShardedSlotsState` (``shard_optimizer_state``): each replica's slices of the
  optimizer's slots. A commit reads them gathered whole (`FullSlot`), so the slices of
  a lost member are committed too; going from N replicas to M re-cuts the committed
  whole slots for M (`ShardedSlotsState.resize`).

Compression of the synchronous strategies casts on the wire and keeps no residual:
it has no state. Model averaging's component is
`tfdist.strategies.averaging.elastic.AveragedModel`.
"""

from __future__ import annotations

import re

import tensorflow as tf

from tfdist.keras.optimizer import inner_optimizer, sharded_wrapper
from tfdist.strategies.state import StateComponent, unique


class KerasState(StateComponent):
    """The model's and optimizer's variables."""

    feature = "the model"

    def __init__(self, model):
        self.model = model

    def shared_variables(self) -> list:
        own = {id(v) for v in _sharded_variables(self.model.optimizer)}
        return unique((*self.model.variables,
                       *(v for v in self.model.optimizer.variables if id(v) not in own)))


class MetricsState(StateComponent):
    """This worker's own copies of the metrics' variables."""

    feature = "metrics"

    def __init__(self, strategy, model):
        self.strategy, self.model = strategy, model

    def own_variables(self) -> list:
        local = self.strategy.experimental_local_results
        return [c for m in self.model.metrics for v in m.variables for c in local(v.value)]


class AccumulationState(StateComponent):
    """Gradient accumulation's state (see the module's words).

    Args:
        strategy: The strategy (its local results).
        steps: ``accumulate_steps``.
        counter: The micro-step counter (a host ``tf.Variable``).
        accumulators: ``{id(optimizer): [replica-local accumulators]}``.
        make: ``make()``: makes the model's optimizer's accumulators when missing.
    """

    feature = "accumulate_steps"

    def __init__(self, strategy, steps: int, counter, accumulators: dict, make):
        self.strategy, self.steps = strategy, steps
        self.counter, self.accumulators, self._make = counter, accumulators, make

    def prepare(self) -> None:
        """The accumulators, made before the first step: every member at once (their
        initial values are broadcast), a joiner before it takes part in collectives."""
        self._make()

    def shared_variables(self) -> list:
        return [self.counter]

    def own_variables(self) -> list:
        local = self.strategy.experimental_local_results
        return [c for sums in self.accumulators.values() for a in sums for c in local(a)]

    def commit_point(self, steps_ahead: int) -> bool:
        """Only at an accumulation boundary (every replica's sums are zero there)."""
        return (int(self.counter.numpy()) + steps_ahead) % self.steps == 0

    def save_refusal(self) -> str | None:
        step = int(self.counter.numpy()) % self.steps
        if step == 0:
            return None
        return (f"the gradient sums of the {step} micro-step(s) taken of accumulate_steps="
                f"{self.steps} are each replica's own and no save holds them. Save at an "
                f"accumulation boundary (a save_freq that divides by accumulate_steps). "
                f"Received: a save after micro-step {int(self.counter.numpy())}")


class FullSlot:
    """One slot of one bucket of sharded optimizer state, read gathered whole (its
    length does not depend on the replica count) and assigned by cutting it again."""

    def __init__(self, component: "ShardedSlotsState", bucket: int, slot: int):
        self.component, self.bucket, self.slot = component, bucket, slot
        b = component.state.buckets[bucket]
        self.length = sum(b.sizes)
        self.shape = tf.TensorShape([self.length])
        self.dtype = tf.as_dtype(b.dtype)

    def read_for_commit(self):
        """Every replica's slice, all-gathered, without the padding (traced)."""
        state = self.component.state
        parts = [self.component.slots(i)[self.bucket][self.slot]
                 for i in range(len(state.devices))]
        full = self.component.gather(parts)
        return full[:self.length]

    def assign(self, value) -> None:
        """Cuts ``value`` for the current replica count into this worker's slices."""
        state = self.component.state
        b = state.buckets[self.bucket]
        padded = tf.pad(tf.convert_to_tensor(value),
                        [[0, b.slice_size * state.replicas - self.length]])
        for i, replica in enumerate(state.replica_ids):
            piece = padded[replica * b.slice_size:(replica + 1) * b.slice_size]
            self.component.slots(i)[self.bucket][self.slot].assign(piece)


class ShardedSlotsState(StateComponent):
    """Sharded optimizer state's slots (see the module's words): the slices a
    `tfdist.strategies.zero.optimizer.ShardedOptimizer` holds as its own variables.

    Args:
        model: The Keras model (its optimizer, wrapped at ``fit``).
        strategy: The strategy (the sharded state is cut for its replica count).
        gather: ``gather(parts)``: one tensor per local replica, all-gathered whole.
    """

    feature = "shard_optimizer_state"

    def __init__(self, model, strategy, gather):
        self.model, self.strategy, self.gather = model, strategy, gather
        self.state = None
        self._full: list[FullSlot] = []

    def _wrapper(self):
        wrapper = sharded_wrapper(self.model.optimizer)
        if wrapper is None:
            raise ValueError("shard_optimizer_state=True needs the model's optimizer "
                             "wrapped (fit does it). Received: "
                             f"optimizer={type(self.model.optimizer).__name__}")
        return wrapper

    def prepare(self) -> None:
        """The sharded state of the model's optimizer, made before the first step."""
        self.state = self._wrapper().make_state(self.strategy,
                                                list(self.model.trainable_variables))
        if not self._full:
            kinds = len(self.slots(0)[0]) if self.state.buckets else 0
            self._full = [FullSlot(self, k, s) for k in range(len(self.state.buckets))
                          for s in range(kinds)]

    def slots(self, replica: int) -> list[list]:
        """Local replica ``replica``'s slot variables, per bucket, in the optimizer's
        order (momentum before velocity)."""
        found = [[] for _ in self.state.buckets]
        for v in self.state.optimizers[replica].variables:
            match = re.search(r"_bucket_(\d+)_", v.path if hasattr(v, "path") else v.name)
            if len(v.shape) > 0 and match:
                found[int(match.group(1))].append(v)
        return found

    def shared_variables(self) -> list:
        return list(self._full)

    def resize(self, old: int, new: int) -> None:
        """Makes the sharded state again, cut for ``new`` replicas (its slots are then
        assigned the committed whole slots)."""
        self._wrapper().drop_state()
        self.state = None
        self.prepare()



def _sharded_variables(optimizer) -> list:
    """The slices a sharded optimizer wrapper holds (each replica's own), or []."""
    wrapper = sharded_wrapper(optimizer)
    return [] if wrapper is None else wrapper.sharded_variables()
