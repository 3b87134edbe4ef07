"""Small models and data shared by the tests."""

import numpy as np


def regression_data(n=64, features=5, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=(n, outputs))).astype("float32")
    return x, y


def classification_data(n=64, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (np.argmax(x[:, :classes], axis=1)).astype("int32")
    return x, y


def mlp(features=8, classes=3, batchnorm=False, seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((features,)), keras.layers.Dense(16, activation="relu")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(synchronized=True))
    layers.append(keras.layers.Dense(classes))
    return keras.Sequential(layers)


def assert_weights_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=f"weight {i}")


TESTS_DIR = __import__("os").path.dirname(__import__("os").path.abspath(__file__))


def run_cluster(fn, *args, workers=2, chief=False, ps=0, timeout=180, env=None, **kwargs):
    """Runs ``fn(*args, **kwargs)`` in every task of a local cluster via `tfdist.launch`.

    Returns the list of return values in task order (chief, workers, ps). The test
    modules are importable in the tasks (``tests/`` is put on PYTHONPATH).
    """
    import os

    import tfdist

    task_env = {"PYTHONPATH": os.pathsep.join(
        [TESTS_DIR, os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    task_env.update(env or {})
    return tfdist.launch(fn, *args, workers=workers, chief=chief, ps=ps, timeout=timeout,
                         env=task_env, **kwargs)
