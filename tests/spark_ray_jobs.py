"""What tests/test_spark.py and tests/test_ray.py run on their engines, and their checks.

The jobs reuse the multi-worker and model-average tests' own training code, so the
engines are held to the same references as ``tfdist launch``.
"""

import importlib
import os
import signal
import time

import pytest

from helpers import (RESULT_DIR_MARK as MARK, assert_no_leftover_processes,
                     assert_weights_close, classification_data)
from test_model_average import linear_data, numpy_local_sgd
from test_multi_worker import _fit


def import_engine(name: str):
    """Imports ``name`` (pyspark, ray); skips when it is missing, unless
    TFDIST_REQUIRE_SPARK_RAY=1 (set by ``make test``), which fails instead."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        message = (f"{name} is not installed ({error}): "
                   f"pip install -e '.[spark,ray]' (make test does)")
        if os.environ.get("TFDIST_REQUIRE_SPARK_RAY") == "1":
            pytest.fail(f"TFDIST_REQUIRE_SPARK_RAY=1 but {message}", pytrace=False)
        pytest.skip(message)


# ---- jobs, run in every task -------------------------------------------------------------

def mwms_job():
    """2 workers, tfdist.MultiWorkerMirroredStrategy, the test MLP for 2 epochs."""
    import json

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(startup_timeout=60, collective_timeout=120)
    x, y = classification_data(n=64)
    out = _fit(strategy, x, y, "sgd", use_dataset=False)
    return {"weights": out["weights"], "replicas": strategy.num_replicas_in_sync,
            "task": json.loads(os.environ["TF_CONFIG"])["task"], "pid": os.getpid()}


def mwms_reference():
    """The same training in this process, on one device (no strategy)."""
    x, y = classification_data(n=64)
    return _fit(None, x, y, "sgd", use_dataset=False)["weights"]


def fault_job(result_dir, mode, victim, workers=2):
    """Records this task's pid; the victim fails by ``mode``, the others wait to be killed.

    Modes: "raise" (an exception), "kill" (SIGKILL to itself), "kill-engine" (SIGKILL to
    the engine's process that started it: a Spark Python worker, a Ray actor).
    """
    task = os.environ["TFDIST_TASK"]
    with open(os.path.join(result_dir, f"{task}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if task == victim:
        # Let the others record their pids: a loaded machine starts them seconds apart.
        deadline = time.monotonic() + 120
        while len(os.listdir(result_dir)) < workers and time.monotonic() < deadline:
            time.sleep(0.1)
        if mode == "raise":
            raise RuntimeError(f"injected failure in {task}")
        os.kill(os.getpid() if mode == "kill" else os.getppid(), signal.SIGKILL)
    time.sleep(300)


# ---- checks --------------------------------------------------------------------------------

def check_mwms(results, reference):
    """Both workers hold the same weights, equal to the single-process reference."""
    assert [r["task"] for r in results] == [{"type": "worker", "index": i} for i in (0, 1)]
    for result in results:
        assert result["replicas"] == 2
        assert_weights_close(result["weights"], reference, atol=1e-5)
    assert_weights_close(results[0]["weights"], results[1]["weights"], atol=0)


def check_model_average(results):
    """ModelAverageStrategy(period=4) on 2 workers equals local SGD done in numpy."""
    x, y = linear_data(n=80)
    initial = results[0]["initial"]
    ref = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=4)
    for result in results:
        assert result["replicas"] and len(result["weights"]) == 2
        assert_weights_close(result["weights"], ref, atol=1e-5)
    for other in results[1:]:
        assert_weights_close(results[0]["replicas"], other["replicas"], atol=0)


def wait_gone(result_dir, seconds=60.0):
    """Waits for the marked task processes recorded in ``result_dir`` to exit, then
    asserts none is left (killing any that is)."""
    mark = f"{MARK}={result_dir}".encode() + b"\0"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = False
        for name in os.listdir(result_dir):
            if name.endswith(".pid"):
                pid = open(os.path.join(result_dir, name)).read()
                try:
                    alive |= mark in open(f"/proc/{pid}/environ", "rb").read()
                except OSError:
                    pass
        if not alive:
            break
        time.sleep(0.5)
    assert_no_leftover_processes(result_dir)
