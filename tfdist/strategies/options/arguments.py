"""Every strategy's argument checks, without TensorFlow.

A strategy's ``__init__`` calls its ``check_<strategy.name>`` here before it starts
anything, and ``tfdist train`` calls the same function on ``strategy.options`` before any
process starts (`check_options`), so a bad value is one line there, not a traceback per
task. Each function takes its class's keyword arguments with the same defaults (but
none of `registry.NOT_FROM_CONFIG`; tests/test_strategy_registry.py holds them equal),
returns the checked values, and raises `ValueError` naming the argument and what it
received. What only the running cluster can tell (whether a device exists, the engine
``"auto"`` picks, an elastic job's needs) stays in the constructors.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from tfdist._hooks.sharded.row_blocks import UPDATE_BLOCK_BYTES
from tfdist.checks import (check_bool, check_device_list, check_int, check_number,
                           check_seconds)
from tfdist.comm.options import CommunicationOptions, merge_options
from tfdist.comm.quantize import check_outer_compression
from tfdist.engines.registry import AUTO, check_engine, engine_class, engine_with_groups
from tfdist.strategies import registry
from tfdist.strategies.options import pairs

DEFAULT_STARTUP_TIMEOUT = 60.0
# Seconds a collective may wait for its peers before failing; None: no limit. None by
# default because TF implements the timeout with one OS thread per collective that
# sleeps for the whole timeout (benchmarks/overhead.md: ~4 threads per step, each
# living that long). A frozen or dead peer is still caught by the heartbeat.
DEFAULT_COLLECTIVE_TIMEOUT = None
# Seconds without a heartbeat before the coordination service declares a task dead.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
# Elastic jobs: steps between commits of the state a re-formed job rolls back to.
DEFAULT_COMMIT_EVERY_STEPS = 1
DEFAULT_STEP_TIMEOUT = 600.0
PS_MODES = ("async", "sync")


def check_options(name: str, options: dict[str, Any]) -> None:
    """Checks ``strategy.options`` of a ``strategy.name`` with its class's own checks.

    Raises:
        ValueError: a value is wrong (the message names it and what was received).
        TypeError: an option the class does not take.
    """
    entry = registry.get(name)
    if entry.class_name is not None:
        getattr(sys.modules[__name__], f"check_{entry.name}")(**options)


def check_pairs(name: str, function, values: dict[str, Any], modes=None) -> None:
    """Refuses an option the launch modes of this task's environment (or ``modes``)
    refuse (`tfdist.strategies.options.pairs`); ``values`` are ``function``'s arguments, of
    which those at their defaults are not checked."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()}
    defaults.setdefault("commit_every_steps", DEFAULT_COMMIT_EVERY_STEPS)
    given = {k: v for k, v in values.items() if k not in defaults or not _same(v, defaults[k])}
    pairs.check_modes(name, given, pairs.environment_modes() if modes is None else modes)


def _same(value, default) -> bool:
    if isinstance(value, bool) is not isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # e.g. an array
        return False


def _sync_options(communication_options, compression, accumulate_steps,
                  shard_optimizer_state) -> CommunicationOptions:
    check_bool("shard_optimizer_state", shard_optimizer_state)
    return merge_options(communication_options, compression=compression,
                         accumulate_steps=accumulate_steps)


# DeepSpeed's persistence threshold (stage3_param_persistence_threshold).
MIN_SHARD_ELEMENTS = 100_000


def check_sharding(shard_parameters=False, min_shard_elements=MIN_SHARD_ELEMENTS,
                   shard_filter=None, reshard_after_forward=True,
                   shard_optimizer_state=False) -> dict | None:
    """The ``shard_parameters`` arguments, checked: None when it is off, else the
    `tfdist.strategies.fsdp.shards.ParameterSharding` keyword arguments."""
    check_bool("shard_parameters", shard_parameters)
    check_int("min_shard_elements", min_shard_elements, 1)
    check_bool("reshard_after_forward", reshard_after_forward)
    if shard_filter is not None and not callable(shard_filter):
        raise ValueError("shard_filter must be None or a function of a variable's path. "
                         f"Received: shard_filter={shard_filter!r}")
    if not shard_parameters:
        return None
    if shard_optimizer_state:
        raise ValueError("shard_parameters=True shards the optimizer state with the "
                         "parameters; drop shard_optimizer_state. Received: "
                         "shard_optimizer_state=True")
    return dict(min_shard_elements=min_shard_elements, shard_filter=shard_filter,
                reshard_after_forward=reshard_after_forward)


