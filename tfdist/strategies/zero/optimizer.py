"""`ShardedOptimizer`: sharded optimizer state (ZeRO-1/2) as a Keras optimizer wrapper.

In the style of ``keras.optimizers.LossScaleOptimizer``: it wraps the user's optimizer
(``inner_optimizer``), whose settings (learning rate, weight decay, clipping) it reads
and whose ``__dict__`` it leaves alone. Its own variables are the outer counters and,
once built under a strategy, each local replica's slot slices
(`tfdist.strategies.zero.sharded_state.ShardedOptimizerState`). Saves go through
`ShardedOptimizer.save_own_variables` / `load_own_variables`: the file holds the
unsharded layout (gathered on save, re-cut for this replica count on load).
``shard_optimizer_state=True`` wraps the model's optimizer in one at ``fit``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks import zero as zero_hooks
from tfdist._hooks.saves import hidden_from_keras_saves
from tfdist.strategies.zero import sharded_state as sharded
from tfdist.strategies.zero import saved_layout as layout


class _Shards:
    """Holds the sharded state out of Keras' attribute tracking."""

    state = None
    variables: list = []  # the model's variables (`ShardedOptimizer.build`)
    strategy = None  # the strategy the state is cut for (saves gather through it)
    pending = None  # a loaded whole state not yet cut (loaded before the first step)


