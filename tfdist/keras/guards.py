"""Callbacks that keep a distributed job consistent when training goes wrong."""

from __future__ import annotations

import math
import os

import keras

from tfdist import env


class StopOnNaN(keras.callbacks.Callback):
    """Stops training with `FloatingPointError` when the loss is NaN or infinite, or at
    an epoch's end when a weight is (a step can break the weights with a finite loss).

    In the synchronous modes the logged loss is already reduced across workers, so every
    worker sees the same value at the same step and stops together: none is left waiting
    in a collective. The message names the epoch, the step and the task.
    """

    def __init__(self):
        super().__init__()
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        from tfdist._hooks.saves import non_finite_weights

        bad = non_finite_weights(self.model)
        if bad:
            task = os.environ.get(env.TASK, "this process")
            raise FloatingPointError(
                f"weights {bad[:5]} became NaN or infinite in epoch {epoch + 1} on {task} "
                "(the loss was finite); training stopped. Lower the learning rate or check "
                "the data.")

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            task = os.environ.get(env.TASK, "this process")
            raise FloatingPointError(
                f"loss became {float(loss)} at epoch {self._epoch + 1}, step {batch + 1} on "
                f"{task}; training stopped on every worker. Lower the learning rate or check "
                "the data.")
