"""Shared fixtures. In-process TF tests run on 2 logical CPUs, set before TF starts."""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def logical_cpus():
    """Two logical CPU devices for in-process replica tests."""
    import tfdist

    return tfdist.devices.use_logical_cpus(2)