def check_mirrored(devices=None, communication_options=None, compression=None,
                   accumulate_steps=None, shard_optimizer_state=False,
                   shard_parameters=False, min_shard_elements=MIN_SHARD_ELEMENTS,
                   shard_filter=None, reshard_after_forward=True) -> CommunicationOptions:
    """`tfdist.MirroredStrategy`'s arguments; returns its `CommunicationOptions`."""
    if devices is not None:
        check_device_list(devices)
    options = _sync_options(communication_options, compression, accumulate_steps,
                            shard_optimizer_state)
    check_sharding(shard_parameters, min_shard_elements, shard_filter, reshard_after_forward,
                   shard_optimizer_state)
    return options


def check_model_parallel(layout_map, devices=None, communication_options=None,
                         compression=None, accumulate_steps=None,
                         model_parallel=None) -> CommunicationOptions:
    """`tfdist.ModelParallelStrategy`'s arguments; returns its `CommunicationOptions`.
    (That ``model_parallel`` divides the replica count is checked once they are known.)"""
    if model_parallel is not None:
        check_int("model_parallel", model_parallel, 1)
    items = getattr(layout_map, "items", None)
    keys = list(layout_map.keys()) if items is not None else []
    if not keys or not all(isinstance(k, str) for k in keys):
        raise ValueError("layout_map must map variable path patterns (strings) to layouts, "
                         f"at least one. Received: layout_map={layout_map!r}")
    for key in keys:
        try:
            re.compile(key)
        except re.error as error:  # a key is a path or a pattern that re.fullmatch-es paths
            raise ValueError(f"layout_map key {key!r} is not a valid regular expression "
                             f"({error}). Received: layout_map={layout_map!r}") from None
        axes = getattr(layout_map[key], "axes", layout_map[key])
        if not isinstance(axes, (tuple, list)) or not all(
                a is None or isinstance(a, str) for a in axes):
            raise ValueError(f"layout_map[{key!r}] must be a tuple of mesh axis names or None "
                             "('' in a TOML config), or a keras.distribution.TensorLayout. "
                             f"Received: layout_map={layout_map!r}")
    if devices is not None:
        check_device_list(devices)
    options = merge_options(communication_options, compression=compression,
                            accumulate_steps=accumulate_steps)
    if options.accumulate_steps > 1:
        raise ValueError("ModelParallelStrategy does not accumulate gradients. Received: "
                         f"accumulate_steps={options.accumulate_steps}")
    return options


def check_multi_worker_model_parallel(layout_map, model_parallel=None,
                                      **kwargs) -> dict[str, Any]:
    """`tfdist.MultiWorkerModelParallelStrategy`'s arguments: its ``layout_map`` and
    those it passes on to `tfdist.MultiWorkerMirroredStrategy`; returns those."""
    check_model_parallel(layout_map, accumulate_steps=kwargs.get("accumulate_steps"),
                         communication_options=kwargs.get("communication_options"),
                         model_parallel=model_parallel)
    engine = kwargs.get("engine", AUTO)
    if model_parallel is not None and engine != AUTO and not engine_class(
            check_engine(engine)).supports_groups:
        raise ValueError("A data x model mesh (model_parallel) needs collectives within "
                         f"groups of replicas, which engine={engine!r} does not have: use "
                         f"engine={engine_with_groups()!r}. Received: "
                         f"model_parallel={model_parallel}, engine={engine!r}")
    if kwargs.get("shard_optimizer_state"):
        raise ValueError("MultiWorkerModelParallelStrategy does not shard optimizer state. "
                         "Received: shard_optimizer_state=True")
    if kwargs.get("shard_parameters"):  # fully sharded parameters (issue #33)
        raise ValueError("MultiWorkerModelParallelStrategy shards parameters over the batch "
                         "axis from its layout map only (a kernel laid out ('batch', "
                         "'model') with model_parallel below the replicas). Received: "
                         "shard_parameters=True")
    check_multi_worker(**kwargs)
    given = dict(kwargs, layout_map=layout_map)
    if model_parallel is not None:
        given["model_parallel"] = model_parallel
    check_pairs("multi_worker_model_parallel", check_multi_worker_model_parallel, given)
    return dict(kwargs)


