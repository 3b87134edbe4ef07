"""Argument checks shared by every layer, with tfdist's error wording. No TF import."""

from __future__ import annotations


def check_int(name: str, value, minimum: int = 0, *, field: str | None = None):
    """``value`` if it is an integer (not a bool) >= ``minimum``, else `ValueError`.

    Args:
        name: The argument's name, as the message shows it.
        value: What was received.
        minimum: The smallest allowed value.
        field: How the message names the argument if not ``name`` (e.g. ``"task index"``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field or name} must be an integer >= {minimum}. "
                         f"Received: {name}={value!r}")
    return value


def check_seconds(name: str, value, *, allow_none: bool = False):
    """``value`` as a float number of seconds > 0 (or None if allowed), else `ValueError`."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0"
                         f"{' or None' if allow_none else ''}. Received: {name}={value!r}")
    return float(value)
