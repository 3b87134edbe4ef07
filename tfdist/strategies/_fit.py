"""What every data-parallel tfdist strategy does around Keras ``fit``.

- The global batch must split evenly over the replicas, in ``fit`` (training and
  validation data) and ``evaluate``: Keras' step averages each replica's mean loss, so
  an uneven split would not equal one device with that batch (stock TF fails in the
  first training or evaluation step with "AddN must have the same size"). The error
  comes before any step and names both numbers. ``predict`` splits any batch.
- On a worker that is not the chief, Keras' own file callbacks write to a temporary
  directory (see `tfdist._hooks.saves.keras_callbacks_write_elsewhere`).
- Saves (``model.save``/``save_weights``, so every checkpoint callback) are atomic and
  refuse weights with NaN or infinity (see `tfdist._hooks.saves.save_safely`).
- A ``LossScaleOptimizer`` applies or skips a step on every replica together.
"""

from __future__ import annotations

import contextlib

from tfdist._hooks.saves import keras_callbacks_write_elsewhere
from tfdist._hooks.tf import dataset_batch_size
from tfdist.keras.handoff import KerasHandoff

# Keras fit's batch size for arrays when none is given.
KERAS_DEFAULT_BATCH_SIZE = 32


def global_batch_size(x, batch_size: int | None = None) -> int | None:
    """The global batch size Keras feeds ``x`` with, or None if it cannot be known.

    Args:
        x: A `tf.data.Dataset` (batched by its maker), arrays (batched by Keras) or
            another source.
        batch_size: The ``batch_size`` given to Keras with ``x``, if any.
    """
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        return dataset_batch_size(x)
    if hasattr(x, "shape") or isinstance(x, (list, tuple, dict)):  # arrays, batched by Keras
        return batch_size or KERAS_DEFAULT_BATCH_SIZE
    return None  # a generator, a PyDataset or another source that batches itself


def global_batch_sizes(method: str, arguments: dict) -> dict:
    """``{argument name: global batch size}`` of each input a ``fit``/``evaluate`` batches.

    Validation data is batched by its own ``Dataset``, else by ``validation_batch_size``
    or ``batch_size`` (as Keras does). Sizes that cannot be known are None.
    """
    batch_size = arguments.get("batch_size")
    if method == "evaluate":
        if arguments.get("kwargs", {}).get("_use_cached_eval_dataset"):
            return {}  # fit's own validation, which fit checked
        return {"batch_size": global_batch_size(arguments.get("x"), batch_size)}
    if method != "fit":
        return {}  # predict splits any batch
    sizes = {"batch_size": global_batch_size(arguments.get("x"), batch_size)}
    validation = arguments.get("validation_data")
    if validation is not None:
        x = validation[0] if isinstance(validation, (tuple, list)) else validation
        sizes["validation_batch_size"] = global_batch_size(
            x, arguments.get("validation_batch_size") or batch_size)
    elif arguments.get("validation_batch_size"):  # with validation_split
        sizes["validation_batch_size"] = arguments["validation_batch_size"]
    return sizes


def check_global_batch(batch_size: int | None, replicas: int, name: str = "batch_size"):
    """Raises if ``batch_size`` does not split evenly over ``replicas``."""
    if batch_size is not None and batch_size % replicas:
        raise ValueError(
            f"the global batch size must be a multiple of the number of replicas, so that "
            f"every replica gets an equal share. Received: {name}={batch_size} for "
            f"{replicas} replicas; use e.g. {name}={batch_size // replicas * replicas or replicas}.")


class KerasFitMixin(KerasHandoff):
    """Mixed into a strategy class: its Keras hand-off around ``fit`` and saves."""

    keras_safe_saves = True
    keras_global_finite_check = True

    def keras_check_call(self, model, method, arguments):
        del model
        for name, batch_size in global_batch_sizes(method, arguments).items():
            check_global_batch(batch_size, self.num_replicas_in_sync, name)

    def keras_fit_context(self, model, arguments):
        del model
        if self.extended.should_checkpoint:
            return contextlib.nullcontext()
        return keras_callbacks_write_elsewhere(
            arguments.get("callbacks"), getattr(self, "task_name", "worker"))
