"""A NaN loss stops training with a clear error (in-process; multi-worker in test_faults)."""

import numpy as np
import pytest


def test_nan_loss_raises_a_clear_error():
    import keras

    from tfdist.keras.guards import StopOnNaN

    x = np.ones((32, 2), "float32")
    y = np.ones((32, 1), "float32")
    y[20] = np.nan
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(FloatingPointError, match=r"loss became nan at epoch 1, step 3"):
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[StopOnNaN()], shuffle=False, verbose=0)
