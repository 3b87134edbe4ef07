"""Shared fixtures. In-process TF tests run on 2 logical CPUs, set before TF starts."""

import importlib.abc
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


UNIT_ONLY_PACKAGES = ("tensorflow", "keras", "horovod", "tf_keras")


class _NoTensorFlow(importlib.abc.MetaPathFinder):
    """Makes an import of TensorFlow, Keras or Horovod fail in the unit tier."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in UNIT_ONLY_PACKAGES:
            raise ImportError(f"the unit tier (pytest -m unit) imports no TensorFlow, Keras "
                              f"or Horovod: mark this test otherwise. Received: import {name}")
        return None


def is_unit_tier(config) -> bool:
    """True for ``pytest -m unit``: only tests that import no TensorFlow run."""
    return (config.getoption("markexpr", "") or "").strip() == "unit"


def pytest_configure(config):
    """Every process that runs tests splits its CPU in two before any test: which files
    one `pytest -n 2` worker gets, and in what order, is not fixed, and TF's devices can
    only be set before TF's first op (the xdist controller runs no tests). The unit tier
    instead forbids TensorFlow, so that a unit test that reaches it fails."""
    if is_unit_tier(config):
        sys.meta_path.insert(0, _NoTensorFlow())
        return
    # The xdist controller (which runs no tests) sets up TF too, and xdist orders the
    # files by their number of tests (its --loadscope-reorder default), so test_bench.py
    # runs last, alone: LONGEST_FIRST applies to serial runs only. Handing the files out
    # in its order (``config.option.loadscopereorder = False`` where
    # ``config.getoption("numprocesses")`` is set and there is no ``workerinput``;
    # ``hasplugin("dsession")`` is still False here) changes which files run side by
    # side: it waits for a whole suite run that proves it.
    import tfdist

    tfdist.devices.use_logical_cpus(2)


def pytest_ignore_collect(collection_path, config):
    """The unit tier skips the modules that hold no unit test: many import TF at the top."""
    if is_unit_tier(config) and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_"):
        return "pytest.mark.unit" not in collection_path.read_text()
    return None


@pytest.fixture(scope="session")
def logical_cpus():
    """Two logical CPU devices for in-process replica tests."""
    import tfdist

    return tfdist.devices.use_logical_cpus(2)


# The longest files first (in a serial run; under `pytest -n 2` xdist reorders, see
# pytest_configure), meant so that no long file starts last while the other worker
# idles; the other files follow, those with more tests first. Order within a file is kept. Seconds: about each file's in make test
# (its tests among the slowest 25 of recent CI runs, summed; the two new tensor-parallel
# files guessed). The quick bench (three sections at a time) starts beside CPU-bound
# files of generous timeouts; Ray's and Spark's start-ups and the 5 s fault timeouts
# (notebooks, test_faults, test_ray) come after it.
LONGEST_FIRST = (
    "test_bench.py",  # 260
    "test_tensor_parallel_mesh.py", "test_train_resume.py", "test_fsdp.py",  # 110 120 60
    "test_notebooks.py", "test_faults.py", "test_ray.py",  # 260 150 130
    "test_tensor_parallel_engines.py", "test_tensor_parallel_fsdp.py",  # new: 80?
    "test_parameter_server.py", "test_model_average_local.py", "test_ps_save.py",  # 75 70 63
    "test_stock_patterns.py", "test_model_average_delay.py", "test_fsdp_memory.py",  # 55 50 47
    "test_slurm.py", "test_model_average_fragments.py", "test_ps_frozen.py",  # 47 47 45
    "test_spark.py", "test_stock_compat.py", "test_elastic_state.py",  # 45 42 40
    "test_multi_worker.py", "test_multi_node.py", "test_horovod.py", "test_engines.py",
    "test_elastic.py", "test_elastic_losses.py", "test_train_engines.py",  # 38 36 34
    "test_tensor_parallel.py", "test_ps_sharded.py", "test_model_average.py",  # 34
    "test_zero.py", "test_tensor_parallel_features.py", "test_engine_seam.py")  # 31


def pytest_collection_modifyitems(session, config, items):
    tests = {}
    for item in items:
        tests[item.path.name] = tests.get(item.path.name, 0) + 1

    def rank(item):
        name = item.path.name
        return (LONGEST_FIRST.index(name), 0) if name in LONGEST_FIRST else (
            len(LONGEST_FIRST), -tests[name])

    items.sort(key=rank)  # stable: each file keeps its own order
