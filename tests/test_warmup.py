"""The LR warm-up callback follows Goyal et al.'s linear formula at every step."""

import numpy as np
import pytest

from tfdist.keras.warmup import LinearScalingWarmup, warmup_learning_rate


def test_formula():
    assert warmup_learning_rate(0, 0.1, 4, 10) == pytest.approx(0.1)
    assert warmup_learning_rate(5, 0.1, 4, 10) == pytest.approx(0.25)
    assert warmup_learning_rate(10, 0.1, 4, 10) == pytest.approx(0.4)
    assert warmup_learning_rate(99, 0.1, 4, 10) == pytest.approx(0.4)
    assert warmup_learning_rate(3, 0.1, 4, 0) == pytest.approx(0.4)


def test_learning_rate_at_each_step_follows_the_formula():
    import keras

    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    x = np.random.default_rng(0).normal(size=(40, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    warmup = LinearScalingWarmup(0.01, num_workers=4, warmup_epochs=1.5)
    history = model.fit(x, y, batch_size=10, epochs=3, callbacks=[warmup, Record()], verbose=0)
    expected = [0.01 * (1 + 3 * min(s, 6) / 6) for s in range(12)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    np.testing.assert_allclose(history.history["learning_rate"], [expected[3], expected[7], expected[11]], rtol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="base_lr must be > 0. Received: base_lr=0"):
        LinearScalingWarmup(0)
    with pytest.raises(ValueError, match="num_workers"):
        LinearScalingWarmup(0.1, num_workers=0)
