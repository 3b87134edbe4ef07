"""What every data-parallel tfdist strategy does around Keras ``fit``.

- The global batch must split evenly over the replicas: Keras' step averages each
  replica's mean loss, so an uneven split would not equal one device with that batch
  (stock TF fails in the first step with "AddN must have the same size"). The error
  comes before any step and names both numbers.
- On a worker that is not the chief, Keras' own file callbacks write to a temporary
  directory (see `tfdist._hooks.keras_callbacks_write_elsewhere`).
- Saves (``model.save``/``save_weights``, so every checkpoint callback) are atomic and
  refuse weights with NaN or infinity (see `tfdist._hooks._save_safely`).
- A ``LossScaleOptimizer`` applies or skips a step on every replica together.
"""

from __future__ import annotations

import contextlib

from tfdist import _hooks

# Keras fit's batch size for arrays when none is given.
KERAS_DEFAULT_BATCH_SIZE = 32


def global_batch_size(arguments: dict) -> int | None:
    """The global batch size of a ``fit`` call, or None if it cannot be known."""
    import tensorflow as tf

    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        return _hooks.dataset_batch_size(x)
    if hasattr(x, "shape") or isinstance(x, (list, tuple, dict)):  # arrays, batched by fit
        return arguments.get("batch_size") or KERAS_DEFAULT_BATCH_SIZE
    return None  # a generator, a PyDataset or another source that batches itself


def check_global_batch(batch_size: int | None, replicas: int, name: str = "batch_size"):
    """Raises if ``batch_size`` does not split evenly over ``replicas``."""
    if batch_size is not None and batch_size % replicas:
        raise ValueError(
            f"the global batch size must be a multiple of the number of replicas, so that "
            f"every replica gets an equal share. Received: {name}={batch_size} for "
            f"{replicas} replicas; use e.g. {name}={batch_size // replicas * replicas or replicas}.")


def models_differ(variable: str | None, where: str, said: str) -> ValueError:
    """The error for workers that built different models (either engine).

    Args:
        variable: The variable's name.
        where: ``": its shape is [3,4] on worker-0 and [3,3] on another worker"``, or "".
        said: The engine's own message.
    """
    return ValueError(
        f"the workers built different models: variable {variable!r} does not match "
        f"between workers{where}. Every worker must create the same variables, with the "
        f"same shapes, in the same order, in strategy.scope(). The engine said: "
        f"{said.strip().splitlines()[0]}")


class KerasFitMixin(_hooks.KerasHandoff):
    """Mixed into a strategy class: its Keras hand-off around ``fit`` and saves."""

    keras_safe_saves = True
    keras_global_finite_check = True

    def keras_fit_context(self, model, arguments):
        del model
        replicas = self.num_replicas_in_sync
        check_global_batch(global_batch_size(arguments), replicas)
        if arguments.get("validation_batch_size"):
            check_global_batch(arguments["validation_batch_size"], replicas,
                               "validation_batch_size")
        if self.extended.should_checkpoint:
            return contextlib.nullcontext()
        return _hooks.keras_callbacks_write_elsewhere(
            arguments.get("callbacks"), getattr(self, "task_name", "worker"))
