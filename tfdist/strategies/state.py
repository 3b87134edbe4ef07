"""State as components: each stateful feature declares its state once.

Elastic commits, rollbacks and joiner broadcasts, ``BackupAndRestore`` and saves ask a
strategy's components (`StateComponent`) what to copy, and nothing else. A component
says, for its feature:

- which variables every member holds equal (`StateComponent.shared_variables`):
  committed, saved, broadcast to a joiner;
- which variables stay each member's own (`StateComponent.own_variables`): committed
  and restored on the member, never sent;
- how its state goes from N replicas to M (`StateComponent.resize`), or why it cannot
  (`StateComponent.resize_refusal`, asked before anything runs).

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
