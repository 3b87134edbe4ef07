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
    in a collective. Under `tfdist.ModelAverageStrategy` each worker logs its own loss,
    so a worker that sees a NaN goes on to the next average, which spreads the NaN into
    every worker's weights; every worker then stops after that average, on the averaged
    weights, which they hold equal. The message names the epoch, the step and the task.
    """

    def __init__(self):
        super().__init__()
        self._epoch = 0
        self._local_nan = None  # (epoch, step, loss) of this worker's first NaN loss

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        from tfdist._hooks.saves import non_finite_weights

        if self._agreed_variables() is not None:
            return  # local steps: the weights are checked after each average
        bad = non_finite_weights(self.model)
        if bad:
            raise FloatingPointError(
                f"weights {bad[:5]} became NaN or infinite in epoch {epoch + 1} on "
                f"{_task()} (the loss was finite); training stopped. Lower the learning "
                "rate or check the data.")

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        finite = loss is None or math.isfinite(float(loss))
        agreed = self._agreed_variables()
        if agreed is None:
            if not finite:
                raise FloatingPointError(
                    f"loss became {float(loss)} at epoch {self._epoch + 1}, step {batch + 1} "
                    f"on {_task()}; training stopped on every worker. Lower the learning "
                    "rate or check the data.")
            return
        if not finite and self._local_nan is None:
            self._local_nan = (self._epoch + 1, batch + 1, float(loss))
        if agreed:
            self._check_average(agreed, batch)

    def _check_average(self, agreed, batch):
        """After an average: stop on every worker if the averaged weights are not finite."""
        from tfdist._hooks.saves import non_finite_weights

        local_nan, self._local_nan = self._local_nan, None
        bad = non_finite_weights(self.model, agreed)
        if not bad:
            return
        where = f"epoch {self._epoch + 1}, step {batch + 1}"
        if local_nan is not None:
            epoch, step, loss = local_nan
            cause = f"loss became {loss} at epoch {epoch}, step {step} on {_task()}"
        else:
            cause = f"weights {bad[:5]} became NaN or infinite on {_task()}"
        raise FloatingPointError(
            f"{cause}; training stopped on every worker after the average at {where}, "
            "whose weights are not finite. Lower the learning rate or check the data.")

    def _agreed_variables(self):
        from tfdist.keras.handoff import handoff_of

        strategy = getattr(self.model, "distribute_strategy", None)
        hand = handoff_of(strategy)
        return None if hand is None else hand.keras_agreed_variables(self.model)


def _task() -> str:
    return os.environ.get(env.TASK, "this process")
