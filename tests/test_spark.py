"""tfdist.spark.run on a real local Spark (``local[2]``, barrier mode); no mocks.

One SparkSession serves the module. Each check runs 2 workers and compares them with
the same references as ``tfdist launch``: tfdist.MultiWorkerMirroredStrategy with the
single-process run (twice in the same session: engine "auto", then TF's own), and
``engine="horovod"``, and ModelAverageStrategy(period=4) with local SGD in numpy. A task that raises, is SIGKILLed, or whose Python worker is
SIGKILLed fails the run naming it, and leaves no process behind.
"""

import contextlib
import os
import re
import subprocess
import sys

import pytest

from spark_ray_jobs import (MARK, check_mwms, check_model_average, fault_job, import_engine,
                            mwms_job, mwms_reference, wait_gone)
from test_model_average import _worker_fit

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def spark():
    """One local[2] SparkSession on loopback for the module, stopped at its end."""
    import_engine("pyspark")
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this venv
    session = (SparkSession.builder.master("local[2]").appName("tfdist-tests")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    # stop() leaves the JVM running for a next session; end it (it exits on stdin EOF).
    gateway, SparkContext._gateway, SparkContext._jvm = SparkContext._gateway, None, None
    if gateway is not None:
        with contextlib.suppress(Exception):
            gateway.shutdown()
            gateway.proc.stdin.close()
            gateway.proc.wait(60)


@pytest.fixture(scope="module")
def reference(logical_cpus):
    return mwms_reference()


@pytest.mark.timeout(600)
def test_multi_worker_mirrored_equals_reference_twice_in_one_session(spark, reference):
    import tfdist

    first = tfdist.spark.run(mwms_job, workers=2, timeout=240)
    check_mwms(first, reference)
    # engine="auto" picks Horovod where it is installed (make test): the second run
    # takes TF's own collectives, so both engines run inside a barrier stage.
    second = tfdist.spark.run(mwms_job, workers=2, spark=spark, timeout=240,
                              env={"TFDIST_ENGINE": "tf"})
    check_mwms(second, reference)
    # each run's function ran in fresh processes
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}


@pytest.mark.timeout(400)
def test_model_average_period_4_matches_numpy(spark):
    import tfdist

    check_model_average(tfdist.spark.run(_worker_fit, 4, "linear", workers=2, timeout=240))


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_horovod_engine(spark):
    """MultiWorkerMirroredStrategy(engine="horovod") brings Gloo up from the TF_CONFIG of
    a barrier stage: equal to one process, and ModelAverageStrategy to numpy."""
    import tfdist
    from helpers import require_horovod

    require_horovod()
    from test_engines import _check, engine_task

    _check(tfdist.spark.run(engine_task, 0, False, workers=2, timeout=280), full=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, expected", [
    ("raise", "worker-1 exited with code 1"),
    ("kill", "worker-1 exited with code -9 (signal SIGKILL)"),
    ("kill-engine", "worker-1 failed"),
])
def test_failed_task_is_named_and_nothing_is_left(spark, tmp_path, mode, expected):
    import tfdist

    with pytest.raises(tfdist.LaunchError, match="^" + re.escape(expected)) as caught:
        tfdist.spark.run(fault_job, str(tmp_path), mode, "worker-1", workers=2,
                         timeout=240, env={MARK: str(tmp_path)})
    assert caught.value.task == "worker-1"
    if mode == "raise":
        assert "RuntimeError: injected failure in worker-1" in caught.value.output_tail
    assert sorted(os.listdir(tmp_path)) == ["worker-0.pid", "worker-1.pid"]
    wait_gone(tmp_path)


