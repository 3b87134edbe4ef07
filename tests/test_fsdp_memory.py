"""A model too large for one worker's memory cap trains with ``shard_parameters=True``.

Every task runs in its own cgroup v1 memory group capped at `CAP` (`benchmarks.memcap`;
root). The model (`benchmarks.fsdp`: 4 Dense layers of 2048, Adam: 16.8 M parameters,
268 MB of weights and slots) is killed by the kernel on one unsharded worker, and trains
on 4 workers with fully sharded parameters, to the weights of one unconstrained process
(atol 1e-5). The benchmark runs the large version (docs/fsdp.md).
"""

import os

import numpy as np
import pytest

from benchmarks.fsdp import _task, reference_weights
from benchmarks.memcap import MemoryCaps, cannot_cap

CAP = 500 * 2**20
WIDTH, LAYERS, BATCH, WARMUP, STEPS = 2048, 4, 16, 1, 1
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _run(workers, options):
    """``_task`` on ``workers`` capped tasks: ``(results or None, caps' figures)``."""
    from benchmarks.common import run_tasks

    caps = MemoryCaps(CAP, tag=f"tfdist-test-fsdp-{workers}")
    tasks = [f"worker-{i}" for i in range(workers)]
    try:
        try:
            results = run_tasks(_task, "horovod", options, WIDTH, LAYERS, BATCH, WARMUP, STEPS,
                                weights=True, workers=workers, timeout=400, wrap=caps.wrap,
                                env={"PYTHONPATH": os.pathsep.join(
                                    [os.path.dirname(TESTS_DIR), TESTS_DIR])})
        except Exception as error:  # noqa: BLE001 - a killed task is what is checked
            results = None
            failure = str(error)
        else:
            failure = ""
        figures = {"peak": max(caps.peak(t) for t in tasks),
                   "oom_killed": any(caps.oom_killed(t) for t in tasks), "failure": failure}
    finally:
        caps.remove()
    return results, figures


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_model_too_large_for_one_capped_worker_trains_fully_sharded_on_four():
    why = cannot_cap()
    assert why is None, why
    from helpers import require_horovod

    require_horovod()
    alone, capped = _run(1, {})
    assert alone is None and capped["oom_killed"], capped
    sharded, figures = _run(4, {"shard_parameters": True})
    assert sharded is not None, figures
    assert not figures["oom_killed"] and figures["peak"] <= CAP, figures
    want = reference_weights(WIDTH, LAYERS, BATCH, WARMUP, STEPS)
    got = sharded[0]["weights"]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Each worker holds about a quarter of the weights and slots: the persistent bytes.
    whole = 3 * 4 * sum(int(np.prod(w.shape)) for w in want)
    assert max(r["persistent_bytes"] for r in sharded) <= 0.3 * whole, sharded
