"""The main job's check of a ``layout_map`` against the built-in model it splits, before
any process starts (no TensorFlow): the ``model_parallel`` / ``multi_worker_model_parallel``
strategies' rules (`tfdist.strategies.tensor_parallel.splits.TensorParallel`) applied to the
variables ``model.name = "mlp"`` or ``"cnn"`` will have."""

from __future__ import annotations

import math
import re
from typing import Any

from tfdist.config import ConfigError, replica_count
from tfdist.strategies import registry

MODEL, BATCH = "model", "batch"


def builtin_variables(model: dict[str, Any], input_shape: tuple,
                      num_classes: int) -> dict[str, tuple[int, ...]] | None:
    """``{variable path: shape}`` of the model `tfdist.models.build_model` builds for
    ``model.name = "mlp"`` or ``"cnn"`` in a fresh process (Keras' default layer names:
    ``dense``, ``dense_1``, ...); None for ``module:function``, which only building tells.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    features = input_shape[-1] if input_shape else 1
    if model["name"] == "cnn":
        side = math.isqrt(math.prod(input_shape))
        for name, (inputs, filters) in (("conv2d", (1, 16)), ("conv2d_1", (16, 32))):
            shapes[f"{name}/kernel"], shapes[f"{name}/bias"] = (3, 3, inputs, filters), (filters,)
        features = math.ceil(side / 2) ** 2 * 32  # 2x2 max-pooling, "same" padding
    elif model["name"] != "mlp":
        return None
    for index, units in enumerate([*model["hidden"], num_classes]):
        name = "dense" if index == 0 else f"dense_{index}"
        shapes[f"{name}/kernel"], shapes[f"{name}/bias"] = (features, units), (units,)
        features = units
    return shapes


def check_layout_map(config: dict[str, Any], input_shape: tuple, num_classes: int,
                     source: str = "<config>") -> None:
    """Checks ``strategy.options.layout_map`` against the variables of a built-in model:
    the one layout of each variable, its rank, its axis names, and that its "model" axis
    (and "batch" axis, on a data x model mesh) divides by the replicas it is split over.

    Raises:
        ConfigError: naming ``source``, the variable, its shape and its layout.
    """
    options = config["strategy"]["options"]
    layout_map = options.get("layout_map")
    if "layout_map" not in registry.get(config["strategy"]["name"]).options or \
            not isinstance(layout_map, dict):
        return
    shapes = builtin_variables(config["model"], input_shape, num_classes)
    if shapes is None:
        return
    n = replica_count(config)
    m = options.get("model_parallel") or n
    d = n // m if n and m else None
    rules = [(key, tuple(a or None for a in axes)) for key, axes in layout_map.items()]
    for path, shape in shapes.items():
        try:
            axes = _layout_of(rules, path)
            if axes is not None:
                _check(path, shape, axes, m, d)
        except ValueError as error:
            raise ConfigError(f"{source}: strategy.options.layout_map: {error} (model.name "
                              f"= {config['model']['name']!r}, model.hidden = "
                              f"{config['model']['hidden']})") from None


def _layout_of(rules, path: str):
    """The layout the map gives ``path``: the key equal to it, else the one key that
    ``re.fullmatch``-es it (`TensorParallel.layout_of`)."""
    for key, axes in rules:
        if key == path:
            return axes
    found = [(key, axes) for key, axes in rules if re.fullmatch(key, path)]
    if len(found) > 1:
        raise ValueError(f"variable {path!r} matches more than one key. Received: keys="
                         f"{[key for key, _ in found]}")
    return found[0][1] if found else None


def _check(path: str, shape: tuple, axes: tuple, m: int | None, d: int | None) -> None:
    """`TensorParallel._checked` and `batch_axis.check_alone`, on a shape (every built-in
    variable is trainable); ``m``/``d``: the replicas of the "model"/"batch" axes, None
    when unknown (``cluster.mode = "env"``)."""
    if MODEL not in axes:
        if BATCH not in axes or not d or d == 1:
            return  # replicated (on d = 1 a "batch" entry means nothing)
        at = axes.index(BATCH)
        if len(axes) != len(shape) or axes.count(BATCH) > 1 or any(
                a not in (None, BATCH) for a in axes) or shape[at] % d:
            raise ValueError(
                f"variable {path!r} of shape {list(shape)} cannot be sharded on axis {at} "
                f"over the {d} replicas of the 'batch' axis (its layout must name 'batch' "
                f"once, on an axis that is a multiple of {d}, with one entry per axis). "
                f"Received: layout={list(axes)}")
        return
    if len(axes) != len(shape) or axes.count(MODEL) != 1 or any(
            a not in (None, MODEL, BATCH) for a in axes):
        raise ValueError(f"the layout of {path!r} must name 'model' once, other axes '' or "
                         f"'batch', and have one entry per axis of its shape {list(shape)}. "
                         f"Received: layout={list(axes)}")
    if BATCH in axes and d and d > 1:
        at = axes.index(BATCH)
        if axes.count(BATCH) > 1 or shape[at] % d:
            raise ValueError(
                f"variable {path!r} of shape {list(shape)} cannot be sharded on axis {at} "
                f"over the {d} replicas of the 'batch' axis (name 'batch' once, on an axis "
                f"that is a multiple of {d}). Received: layout={list(axes)}")
    axis = axes.index(MODEL)
    if m and shape[axis] % m:
        raise ValueError(f"variable {path!r} of shape {list(shape)} cannot be split on axis "
                         f"{axis} over {m} 'model' replicas ({shape[axis]} is not a multiple "
                         f"of {m}). Received: layout={list(axes)}")
