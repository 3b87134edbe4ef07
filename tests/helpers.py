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


_HOROVOD_TASK = """
import importlib, os, pickle, sys
module, name, args_path, out_dir = sys.argv[1:5]
with open(args_path, "rb") as f:
    args = pickle.load(f)
result = getattr(importlib.import_module(module), name)(*args)
from tfdist.comm import horovod as comm
with open(os.path.join(out_dir, f"rank{comm.rank()}.pkl"), "wb") as f:
    pickle.dump(result, f)
"""


def run_horovod(fn, *args, np=2, timeout=150, env=None):
    """Runs module-level ``fn(*args)`` of a test module under ``horovodrun --gloo``.

    ``np`` processes on localhost; each returns a picklable value. The whole
    ``horovodrun`` process group is killed after ``timeout`` seconds.

    Returns:
        The return values, by rank.

    Raises:
        AssertionError: horovodrun failed or timed out (with the output's tail).
    """
    import os
    import pickle
    import signal
    import subprocess
    import sys
    import tempfile

    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory(prefix="tfdist-hvd-") as tmp:
        args_path = os.path.join(tmp, "args.pkl")
        with open(args_path, "wb") as f:
            pickle.dump(args, f)
        cmd = [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
               "--start-timeout", "60", sys.executable, "-c", _HOROVOD_TASK,
               fn.__module__, fn.__name__, args_path, tmp]
        task_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
            [TESTS_DIR, os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
        task_env.update(env or {})
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=task_env, start_new_session=True, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(f"horovodrun timed out after {timeout}s: {fn.__name__}\n"
                                 + output[-4000:]) from None
        if proc.returncode != 0:
            raise AssertionError(f"horovodrun exited with {proc.returncode}: "
                                 f"{fn.__name__}\n" + output[-4000:])
        results = []
        for rank in range(np):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