def check_horovod(devices=None, compression=None, communication_options=None,
                  accumulate_steps=None) -> CommunicationOptions:
    """`tfdist.HorovodStrategy`'s arguments; returns its `CommunicationOptions`."""
    if devices is not None:
        check_device_list(devices)
    return _sync_options(communication_options, compression, accumulate_steps, False)


def check_multi_worker(communication_options=None, startup_timeout=DEFAULT_STARTUP_TIMEOUT,
                       collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT,
                       heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT, compression=None,
                       accumulate_steps=None, engine="auto", shard_optimizer_state=False,
                       commit_every_steps=DEFAULT_COMMIT_EVERY_STEPS, shard_parameters=False,
                       min_shard_elements=MIN_SHARD_ELEMENTS, shard_filter=None,
                       reshard_after_forward=True) -> dict[str, Any]:
    """`tfdist.MultiWorkerMirroredStrategy`'s arguments, checked: a dict of
    ``commit_every_steps``, the three timeouts, ``options`` and ``sharding``."""
    checked = dict(
        commit_every_steps=check_int("commit_every_steps", commit_every_steps, 1),
        startup_timeout=check_seconds("startup_timeout", startup_timeout),
        collective_timeout=check_seconds("collective_timeout", collective_timeout,
                                         allow_none=True),
        heartbeat_timeout=check_seconds("heartbeat_timeout", heartbeat_timeout))
    check_engine(engine)
    checked["options"] = _sync_options(communication_options, compression, accumulate_steps,
                                       shard_optimizer_state)
    checked["sharding"] = check_sharding(
        shard_parameters, min_shard_elements, shard_filter, reshard_after_forward,
        shard_optimizer_state)
    check_pairs("multi_worker", check_multi_worker, dict(
        compression=compression, accumulate_steps=accumulate_steps, engine=engine,
        shard_optimizer_state=shard_optimizer_state, commit_every_steps=commit_every_steps,
        shard_parameters=shard_parameters))
    return checked


def check_parameter_server(mode="async", *, steps_per_dispatch=None, chief_poll_seconds=1.0,
                           startup_timeout=60.0, step_timeout=DEFAULT_STEP_TIMEOUT,
                           exactly_once=True, update_block_bytes=UPDATE_BLOCK_BYTES) -> None:
    """`tfdist.ParameterServerStrategy`'s arguments."""
    if not isinstance(mode, str) or mode not in PS_MODES:
        raise ValueError(f"mode must be one of {list(PS_MODES)}. Received: mode={mode!r}")
    if steps_per_dispatch is not None:
        check_int("steps_per_dispatch", steps_per_dispatch, 1)
    check_number("chief_poll_seconds", chief_poll_seconds)
    check_number("startup_timeout", startup_timeout)
    check_bool("exactly_once", exactly_once)
    if update_block_bytes is not None:
        check_int("update_block_bytes", update_block_bytes, 1)
    check_number("step_timeout", step_timeout, allow_none=True)


