"""Model averaging in an elastic job: what `tfdist.ModelAverageStrategy` tells elastic
``fit`` (`tfdist.strategies.elastic.fit.ElasticFit`).

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

`AveragedModel` says this as a `tfdist.strategies.state.StateComponent`, built on the
fragments' own components (`tfdist.strategies.averaging.fragment.Fragment`); elastic
``fit`` (`tfdist.strategies.elastic.fit`) asks it with the strategy's other components.
"""

from __future__ import annotations

from tfdist.keras.optimizer import inner_optimizer
from tfdist.strategies.averaging.exchange import optimizer_slots
from tfdist.strategies.averaging.fragment import assign_piece, tf_variable
from tfdist.strategies.state import StateComponent, unique


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


class AveragedModel(StateComponent):
    """The state of a model trained by model averaging, as one component.

    - Shared (committed and broadcast): the model's and optimizer's variables, and
      every fragment's shared variables (anchors, outer optimizers). The weights and
      slots are sent only to members that are behind and to joiners: a member holding
      the newest commit keeps its own values of them (`kept_when_newest`), since
      between averages each member's weights are its own.
    - Own: every fragment's residuals (refused in elastic jobs, `check_elastic`).
    - Resize: the anchors and outer slots are whole on every member, so any replica
      count takes them over; the fragments refuse what they cannot hand over.

    Args:
        strategy: The `tfdist.ModelAverageStrategy`.
        model: The Keras model being fit.
    """

    feature = "model averaging"

    def __init__(self, strategy, model):
        self.strategy = strategy
        self.model = model

    @property
    def optimizer(self):
        """The trained (inner) optimizer."""
        return inner_optimizer(self.model.optimizer)

    @property
    def state(self):
        """The optimizer's `AveragingState`, or None before it is made."""
        return self.strategy.averaging_state(self.optimizer)

    def prepare(self) -> None:
        """The anchors and the outer optimizer, made before the first train step (the
        step would make them equal to the weights then)."""
        self.strategy.averaging_state_for(self.optimizer,
                                          list(self.model.trainable_variables))

    def averaging_variables(self) -> list:
        """The fragments' shared variables: anchors and outer optimizers' variables."""
        state = self.state
        return [] if state is None else state.shared_variables()

    def shared_variables(self) -> list:
        return unique((*self.model.variables, *self.optimizer.variables,
                       *self.averaging_variables()))

    def own_variables(self) -> list:
        state = self.state
        return [] if state is None else state.own_variables()

    def kept_when_newest(self) -> set:
        """Ids of the model's variables and the optimizer's slots: each member's own."""
        return {id(v) for v in (*self.model.variables, *optimizer_slots(self.optimizer))}

    def may_reform(self) -> bool:
        """Only before a step that averages (the members meet there)."""
        step = int(self.optimizer.iterations.numpy())
        return any(self.strategy.is_average_step(step + k)
                   for k in range(1, self.model.steps_per_execution + 1))

    def after_join(self) -> None:
        """The joiner starts from the last global weights."""
        state = self.state
        for piece, anchor in zip(state.pieces, state.anchors):
            assign_piece(tf_variable(state.variables[piece.variable]), piece,
                         tf_variable(anchor).read_value())

    def resize_refusal(self, old: int, new: int) -> str | None:
        state = self.state
        return None if state is None else state.resize_refusal(old, new)

