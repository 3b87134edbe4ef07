"""Runs a function as a tfdist job in a Spark barrier stage: ``tfdist.spark.run``.

Each of the stage's N tasks is one TensorFlow worker. The tasks meet through the
barrier context: each reserves a free port on its executor, and ``allGather`` hands
every task every ``host:port``, from which it builds its TF_CONFIG. The function runs
in a fresh child process per task (`tfdist.runners.remote_task`), so any tfdist
strategy works inside, and ``run`` can be called again in the same SparkSession.
``tfdist.spark`` is its public name.

PySpark is imported on first use only; ``import tfdist`` does not load it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

from tfdist.cluster import ClusterSpec
from tfdist.launch import LaunchError
from tfdist.launch.output import TAIL_LINES
from tfdist.runners import interpreter
from tfdist.runners.remote_task import (TaskFailedError, check_run_options, load_results,
                                        make_payload, read_failure, reserve_port, run_task)

# "...barrier task ResultTask(3, 1) finished unsuccessfully" / "Lost task 1.0 in stage 3.0"
# The pickled return values of one run, all tasks together, that Spark's driver JVM
# collects (its default heap is 1 GiB; 2 x 200 MB ran it out of memory for good).
MAX_RESULT_BYTES = 128 * 2**20
_SPARK_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\)|Lost task (\d+)\.\d+ in stage")


def run(fn: Callable, *args: Any, workers: int = 1, spark=None, timeout: float | None = None,
        env: dict[str, str] | None = None, gpus_per_task: int | None = None,
        **kwargs: Any) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` as worker 0..N-1 of a job, one Spark barrier task each.

    The same contract as `tfdist.launch` with a function: ``fn`` is pickled by value
    with cloudpickle, every task runs it with a TF_CONFIG naming all of them, and the
    return values come back in task order. Spark's executors need tfdist and
    TensorFlow installed, and ``workers`` free task slots at once (barrier mode).

    Args:
        fn: The function each task runs, e.g. one that builds a
            `tfdist.MultiWorkerMirroredStrategy` and calls ``model.fit``.
        *args: Positional arguments of ``fn``.
        workers: Number of tasks (TensorFlow workers), >= 1.
        spark: The `pyspark.sql.SparkSession` to run on (default: the active one).
        timeout: Seconds before each task's function is killed; None for no deadline.
        env: Extra environment variables for the function's processes.
        gpus_per_task: GPUs each task uses, from those Spark assigned it
            (``spark.task.resource.gpu.amount``), exported as CUDA_VISIBLE_DEVICES;
            0 hides every GPU. Default: all the GPUs Spark assigned the task, if any.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        The return value of every task, in task order. Pickled, they may total at most
        `MAX_RESULT_BYTES` (128 MiB; ``MAX_RESULT_BYTES // workers`` per task): Spark
        collects them in its driver's JVM.

    Raises:
        LaunchError: a task failed, was killed or timed out, or returned more than its
            share of `MAX_RESULT_BYTES`; names it, with the end of its output. Spark
            stops the other tasks of the stage.
        RuntimeError: no active SparkSession, or a Spark Connect one (no barrier mode),
            or the executors' Python lacks tfdist, cloudpickle or TensorFlow (checked
            with a one-task probe before the stage starts, once per SparkContext).
        ValueError: bad arguments.
    """
    check_run_options(workers, timeout)
    _check_gpus_per_task(gpus_per_task)
    session = spark if spark is not None else _active_session()
    try:
        context = session.sparkContext
    except Exception as error:  # Spark Connect sessions have no RDDs or barrier mode
        raise RuntimeError(f"tfdist.spark.run needs a classic SparkSession with a "
                           f"SparkContext (barrier mode), not Spark Connect. Received: "
                           f"{type(session).__module__}.{type(session).__name__} ({error})"
                           ) from None
    _check_task_gpus(context, gpus_per_task)
    _check_executor_python(context)
    options = {"env": dict(env or {}), "timeout": timeout, "gpus_per_task": gpus_per_task,
               "max_result_bytes": MAX_RESULT_BYTES // workers, "workers": workers}
    payload = make_payload(fn, args, kwargs)
    stage = context.parallelize(range(workers), workers).barrier().mapPartitions(
        lambda _: _barrier_task(payload, options))
    from py4j.protocol import Py4JJavaError

    try:
        pairs = stage.collect()
    except Py4JJavaError as error:
        raise _launch_error(str(error)) from None
    return load_results([blob for _, blob in sorted(pairs)])


def cuda_visible_devices(resources: Mapping[str, Sequence[str]],
                         gpus_per_task: int | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a task, from the resources Spark assigned it.

    Args:
        resources: Resource name -> addresses, as ``BarrierTaskContext.resources()``
            gives them (``{"gpu": ["0", "1"]}``).
        gpus_per_task: GPUs the task uses, the first ones assigned; 0 hides them all;
            None: every GPU assigned, if any.

    Returns:
        The value to export, or None to leave the variable as it is.

    Raises:
        ValueError: Spark assigned fewer GPUs than ``gpus_per_task``.
    """
    gpus = [str(gpu) for gpu in resources.get("gpu", ())]
    if gpus_per_task is None:
        return ",".join(gpus) if gpus else None
    if len(gpus) < gpus_per_task:
        raise ValueError(
            f"gpus_per_task={gpus_per_task}, but Spark assigned this task {len(gpus)} GPU(s): "
            f"{gpus}. Set spark.task.resource.gpu.amount to at least {gpus_per_task} "
            "(and spark.executor.resource.gpu.amount with a discovery script).")
    return ",".join(gpus[:gpus_per_task])


@contextlib.contextmanager
def session(master: str | None = None, app_name: str = "tfdist"):
    """The active SparkSession, or a new one on ``master`` that is stopped on exit.

    Args:
        master: A Spark master URL (``spark://HOST:7077``, ``yarn``, ``local[4]``);
            default ``local[*]``. A local master binds to loopback (127.0.0.1) and
            runs this Python on its executors (unless $PYSPARK_PYTHON says otherwise).
        app_name: The application's name in Spark.

    Yields:
        The `pyspark.sql.SparkSession`.

    Raises:
        ConnectionError: Spark could not start a session on ``master``.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    master = master or "local[*]"
    builder = SparkSession.builder.master(master).appName(app_name)
    if master.startswith("local"):  # executors on this host: loopback, this Python
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # read by SparkContext
    try:
        created = builder.getOrCreate()
    except Exception as error:  # e.g. JAVA_GATEWAY_EXITED: Spark refused the master
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ConnectionError(f"Spark could not start a session on master {master!r}: "
                              f"{reason}") from None
    try:
        yield created
    finally:
        created.stop()


# ---- on the executors ----------------------------------------------------------------------

def _barrier_task(payload: bytes, options: dict) -> list[tuple[int, bytes]]:
    """One barrier task: gathers the job's addresses, then runs the function."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    index = context.partitionId()
    host = context.getTaskInfos()[index].address.rsplit(":", 1)[0]
    env = dict(options["env"])
    gpus = cuda_visible_devices(
        {name: list(info.addresses) for name, info in context.resources().items()},
        options["gpus_per_task"])
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    reserved = reserve_port()
    try:
        addresses = context.allGather(f"{host}:{reserved.getsockname()[1]}")
    except BaseException:
        reserved.close()
        raise
    blob = run_task(payload, ClusterSpec(worker=addresses), index, env=env,
                    timeout=options["timeout"], reserved=reserved, stream=sys.stderr)
    if len(blob) > options["max_result_bytes"]:  # it would go through the driver's JVM
        raise TaskFailedError(
            f"worker-{index}", 0, "", f"worker-{index} returned {_mib(len(blob))} "
            f"(pickled), more than tfdist.spark.run's limit of "
            f"{_mib(options['max_result_bytes'])} per task ({_mib(MAX_RESULT_BYTES)} per run "
            f"over {options['workers']} tasks); write large results to shared storage "
            f"and return their path")
    return [(index, blob)]


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


# ---- on the driver -------------------------------------------------------------------------

def _active_session():
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None:
        raise RuntimeError("tfdist.spark.run needs an active SparkSession: create one with "
                           "SparkSession.builder...getOrCreate() or pass spark=. Received none.")
    return session


# (application id, executors' Python) already probed and found able to run tasks.
_PYTHONS_CHECKED: set[tuple[str, str]] = set()


def _check_executor_python(context) -> None:
    """Fails before the stage when the executors' Python cannot run a task."""
    key = (context.applicationId, context.pythonExec)
    if key in _PYTHONS_CHECKED:
        return
    from py4j.protocol import Py4JJavaError

    how = (f"Set PYSPARK_PYTHON={sys.executable} before the SparkSession is created, or "
           f"its spark.pyspark.python to a Python with tfdist installed.")
    try:
        facts = context.parallelize([0], 1).map(interpreter.make_probe()).collect()[0]
    except Py4JJavaError as error:
        lines = [line for line in str(error).splitlines() if "Error" in line]
        raise RuntimeError(
            f"tfdist.spark.run: Spark's executors could not run their Python "
            f"{context.pythonExec} ({lines[-1].strip() if lines else 'it failed'}); this "
            f"driver runs {interpreter.driver()}. {how}") from None
    why = interpreter.problem(facts)
    if why is not None:
        raise RuntimeError(
            f"tfdist.spark.run: Spark's executors run Python {facts['python']} "
            f"({facts['version']}), {why}; this driver runs {interpreter.driver()}. {how}")
    _PYTHONS_CHECKED.add(key)


def _check_gpus_per_task(gpus_per_task) -> None:
    if gpus_per_task is not None and (isinstance(gpus_per_task, bool) or
                                      not isinstance(gpus_per_task, int) or gpus_per_task < 0):
        raise ValueError(f"gpus_per_task must be an integer >= 0 or None. "
                         f"Received: gpus_per_task={gpus_per_task!r}")


def _check_task_gpus(context, gpus_per_task) -> None:
    """Fails early when Spark is not set to assign ``gpus_per_task`` GPUs per task."""
    if not gpus_per_task:
        return
    amount = context.getConf().get("spark.task.resource.gpu.amount", "0")
    if float(amount) < gpus_per_task:
        raise ValueError(
            f"gpus_per_task={gpus_per_task} needs spark.task.resource.gpu.amount >= "
            f"{gpus_per_task} (with spark.executor.resource.gpu.amount and a discovery "
            f"script). Received: spark.task.resource.gpu.amount={amount}")


def _launch_error(text: str) -> LaunchError:
    """A `LaunchError` naming the failed task, from the text of Spark's error."""
    facts = read_failure(text)
    if facts is not None:
        return LaunchError(
            f"{facts['cause']}; Spark stopped the other tasks. Last output of "
            f"{facts['task']}:\n{facts['tail']}", task=facts["task"],
            returncode=facts["returncode"], output_tail=facts["tail"])
    # The task's Python worker itself failed (crashed, killed, lost with its executor).
    match = _SPARK_TASK.search(text)
    task = f"worker-{match[1] or match[2]}" if match else None
    lines = [line for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith(("at ", "..."))]
    detail = "\n".join(lines[:TAIL_LINES])
    return LaunchError(f"{task or 'the Spark stage'} failed; Spark stopped the other tasks. "
                       f"Spark says:\n{detail}", task=task, output_tail=detail)