class ShardedOptimizer(keras.optimizers.Optimizer):
    """Wraps ``inner_optimizer``; each replica keeps and updates 1/N of its slots.

    Args:
        inner_optimizer: An element-wise Keras optimizer (`tfdist.strategies.zero.sharded_state.SHARDABLE`).
        bucket_bytes: Gradient bytes per bucket (None: `tfdist.strategies.zero.sharded_state.BUCKET_BYTES`).
        name: The wrapper's name.
    """

    def __init__(self, inner_optimizer, bucket_bytes=None, name=None, **kwargs):
        sharded.check_shardable(inner_optimizer)
        super().__init__(learning_rate=0.0, name=name or "sharded_optimizer", **kwargs)
        self.inner_optimizer = inner_optimizer
        self.bucket_bytes = bucket_bytes
        self._shards = _Shards()

    # ---- Keras' public optimizer API ----------------------------------------------------

    def build(self, var_list):
        """Records the variables; the slots are made per replica at `make_state`."""
        keras.optimizers.Optimizer.build(self.inner_optimizer, var_list)  # no slots
        super().build(var_list)
        self._shards.variables = list(var_list)

    def apply(self, grads, trainable_variables=None):
        """Keras' step: the strategy's hand-off routes the update to `sharded_update`."""
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError("ShardedOptimizer.apply runs in a replica context "
                             "(inside strategy.run). Received: cross-replica context")
        # The inner optimizer's counter drives its learning-rate schedule and bias
        # corrections in the sharded step: it follows the wrapper's.
        self.inner_optimizer.iterations.assign(self.iterations)
        super().apply(grads, trainable_variables)
        self.inner_optimizer.iterations.assign(self.iterations)

    def update_step(self, gradient, variable, learning_rate):
        """Reached only when no tfdist strategy shards the step: refused."""
        raise ValueError(
            "ShardedOptimizer steps under a tfdist strategy with shard_optimizer_state=True "
            "(the strategy reduce-scatters the gradients). Received: strategy="
            f"{type(tf.distribute.get_strategy()).__name__}")

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def variables(self):
        """The counters, the inner optimizer's own and every local slot slice."""
        return super().variables + self.inner_optimizer.variables + self.sharded_variables()

    def sharded_variables(self) -> list:
        """Each local replica's slot slices (none before the first sharded step)."""
        state = self._shards.state
        if state is None:
            return []
        return [v for inner in state.optimizers for v in inner.variables if len(v.shape)]

    def __dir__(self):
        """No ``inner_optimizer``: Keras' saves then write no group for it (its counters
        are in `save_own_variables`), so the file holds what an unsharded run writes."""
        return hidden_from_keras_saves(super().__dir__(), ("inner_optimizer",))

    def save_own_variables(self, store):
        """The unsharded layout (`unsharded_variables`)."""
        for i, variable in enumerate(self.unsharded_variables()):
            store[str(i)] = np.asarray(variable.numpy())

    def unsharded_variables(self) -> list:
        """The unsharded layout: what the inner optimizer built on the model's
        variables would hold (counters, then every slot whole; gathered, a collective:
        every worker saves)."""
        return list(self._whole().variables)

    def load_own_variables(self, store):
        """An unsharded-layout state (this wrapper's save, or an unwrapped optimizer's),
        cut for this replica count."""
        template = layout.make_template(self.inner_optimizer, self._shards.variables)
        template.load_own_variables(store)
        layout.copy_counters(template, self.inner_optimizer)
        self.iterations.assign(self.inner_optimizer.iterations)
        if self._shards.state is not None:
            layout.scatter_from_template(self._shards.state, template,
                                         self._shards.variables)
        else:
            self._shards.pending = template

    def get_config(self):
        return {"name": self.name, "bucket_bytes": self.bucket_bytes,
                "inner_optimizer": keras.optimizers.serialize(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        inner = keras.optimizers.deserialize(config.pop("inner_optimizer"),
                                             custom_objects=custom_objects)
        return cls(inner, **config)

    # ---- the sharded state (tfdist's strategies call these) ------------------------------

    @property
    def state(self):
        """The `tfdist.strategies.zero.sharded_state.ShardedOptimizerState`, or None before it is made."""
        return self._shards.state

    def make_state(self, strategy, variables=None):
        """The sharded state, made for ``strategy``'s replica count when missing."""
        if self._shards.state is None:
            variables = list(variables if variables is not None
                             else self._shards.variables)
            state = sharded.ShardedOptimizerState(strategy, self.inner_optimizer, variables,
                                                  self.bucket_bytes)
            self._shards.state, self._shards.strategy = state, strategy
            if self._shards.pending is not None:
                with zero_hooks.plain_variables():
                    layout.scatter_from_template(state, self._shards.pending, variables)
                self._shards.pending = None
        return self._shards.state

    def drop_state(self) -> None:
        """Forgets the slices (made again, for the current replica count, when next
        needed: an elastic resize)."""
        self._shards.state = self._shards.strategy = None

    def sharded_update(self, distribution, communicator, grads, variables, scale=None):
        """Cross-replica: one sharded step of ``grads`` (see
        `tfdist.strategies.zero.sharded_state.ShardedOptimizerState.apply`)."""
        self.make_state(distribution, variables).apply(
            distribution, communicator, self.inner_optimizer, grads, variables, scale=scale)

    def _whole(self):
        """An unsharded optimizer holding the whole state (gathered, a collective)."""
        if self._shards.state is None or not self.built:
            template = (self._shards.pending if self._shards.pending is not None else
                        layout.make_template(self.inner_optimizer,
                                             self._shards.variables))
            layout.copy_counters(self.inner_optimizer, template)
            return template
        return layout.gather_into_template(self._shards.strategy, self._shards.state,
                                           self.inner_optimizer, self._shards.variables)


class ShardedLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """A `keras.optimizers.LossScaleOptimizer` over a `ShardedOptimizer` whose saves
    hold the unsharded layout: the loss scale's variables, then the inner optimizer's
    whole state (as a loss-scaled unsharded optimizer writes).

    Args:
        loss_scale: The `LossScaleOptimizer` ``compile`` made (its settings are kept).
        inner_optimizer: The `ShardedOptimizer` wrapping its inner optimizer.
    """

    def __init__(self, inner_optimizer, initial_scale=2.0**15, dynamic_growth_steps=2000,
                 **kwargs):
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, **kwargs)

    def _own(self) -> list:
        inner = {id(v) for v in self.inner_optimizer.variables}
        return [v for v in self.variables if id(v) not in inner]

    def save_own_variables(self, store):
        whole = self._own() + self.inner_optimizer.unsharded_variables()
        for i, variable in enumerate(whole):
            store[str(i)] = np.asarray(variable.numpy())

    def load_own_variables(self, store):
        own = self._own()
        for i, variable in enumerate(own):
            variable.assign(store[str(i)])
        self.inner_optimizer.load_own_variables(
            {str(i - len(own)): store[str(i)] for i in range(len(own), len(store.keys()))})
