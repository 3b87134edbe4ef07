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


def check_bool(name: str, value) -> bool:
    """``value`` if it is True or False, else `ValueError`."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")
    return value


def check_number(name: str, value, *, allow_none: bool = False):
    """``value`` as a float > 0 (or None if allowed), else `ValueError`."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a number > 0. "
                         f"Received: {name}={value!r}")
    return float(value)


def check_device_list(devices) -> list[str]:
    """``devices`` (a name or a list of names) as a list: not empty, no duplicates.

    Whether each device exists on this host is `tfdist.devices.validate_devices`' check.
    """
    if isinstance(devices, str):
        devices = [devices]
    if not isinstance(devices, (list, tuple)) or not all(isinstance(d, str) for d in devices):
        raise ValueError("devices must be a device name or a list of them, e.g. ['/cpu:0']. "
                         f"Received: devices={devices!r}")
    devices = list(devices)
    if not devices:
        raise ValueError("devices must name at least one device. Received: devices=[]")
    if len(set(d.lower() for d in devices)) != len(devices):
        raise ValueError(f"devices contains duplicates. Received: devices={devices}")
    return devices