@pytest.mark.timeout(400)
def test_large_results_fail_that_run_and_leave_the_session_usable(spark):
    """Two tasks returning 200 MB each used to run Spark's JVM out of heap for good."""
    import tfdist

    with pytest.raises(tfdist.LaunchError, match=r"^worker-[01] returned 190\.7 MiB "
                       r"\(pickled\), more than tfdist.spark.run's limit of 64\.0 MiB "
                       r"per task \(128\.0 MiB per run over 2 tasks\)") as caught:
        tfdist.spark.run(lambda n: b"\0" * n, 200_000_000, workers=2, timeout=240)
    assert caught.value.task in ("worker-0", "worker-1")
    size = tfdist.spark.MAX_RESULT_BYTES // 2 - 1000  # just within the limit
    assert tfdist.spark.run(lambda n: len(b"\0" * n), size, workers=2) == [size, size]
    assert [len(r) for r in tfdist.spark.run(lambda n: b"\0" * n, size, workers=2)] == \
        [size, size]


def test_cuda_visible_devices_from_spark_resources():
    from tfdist.spark import cuda_visible_devices

    assert cuda_visible_devices({}, None) is None
    assert cuda_visible_devices({"gpu": ["2", "3"]}, None) == "2,3"
    assert cuda_visible_devices({"gpu": ["2", "3"]}, 1) == "2"
    assert cuda_visible_devices({"gpu": ["2"]}, 0) == ""
    with pytest.raises(ValueError, match=r"gpus_per_task=2, but Spark assigned this task 1"):
        cuda_visible_devices({"gpu": ["2"]}, 2)


def test_argument_errors(spark):
    import tfdist

    with pytest.raises(ValueError, match="workers must be an integer >= 1. Received: workers=0"):
        tfdist.spark.run(print, workers=0)
    with pytest.raises(ValueError, match="Received: gpus_per_task=-1"):
        tfdist.spark.run(print, workers=1, gpus_per_task=-1)
    with pytest.raises(ValueError, match="spark.task.resource.gpu.amount >= 1"):
        tfdist.spark.run(print, workers=1, gpus_per_task=1)
    with pytest.raises(TypeError, match="fn must be callable. Received: 3"):
        tfdist.spark.run(3, workers=1)


def test_import_tfdist_loads_neither_spark_nor_ray():
    code = ("import sys, tfdist; tfdist.spark; tfdist.ray; "
            "print(sorted(m for m in ('pyspark', 'ray', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


# A user's own session whose executors run another Python (as from a Jupyter kernel).
OTHER_PYTHON_JOB = """
import os, sys
from pyspark.sql import SparkSession
import tfdist

marker = sys.argv[2]

def train():
    open(marker, "w").close()  # a task started
    return 1

os.environ["PYSPARK_PYTHON"] = sys.argv[1]  # what the executors run
session = (SparkSession.builder.master("local[2]")
           .config("spark.driver.host", "127.0.0.1")
           .config("spark.driver.bindAddress", "127.0.0.1")
           .config("spark.ui.enabled", "false").getOrCreate())
session.sparkContext.setLogLevel("OFF")
try:
    print("RESULT", tfdist.spark.run(train, workers=2))
except RuntimeError as error:
    print("ERROR", error)
finally:
    session.stop()
"""


@pytest.mark.timeout(300)
def test_executors_on_a_python_without_tfdist_fail_before_any_task(tmp_path):
    python = "/usr/bin/python3"
    probe = subprocess.run([python, "-c", "import cloudpickle"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{python} has cloudpickle: not a Python without tfdist's needs")
    import_engine("pyspark")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON") and "proxy" not in k.lower()}
    marker = tmp_path / "task-started"
    job = subprocess.run([sys.executable, "-c", OTHER_PYTHON_JOB, python, str(marker)],
                         capture_output=True, text=True, env=env, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    error = next((line for line in job.stdout.splitlines() if line.startswith("ERROR")), None)
    assert error is not None, job.stdout + job.stderr[-3000:]
    for needle in (f"Spark's executors run Python {python}", "which lacks cloudpickle",
                   f"this driver runs {sys.executable}", f"PYSPARK_PYTHON={sys.executable}",
                   "spark.pyspark.python"):
        assert needle in error, error
    assert not marker.exists()  # the check came before any of the job's tasks
