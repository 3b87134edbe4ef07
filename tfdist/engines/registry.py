"""The engine registry: engine names -> `Engine` classes, and the ``engine="auto"`` rule.

``"tf"`` (TF's collectives) and ``"horovod"`` (Horovod's ops over Gloo) are built in and
imported only when chosen. `register_engine` adds one, in the shape of torch's
``Backend.register_backend``.

Measured on 2 processes of one 2-core host (benchmarks/RESULTS.md, "Engines in fit";
``python -m benchmarks.engines``): a ``fit`` step with 32 MB of gradients took 163 ms with
``engine="tf"`` and 72 ms with ``engine="horovod"`` (0.44x; compute alone: 14 ms), and a
64 MB all-reduce 566 ms on TF's gRPC ring against 74 ms on Horovod/Gloo.
"""

from __future__ import annotations

import logging
import os
import re

from tfdist import env

AUTO = "auto"
ENV_VAR = env.ENGINE
logger = logging.getLogger("tfdist")
_logged = set()



def _tf_engine():
    from tfdist.engines.tf import TFEngine

    return TFEngine


def _horovod_engine():
    from tfdist.engines.horovod.engine import HorovodEngine

    return HorovodEngine


# Name -> an Engine subclass, or a function importing a built-in one (on first use).
_engines: dict[str, object] = {"tf": _tf_engine, "horovod": _horovod_engine}


def register_engine(name: str, engine_class) -> None:
    """Makes ``engine=name`` build ``engine_class`` in every tfdist strategy that takes it.

    Args:
        name: A lowercase name (letters, digits, ``_``), not ``"auto"`` nor a registered
            one.
        engine_class: A subclass of `tfdist.engines.Engine`.

    Raises:
        ValueError: the name is invalid or taken, or ``engine_class`` is not an Engine.
    """
    from tfdist.engines.base import Engine

    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == AUTO:
        raise ValueError("engine name must be lowercase letters, digits and '_', and not "
                         f"'auto'. Received: name={name!r}")
    if name in _engines:
        raise ValueError(f"engine {name!r} is already registered. Received: name={name!r}")
    if not (isinstance(engine_class, type) and issubclass(engine_class, Engine)):
        raise ValueError("engine_class must be a subclass of tfdist.engines.Engine. "
                         f"Received: engine_class={engine_class!r}")
    engine_class.name = name
    _engines[name] = engine_class


def available() -> tuple[str, ...]:
    """The registered engine names, built-in ones first (``"tf"``, ``"horovod"``)."""
    return tuple(_engines)


def check_engine(engine) -> str:
    """``engine`` if it is a registered name or ``"auto"``, else `ValueError`."""
    if not isinstance(engine, str) or (engine != AUTO and engine not in _engines):
        raise ValueError(f"engine must be one of {[*available(), AUTO]}. Received: "
                         f"engine={engine!r}")
    return engine


def engine_class(name: str):
    """The `Engine` subclass registered as ``name`` (importing a built-in one).

    Raises:
        ValueError: ``name`` is not registered.
    """
    if check_engine(name) == AUTO:
        raise ValueError(f"engine must be one of {[*available(), AUTO]}. Received: "
                         f"engine={name!r}")
    found = _engines[name]
    if not isinstance(found, type):  # a built-in engine, imported now
        found = found()
        found.name = name
        _engines[name] = found
    return found


def engine_with_groups() -> str:
    """The first registered engine whose collectives run within groups of replicas
    (`Engine.supports_groups`), for ``engine="auto"`` on a data x model mesh."""
    return next(name for name in available() if engine_class(name).supports_groups)


def select_engine(engine: str, num_workers: int, on_gpus: bool, is_chief: bool = True) -> str:
    """The engine a strategy uses: ``engine`` itself, or the choice of ``"auto"``.

    The rule for ``"auto"``, from the figures in this module's docstring:

    - ``"horovod"`` when the job has several workers, the replicas are CPUs and
      Horovod is installed: its Gloo all-reduce made a ``fit`` step 0.44x as long.
    - ``"tf"`` otherwise: one worker needs no engine; on GPUs TF's NCCL collectives
      are not measured against Horovod's; without Horovod there is no choice.

    The environment variable ``TFDIST_ENGINE`` (a registered name), when set, replaces
    ``"auto"``'s choice for every strategy of the job. The choice is logged once, by
    the chief.

    Args:
        engine: A registered name (`available`) or ``"auto"``.
        num_workers: Processes in the job.
        on_gpus: Whether the replicas are GPUs.
        is_chief: Whether this process logs the choice.

    Raises:
        ValueError: ``engine`` or ``TFDIST_ENGINE`` is not an engine.
    """
    if check_engine(engine) != AUTO:
        return engine
    override = os.environ.get(ENV_VAR)
    if override:
        if override not in _engines:
            raise ValueError(f"{ENV_VAR} must be {_quoted(available())}. Received: "
                             f"{ENV_VAR}={override!r}")
        chosen, why = override, f"{ENV_VAR}={override}"
    elif num_workers <= 1:
        return "tf"
    elif on_gpus:
        chosen, why = "tf", "the replicas are GPUs (NCCL)"
    elif not _horovod_installed():
        chosen, why = "tf", "Horovod is not installed (see docs/horovod.md)"
    else:
        chosen, why = "horovod", "Gloo's all-reduce is faster than TF's gRPC ring on CPUs"
    key = (chosen, num_workers, on_gpus)
    if is_chief and key not in _logged:
        _logged.add(key)
        logger.info("engine='auto' chose %r for %d workers: %s (see tfdist.engines).",
                    chosen, num_workers, why)
    return chosen


def _quoted(names) -> str:
    quoted = [repr(n) for n in names]
    return " or ".join(quoted) if len(quoted) <= 2 else ", ".join(quoted[:-1]) + \
        f" or {quoted[-1]}"


def _horovod_installed() -> bool:
    from tfdist.engines.horovod.ops import is_available

    return is_available()
