"""State as components: each stateful feature declares its state once.

Elastic commits, rollbacks and joiner broadcasts ask a strategy's components
(`StateComponent`) what to copy, and nothing else. Saves (``save``, ``save_weights``,
``ModelCheckpoint``, ``BackupAndRestore``) ask them whether a save now holds the whole
state (`StateComponent.save_refusal`); what a save writes is Keras' own save of the model
and its optimizer, which holds every component's shared state (sharded slots through the
`tfdist.strategies.zero.optimizer.ShardedOptimizer` wrapper's own variables; model
averaging averages first, so its anchors are the saved weights). A component
says, for its feature:

- which variables every member holds equal (`StateComponent.shared_variables`):
  committed, saved, broadcast to a joiner;
- which variables stay each member's own (`StateComponent.own_variables`): committed
  and restored on the member, never sent;
- how its state goes from N replicas to M (`StateComponent.resize`), or why it cannot
  (`StateComponent.resize_refusal`, asked before anything runs);
- what happens when a commit is kept or rolled back (`StateComponent.committed`,
  `StateComponent.rolled_back`: the elastic data position,
  `tfdist.strategies.elastic.data.DataPosition`, marks its
  batch or rewinds to it);
- why a save cannot be taken now (`StateComponent.save_refusal`: inside an
  accumulation, whose sums are each replica's own); saves hold the shared variables;
- where a commit may land (`StateComponent.commit_point`: gradient accumulation commits
  only where its sums are zero), and when a membership change may be taken in
  (`StateComponent.may_reform`: model averaging only before an average).

A shared "variable" may be any object with ``shape``, ``dtype``, ``assign(value)`` and
a traced ``read_for_commit()`` (sharded optimizer state commits its slots gathered
whole, so that the slices of a lost member are not lost with it).

This is Horovod elastic's ``State`` (save, restore, sync) and torchft's
``register_state_dict_fn``, with the replica count as part of the contract.
"""

from __future__ import annotations

from typing import Iterable


class ResizeRefused(ValueError):
    """A feature's state cannot go from one replica count to another."""


class StateComponent:
    """One stateful feature's state; the defaults hold nothing and resize freely.

    Attributes:
        feature: The feature's name as the user writes it (``"accumulate_steps"``),
            for refusals.
    """

    feature = "state"

    def shared_variables(self) -> list:
        """Variables every member holds equal: committed, saved, sent to a joiner."""
        return []

    def own_variables(self) -> list:
        """Variables each member keeps its own values of: committed, never sent."""
        return []

    def kept_when_newest(self) -> set:
        """Ids of shared variables a member holding the newest commit keeps its own
        values of at a re-forming (it still sends them, to members one step behind and
        to joiners): model averaging's weights."""
        return set()

    def prepare(self) -> None:
        """Makes the feature's state variables, before the first commit (eager)."""

    def after_join(self) -> None:
        """On a joiner, after it took the newest commit's values."""

    def may_reform(self) -> bool:
        """Whether a membership change may be taken in before the next step."""
        return True

    def commit_point(self, steps_ahead: int) -> bool:
        """Whether a commit may land after ``steps_ahead`` more train steps."""
        return True

    def committed(self) -> None:
        """The state was just committed here (the data position marks its batch)."""

    def rolled_back(self) -> None:
        """The state was just put back to the last commit (the data position rewinds
        to its batch, to replay the batches since)."""

    def save_refusal(self) -> str | None:
        """Why a save now would lose state no save holds (a member's own), or None."""
        return None

    def resize_refusal(self, old: int, new: int) -> str | None:
        """Why the state cannot go from ``old`` to ``new`` replicas, or None."""
        return None

    def resize(self, old: int, new: int) -> None:
        """Re-cuts the state, made for ``old`` replicas, for ``new`` (after a re-forming
        restored every member's committed values)."""

    def check_resize(self, old: int, new: int) -> None:
        """Raises `ResizeRefused` naming the feature when `resize_refusal` says why."""
        reason = self.resize_refusal(old, new)
        if reason:
            raise ResizeRefused(f"{self.feature} cannot go from {old} to {new} replicas: "
                                f"{reason}. Received: {self.feature} in an elastic job")


def unique(variables: Iterable) -> list:
    """``variables`` each once (by identity), in their first order."""
    seen, found = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


def shared_variables(components: Iterable[StateComponent]) -> list:
    """Every component's shared variables, each once, in the components' order."""
    return unique(v for c in components for v in c.shared_variables())


def own_variables(components: Iterable[StateComponent]) -> list:
    """Every component's own variables, each once, in the components' order."""
    return unique(v for c in components for v in c.own_variables())


def resize(components: Iterable[StateComponent], old: int, new: int) -> None:
    """Checks every component first, then re-cuts each: all or none."""
    components = list(components)
    for component in components:
        component.check_resize(old, new)
    if old != new:
        for component in components:
            component.resize(old, new)


def may_reform(components: Iterable[StateComponent]) -> bool:
    """Whether every component lets a membership change in before the next step."""
    return all(c.may_reform() for c in components)


def commit_point(components: Iterable[StateComponent], steps_ahead: int) -> bool:
    """Whether every component lets a commit land after ``steps_ahead`` more steps."""
    return all(c.commit_point(steps_ahead) for c in components)


def check_save(components: Iterable[StateComponent]) -> None:
    """Raises ValueError naming each feature whose state a save now would lose."""
    reasons = [f"{c.feature}: {reason}" for c in components
               for reason in [c.save_refusal()] if reason]
    if reasons:
        raise ValueError("a save here would lose training state: " + "; ".join(reasons))


def committed(components: Iterable[StateComponent]) -> None:
    """Tells every component that the state was just committed."""
    for component in components:
        component.committed()


def rolled_back(components: Iterable[StateComponent]) -> None:
    """Tells every component that the state was just put back to the last commit."""
    for component in components:
        component.rolled_back()


def kept_when_newest(components: Iterable[StateComponent]) -> set:
    """Every component's `StateComponent.kept_when_newest` ids."""
    return {i for c in components for i in c.kept_when_newest()}
