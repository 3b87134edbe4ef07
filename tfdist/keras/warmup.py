"""Linear learning-rate scaling with warm-up (Goyal et al., 2017), as a Keras callback."""

from __future__ import annotations

import keras


def warmup_learning_rate(step: int, base_lr: float, scale: float, warmup_steps: int) -> float:
    """The learning rate at ``step`` (0-based): linear from ``base_lr`` to
    ``base_lr * scale`` over ``warmup_steps`` steps, then constant."""
    if warmup_steps <= 0:
        return base_lr * scale
    progress = min(step, warmup_steps) / warmup_steps
    return base_lr * (1.0 + (scale - 1.0) * progress)


class LinearScalingWarmup(keras.callbacks.Callback):
    """Grows the learning rate from ``base_lr`` to ``base_lr * num_workers``.

    The rate is set before every training batch by `warmup_learning_rate`, counting
    batches across epochs, so after ``warmup_epochs`` it stays at the scaled value.

    Args:
        base_lr: Learning rate for a single worker's batch.
        num_workers: The scale factor; default: the strategy's replicas in sync.
        warmup_epochs: Length of the ramp, in epochs (may be fractional).
        steps_per_epoch: Batches per epoch; default: what `fit` reports.
        verbose: 1 prints the rate at the end of each epoch.
    """

    def __init__(self, base_lr: float, num_workers: int | None = None,
                 warmup_epochs: float = 5, steps_per_epoch: int | None = None,
                 verbose: int = 0):
        super().__init__()
        if not base_lr > 0:
            raise ValueError(f"base_lr must be > 0. Received: base_lr={base_lr!r}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1. Received: num_workers={num_workers!r}")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0. Received: "
                             f"warmup_epochs={warmup_epochs!r}")
        self.base_lr = float(base_lr)
        self.num_workers = num_workers
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._step = 0

    def on_train_begin(self, logs=None):
        if self.num_workers is None:
            import tensorflow as tf

            self.num_workers = tf.distribute.get_strategy().num_replicas_in_sync
            if self.model.distribute_strategy is not None:
                self.num_workers = self.model.distribute_strategy.num_replicas_in_sync
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError("LinearScalingWarmup needs steps_per_epoch: pass it, or give "
                             "fit data of known length")
        self._warmup_steps = int(round(self.warmup_epochs * steps))
        self._step = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate.assign(warmup_learning_rate(
            self._step, self.base_lr, self.num_workers, self._warmup_steps))
        self._step += 1

    def on_epoch_end(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if logs is not None:
            logs["learning_rate"] = lr
        if self.verbose:
            print(f"LinearScalingWarmup: epoch {epoch + 1}: learning rate {lr:.6g}")
