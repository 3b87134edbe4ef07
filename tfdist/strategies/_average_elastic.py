"""Model averaging in an elastic job: what `tfdist.ModelAverageStrategy` tells elastic
``fit`` (`tfdist.strategies._elastic.ElasticFit`).

Between averages the members train apart and send nothing, so a lost member is noticed
at the next average, and a membership change is taken in only there:

- Before an average step, a newer membership (a loss or a joiner) makes every member
  roll back to its commit, re-form, and run the step again with the new replica count;
  an average that fails because a member was lost does the same. The survivors thus
  average among themselves; the lost member's steps since the last average are lost.
- Each member keeps its own weights and optimizer slots through the re-forming; the
  anchors (the last global weights), the outer optimizer and the step are taken from
  the member with the newest commit. A member one step behind (a loss after some
  members finished an average) takes that member's whole state, the average included.
- A joiner takes the newest commit's state and starts from the last global weights
  (the anchors), with that member's optimizer slots.
"""

from __future__ import annotations

from tfdist.keras.optimizer import inner_optimizer
from tfdist.strategies import _average_steps
from tfdist.strategies._average_state import assign_piece, tf_variable
from tfdist.strategies.state import StateComponent


def check_elastic(strategy, commit_every_steps=1) -> None:
    """Raises unless the strategy's options can drop and take in members.

    Args:
        strategy: A `tfdist.ModelAverageStrategy` in an elastic job.
        commit_every_steps: As given to it: members that fail apart must meet at a
            commit taken at an average, so it must be 1.
    """
    refused = [(name, value) for name, value, default in (
        ("fragments", strategy.fragments, 1), ("sync_delay", strategy.sync_delay, 0),
        ("mix", strategy.mix, 1.0), ("outer_compression", strategy.outer_compression, None),
        ("commit_every_steps", commit_every_steps, 1))
        if value != default]
    if refused:
        given = ", ".join(f"{name}={value!r}" for name, value in refused)
        raise ValueError(
            "In an elastic job (tfdist launch --min-workers) ModelAverageStrategy averages "
            "whole models at each average and commits every step: Streaming DiLoCo "
            "(fragments, sync_delay, mix) and outer_compression keep per-worker state "
            "that cannot be handed to a joiner yet, and a commit between averages could "
            f"not be shared (docs/elastic.md, Limits). Received: {given}")


class AverageElasticState(StateComponent):
    """Model averaging's state component (see the module's words): the anchors and
    the outer optimizers are shared; each member keeps its weights and slots."""

    feature = "ModelAverageStrategy"

    def __init__(self, strategy, model):
        self.strategy = strategy
        self.model = model

    @property
    def _optimizer(self):
        return inner_optimizer(self.model.optimizer)

    @property
    def _state(self):
        return self.strategy._states[id(self._optimizer)]

    def prepare(self) -> None:
        """The anchors and the outer optimizer, made before the first train step (the
        step would make them equal to the weights then)."""
        _average_steps.ensure_state(self.strategy, self._optimizer,
                                    list(self.model.trainable_variables))

    def shared_variables(self) -> list:
        """The anchors and the outer optimizers' variables."""
        if id(self._optimizer) not in self.strategy._states:
            return []
        state = self._state
        return [*state.anchors, *(v for outer in state.outers for v in outer.variables)]

    def kept_when_newest(self) -> set:
        """The model's variables and the optimizer's slots: each member's own."""
        return {id(v) for v in (*self.model.variables,
                                *_average_steps.optimizer_slots(self._optimizer))}

    def may_reform(self) -> bool:
        """Only before a step that averages (the members meet there)."""
        step = int(self._optimizer.iterations.numpy())
        return any(self.strategy.is_average_step(step + k)
                   for k in range(1, self.model.steps_per_execution + 1))

    def after_join(self) -> None:
        """The joiner starts from the last global weights."""
        state = self._state
        for piece, anchor in zip(state.pieces, state.anchors):
            assign_piece(tf_variable(state.variables[piece.variable]), piece,
                         tf_variable(anchor).read_value())
