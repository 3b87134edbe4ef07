"""Checks that an engine's workers run a Python that can run tfdist's tasks.

Spark's executors run ``PYSPARK_PYTHON`` (or ``spark.pyspark.python``, else the
``python3`` on PATH), and Ray's workers the Python of their cluster, which need not be
the driver's. A task there unpickles the function with cloudpickle and runs it with
tfdist and TensorFlow, so a Python without them would fail deep inside every task. A
one-task probe, pickled by value and using the standard library only, reports what
that Python lacks before the job's own tasks start.
"""

from __future__ import annotations

import sys
from typing import Callable

# What a task imports: the task code, the function's pickle, and TensorFlow.
NEEDED_MODULES = ("tfdist", "cloudpickle", "tensorflow")


def make_probe() -> Callable[..., dict]:
    """A function (pickled by value, standard library only) that reports its Python.

    Returns:
        A function of any arguments returning ``{"python", "version", "missing",
        "cloudpickle"}``: the interpreter's path, its ``X.Y.Z`` version, the modules of
        `NEEDED_MODULES` it cannot import, and its cloudpickle version (or None).
    """
    modules = NEEDED_MODULES

    def probe(*_):
        import importlib.metadata
        import importlib.util
        import sys as worker_sys

        try:
            cloudpickle = importlib.metadata.version("cloudpickle")
        except importlib.metadata.PackageNotFoundError:
            cloudpickle = None
        return {"python": worker_sys.executable,
                "version": "%d.%d.%d" % worker_sys.version_info[:3],
                "missing": [m for m in modules if importlib.util.find_spec(m) is None],
                "cloudpickle": cloudpickle}

    return probe


def problem(facts: dict) -> str | None:
    """What keeps the Python the probe ran on from running a task, or None.

    Args:
        facts: What `make_probe`'s function returned there.

    Returns:
        ``"which lacks cloudpickle, tensorflow"``-like text, or None when it can run
        this driver's tasks (tfdist, cloudpickle and TensorFlow there, the same
        Python ``X.Y`` and cloudpickle version as this driver).
    """
    import cloudpickle

    if facts["missing"]:
        return f"which lacks {', '.join(facts['missing'])}"
    here = "%d.%d" % sys.version_info[:2]
    if facts["version"].rsplit(".", 1)[0] != here:
        return f"whose Python {facts['version']} cannot load functions pickled on {here}"
    if facts["cloudpickle"] != cloudpickle.__version__:
        return (f"whose cloudpickle {facts['cloudpickle']} differs from this driver's "
                f"{cloudpickle.__version__}")
    return None


def driver() -> str:
    """This driver's Python, for error messages: ``PATH (X.Y.Z)``."""
    return f"{sys.executable} ({'%d.%d.%d' % sys.version_info[:3]})"
