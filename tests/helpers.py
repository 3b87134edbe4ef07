"""Small models and data, and the cluster and horovodrun runners, shared by the tests."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
if ROOT not in sys.path:  # the benchmarks package of the checkout (not in the wheel)
    sys.path.append(ROOT)

from benchmarks.horovodrun import run_horovod  # noqa: E402,F401  (re-exported)


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


def layout_map(entries, shape=None):
    """A ``keras.distribution.LayoutMap`` of ``entries`` (``(key, axes)`` pairs, set in
    order) on a ``("batch", "model")`` mesh of ``shape`` over every device (default:
    every device on "batch")."""
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(shape or (len(devices), 1), ["batch", "model"],
                                         devices)
    layouts = keras.distribution.LayoutMap(mesh)
    for key, axes in entries:
        layouts[key] = axes
    return layouts


def assert_weights_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=f"weight {i}")


def run_cluster(fn, *args, workers=2, chief=False, ps=0, timeout=180, env=None, **kwargs):
    """Runs ``fn(*args, **kwargs)`` in every task of a local cluster via `tfdist.launch`.

    Returns the list of return values in task order (chief, workers, ps). The test
    modules are importable in the tasks (``tests/`` is put on PYTHONPATH).
    """
    import tfdist

    task_env = {"PYTHONPATH": os.pathsep.join(
        [TESTS_DIR, ROOT, os.environ.get("PYTHONPATH", "")])}
    task_env.update(env or {})
    return tfdist.launch(fn, *args, workers=workers, chief=chief, ps=ps, timeout=timeout,
                         env=task_env, **kwargs)


# A task writes ``<task>.pid`` files into its result directory and runs with
# RESULT_DIR_MARK=<that directory> in its environment (``run_cluster(env=...)``).
RESULT_DIR_MARK = "TFDIST_TEST_RESULT_DIR"


def assert_no_leftover_processes(result_dir):
    """Every task process recorded in ``result_dir`` has exited (kills leftovers).

    A pid counts only if its environment carries ``RESULT_DIR_MARK=result_dir``: pids
    are reused quickly on a busy machine, and other people's processes must never be
    signalled.

    Raises:
        AssertionError: naming the ``.pid`` files of the processes still running.
    """
    mark = f"{RESULT_DIR_MARK}={result_dir}".encode() + b"\0"
    leftovers = []
    for name in os.listdir(result_dir):
        if not name.endswith(".pid"):
            continue
        pid = int(open(os.path.join(result_dir, name)).read())
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if mark in environ:
            leftovers.append(name)
            for signum in (signal.SIGCONT, signal.SIGKILL):  # SIGKILL ends a stopped one too
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
    assert not leftovers, f"processes left behind: {leftovers}"


def require_horovod():
    """Skips the calling test without Horovod, or fails it when the suite requires Horovod
    (``TFDIST_REQUIRE_HOROVOD=1``, set by ``make test``)."""
    import os

    import pytest

    from tfdist.engines.horovod import ops as comm

    if comm.is_available():
        return
    if os.environ.get("TFDIST_REQUIRE_HOROVOD") == "1":
        pytest.fail("TFDIST_REQUIRE_HOROVOD=1 but Horovod is not installed. "
                    + comm.INSTALL_HINT, pytrace=False)
    pytest.skip(comm.INSTALL_HINT)


def kill_worker_1(epochs_run: list, signum=signal.SIGKILL):
    """A Keras callback for a launched task: appends each epoch it begins to
    ``epochs_run``, and SIGKILLs worker-1 (or sends it ``signum``: SIGSTOP freezes it)
    after batch 1 of epoch 1 of the job's first start (restart 0), so that a restart
    must resume mid-run."""
    import keras

    from tfdist import env

    me, restart = os.environ[env.TASK], int(os.environ[env.RESTART])

    class KillWorker1(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)
            self._epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if restart == 0 and me == "worker-1" and self._epoch == 1 and batch == 1:
                os.kill(os.getpid(), signum)

    return KillWorker1()


def exit_without_a_last_collection() -> None:
    """Leaves the objects alive now to the process's end (a test job script's last call).

    The interpreter's last garbage collection walks every object TensorFlow made: seconds
    on a busy machine, while the launcher waits for the task to exit. Frozen objects are
    not walked; streams are still flushed and ``atexit`` handlers (Horovod's shutdown)
    still run. tfdist's own launched tasks keep the collection (see
    `tfdist.runners.task_main`).
    """
    import gc

    gc.freeze()


def serve_ps_from_a_child(pid_path) -> None:
    """In a ps task: serves from a child process (whose pid goes to ``pid_path``, for the
    test to kill), then stays up until the chief's port closes, like a failed pod's slot.
    The launcher sees no failure of its own ps task."""
    import time

    import tfdist
    from tfdist.strategies.parameter_server import _is_listening

    child = subprocess.Popen(
        [sys.executable, "-c", "import tfdist; tfdist.ParameterServerStrategy()"])
    with open(pid_path, "w") as f:
        f.write(str(child.pid))
    child.wait()
    chief = tfdist.ClusterSpec.from_env().chief[0]
    while _is_listening(chief):
        time.sleep(0.5)


@contextlib.contextmanager
def tcp_listener(respond):
    """A TCP server on loopback that is not a tfdist rendezvous; yields its port.

    ``respond(conn)`` runs for each connection it accepts; the connection stays open
    (and silent) after it until the block ends.
    """
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    conns, done = [], threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conns.append(conn)
            respond(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        for conn in conns:
            conn.close()
        server.close()


def run_job_script(directory, script: str):
    """Runs ``tests/<script>`` in a fresh process (its own TF start-up: logical CPUs)
    with ``RESULTS DIRECTORY`` as arguments; the results it pickled."""
    import pickle

    out = os.path.join(str(directory), "results.pkl")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [TESTS_DIR, ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, os.path.join(TESTS_DIR, script), out, str(directory)],
                   env=env, check=True, timeout=600)
    with open(out, "rb") as f:
        return pickle.load(f)
