"""Checks of a tensor-parallel run (`tfdist.strategies.model_parallel`) that need its
model, data or job, each before anything runs:

- `warn_unknown_axes`, `warn_unmatched_keys`: a layout that does nothing (an axis name
  that is neither "model" nor "batch", a key that matches no variable path of the
  model) is warned about, naming it and the nearest name or path;
- `check_last_batch`: a partial last batch of arrays that cannot split evenly over the
  replicas is refused (a split layer's collectives exchange equal blocks of rows);
- `check_mesh_fits`: a ``keras.distribution.LayoutMap`` whose mesh holds more devices
  than a one-host strategy's replicas is refused.
"""

from __future__ import annotations

import difflib
import math
import warnings

AXES = ("model", "batch")


def _nearest(name: str, candidates) -> str:
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.0)
    return repr(found[0]) if found else "none"


def warn_unknown_axes(rules) -> None:
    """Warns for each layout (``[(key, axes)]``) naming an axis that is neither
    "model" nor "batch": no variable is split on it."""
    for key, axes in rules:
        for axis in axes:
            if axis is not None and axis not in AXES:
                warnings.warn(
                    f"layout_map[{key!r}] names the axis {axis!r}, which is neither "
                    f"'model' nor 'batch': nothing is split on it (nearest: "
                    f"{_nearest(axis, AXES)}). Received: layout={tuple(axes)}", stacklevel=4)


def warn_unmatched_keys(plan, model, warned: set) -> None:
    """Warns once per key of ``plan``'s layout map that no variable path of ``model``
    matches (Keras' rule: equal, else ``re.fullmatch``), naming the nearest path."""
    import re

    paths = [v.path for v in model.weights]
    for key, _ in plan.rules:
        if key in warned or not paths:
            continue
        try:
            hit = any(key == path or re.fullmatch(key, path) for path in paths)
        except re.error:
            continue  # an invalid pattern fails where it is used
        if not hit:
            warned.add(key)
            warnings.warn(
                f"layout_map key {key!r} matches no variable of model {model.name!r}: "
                f"nothing is laid out by it (nearest variable path: "
                f"{_nearest(key, paths)}). Received: key={key!r}", stacklevel=4)


def _rows(x):
    """The row count of arrays ``x`` (one array, or a list/tuple/dict of them), else
    None (a dataset, a generator: its batches are its own)."""
    import tensorflow as tf

    if x is None or isinstance(x, tf.data.Dataset):
        return None
    flat = tf.nest.flatten(x)
    shape = getattr(flat[0], "shape", None) if flat else None
    if shape is None or not len(shape) or shape[0] is None:
        return None
    return int(shape[0])


def _inputs(method: str, arguments: dict):
    """``[(argument name, rows, global batch size)]`` of the arrays a call batches."""
    from tfdist.strategies._fit import KERAS_DEFAULT_BATCH_SIZE

    batch = arguments.get("batch_size") or KERAS_DEFAULT_BATCH_SIZE
    x = arguments.get("x")
    if method != "fit":
        return [("x", _rows(x), batch)]
    # With steps_per_epoch, fit stops where it is told (its validation runs whole).
    rows = None if arguments.get("steps_per_epoch") else _rows(x)
    found = []
    validation = arguments.get("validation_data")
    split = arguments.get("validation_split") or 0.0
    if rows is not None and split and validation is None:
        train = int(math.floor(rows * (1.0 - split)))  # Keras' train_validation_split
        found.append(("validation_split", rows - train,
                      arguments.get("validation_batch_size") or batch))
        rows = train
    found.append(("x", rows, batch))  # rows None: nothing to check
    if isinstance(validation, (tuple, list)) and validation:
        found.append(("validation_data", _rows(validation[0]),
                      arguments.get("validation_batch_size") or batch))
    return found


def check_last_batch(method: str, arguments: dict, replicas: int) -> None:
    """Raises when the last batch of the arrays ``method`` batches is partial and does
    not split evenly over the ``replicas`` (TF would give some replicas more rows than
    others; a split layer's collectives exchange equal blocks). A partial batch that
    does split trains as one device does."""
    for name, rows, batch in _inputs(method, arguments):
        if rows is None or batch is None:
            continue
        last = rows % batch
        if last % replicas:
            raise ValueError(
                f"The last batch of {name} ({last} rows) must split evenly over the "
                f"{replicas} replicas of a tensor-parallel strategy: give a row count whose "
                f"last batch is a multiple of {replicas}, or a tf.data.Dataset batched with "
                f"drop_remainder=True. Received: {rows} rows, batch_size={batch}")


def check_mesh_fits(layout_map, replicas: int) -> None:
    """Raises when ``layout_map`` (a ``keras.distribution.LayoutMap``) lays variables
    out over a mesh of more devices than the strategy's ``replicas``: one host's
    strategy would train unsplit, each worker alone."""
    mesh = getattr(layout_map, "device_mesh", None)
    shape = tuple(getattr(mesh, "shape", ()) or ())
    if shape and math.prod(shape) > replicas:
        raise ValueError(
            f"ModelParallelStrategy splits over this process's {replicas} replica(s), but "
            f"the layout map's mesh has {math.prod(shape)} devices: across workers use "
            f"MultiWorkerModelParallelStrategy. Received: DeviceMesh({shape}), "
            f"{replicas} replica(s)")