def check_model_average(period=1, warmup_steps=0, outer_optimizer=None,
                        average_optimizer_state=False, devices=None, *, compression=None,
                        engine="auto", fragments=1, sync_delay=0, mix=1.0,
                        outer_compression=None, **base_kwargs) -> dict[str, Any]:
    """`tfdist.ModelAverageStrategy`'s arguments, and those it passes on to
    `tfdist.MultiWorkerMirroredStrategy` (``base_kwargs``).

    Returns:
        A dict of the checked ``period``, ``warmup_steps``, ``fragments``,
        ``sync_delay``, ``mix``, ``average_optimizer_state``, ``options`` (its
        `CommunicationOptions`), ``outer_compression`` and the ``base_kwargs`` for the
        base class (without ``communication_options`` and ``shard_optimizer_state``).
    """
    base_kwargs = dict(base_kwargs)
    period = check_int("period", period, 1)
    warmup_steps = check_int("warmup_steps", warmup_steps, 0)
    check_bool("average_optimizer_state", average_optimizer_state)
    fragments = check_fragments(period, fragments, average_optimizer_state)
    sync_delay, mix = check_delay(period, fragments, warmup_steps, average_optimizer_state,
                                  sync_delay, mix)
    check_template(outer_optimizer)
    if devices is not None:
        check_device_list(devices)
    if base_kwargs.pop("shard_optimizer_state", False):
        raise ValueError("ModelAverageStrategy keeps a whole optimizer per worker; "
                         "shard_optimizer_state is for the synchronous strategies. "
                         "Received: shard_optimizer_state=True")
    if base_kwargs.pop("shard_parameters", False):
        raise ValueError("ModelAverageStrategy keeps whole models on every worker: "
                         "shard_parameters is for the synchronous strategies. "
                         "Received: shard_parameters=True")
    # accumulate_steps too: given to the base class, it would be ignored, silently.
    options = merge_options(base_kwargs.pop("communication_options", None),
                            compression=compression,
                            accumulate_steps=base_kwargs.pop("accumulate_steps", None))
    if options.accumulate_steps > 1:
        raise ValueError("ModelAverageStrategy applies every micro-batch locally; "
                         "accumulate_steps is for the synchronous strategies. Received: "
                         f"accumulate_steps={options.accumulate_steps}")
    outer_compression = check_outer_compression(outer_compression, options.compression)
    check_multi_worker(engine=engine, **base_kwargs)
    check_pairs("model_average", check_model_average, dict(
        warmup_steps=warmup_steps, outer_optimizer=outer_optimizer,
        average_optimizer_state=average_optimizer_state, devices=devices,
        compression=options.compression, engine=engine, fragments=fragments,
        sync_delay=sync_delay,
        mix=mix, outer_compression=outer_compression,
        commit_every_steps=base_kwargs.get("commit_every_steps", 1)))
    return dict(period=period, warmup_steps=warmup_steps, fragments=fragments,
                sync_delay=sync_delay, mix=mix,
                average_optimizer_state=average_optimizer_state, options=options,
                outer_compression=outer_compression, base_kwargs=base_kwargs)


def check_fragments(period: int, fragments, average_optimizer_state) -> int:
    """``fragments`` checked against ``period`` (see `tfdist.ModelAverageStrategy`)."""
    fragments = check_int("fragments", fragments, 1)
    if period % fragments:
        raise ValueError("period must be a multiple of fragments: fragment f averages "
                         "f * period / fragments steps into each period. Received: "
                         f"period={period}, fragments={fragments}")
    if fragments > 1 and average_optimizer_state:
        raise ValueError("average_optimizer_state needs fragments=1 (the slots are not "
                         f"split into fragments). Received: fragments={fragments}")
    return fragments


def check_delay(period, fragments, warmup_steps, average_optimizer_state, sync_delay, mix):
    """``(sync_delay, mix)`` checked (see `tfdist.ModelAverageStrategy`)."""
    sync_delay = check_int("sync_delay", sync_delay, 0)
    if sync_delay >= period // fragments:
        raise ValueError("sync_delay must be below period / fragments (a fragment's "
                         "exchange is applied before the next fragment's starts). "
                         f"Received: sync_delay={sync_delay}, period={period}, "
                         f"fragments={fragments}")
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 <= mix <= 1:
        raise ValueError(f"mix must be a number in [0, 1]. Received: mix={mix!r}")
    delayed = sync_delay > 0 or mix != 1
    if delayed and warmup_steps:
        raise ValueError("warmup_steps needs sync_delay=0 and mix=1 (the warm-up averages "
                         f"every fragment every step). Received: warmup_steps={warmup_steps}, "
                         f"sync_delay={sync_delay}, mix={mix}")
    if delayed and average_optimizer_state:
        raise ValueError("average_optimizer_state needs sync_delay=0 and mix=1. Received: "
                         f"average_optimizer_state=True, sync_delay={sync_delay}, mix={mix}")
    return sync_delay, float(mix)


def check_template(outer_optimizer) -> None:
    """Refuses an ``outer_optimizer`` argument that cannot give a usable optimizer: not
    an optimizer, a function, a config or None, or an optimizer that uses what the
    outer step would skip (`tfdist.strategies.averaging.outer.check_outer`)."""
    if outer_optimizer is not None and not (
            hasattr(outer_optimizer, "get_config") or callable(outer_optimizer)
            or isinstance(outer_optimizer, (str, dict))):
        raise ValueError("outer_optimizer must be a Keras optimizer, a function that "
                         "returns one, its config (dict or name), or None. "
                         f"Received: outer_optimizer={outer_optimizer!r}")
    if hasattr(outer_optimizer, "get_config"):  # an optimizer: Keras is loaded already
        from tfdist.strategies.averaging.outer import check_outer

        check_outer(outer_optimizer)
