"""A model too large for one worker's memory cap trains with ``shard_parameters=True``.

Every task runs in its own cgroup v1 memory group capped at `CAP` (`benchmarks.memcap`;
root). The model (`benchmarks.fsdp.dense_stack`: 4 Dense layers of 4096, Adam: 67.1 M
parameters, 805 MB of weights and slots; 1478 MiB peak unsharded, about 950 MiB per
sharded worker) is killed by the kernel on one unsharded worker, and trains on 4 workers with fully sharded parameters, to the weights of one
unconstrained process (atol 1e-5): each worker returns the slices it holds, which are
compared with the same slices of the reference. The benchmark runs the large version
(docs/fsdp.md).
"""

import os

import numpy as np
import pytest

from benchmarks.fsdp import _task, adam, dense_stack, random_data, reference_weights
from benchmarks.memcap import MemoryCaps, cannot_cap

CAP = 1200 * 2**20
WIDTH, LAYERS, BATCH, STEPS = 4096, 4, 16, 2
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def held_slices(engine, options):
    """On each task: trains as `benchmarks.fsdp` does, then returns what it holds of
    each weight: ``("whole", value)`` or ``("slice", start, values)`` (flat)."""
    import tfdist
    from tfdist._hooks.fsdp import shard_of, tf_value

    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine, **options)
    x, y = random_data(WIDTH, BATCH * STEPS)
    with strategy.scope():
        model = dense_stack(WIDTH, LAYERS)
        model.compile(adam(), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    held = []
    for weight in model.weights:
        shard = shard_of(weight)
        if shard is None:
            held.append(("whole", np.asarray(tf_value(weight).values[0])))
        else:
            held.append(("slice", strategy.rank * shard.slice_size,
                         np.asarray(tf_value(weight).values[0])))
    return held


def _run(fn, workers, *args):
    """``fn(*args)`` on ``workers`` capped tasks: ``(results or None, figures)``."""
    from benchmarks.common import run_tasks

    caps = MemoryCaps(CAP, tag=f"tfdist-test-fsdp-{workers}")
    tasks = [f"worker-{i}" for i in range(workers)]
    try:
        try:
            results = run_tasks(fn, *args, workers=workers, timeout=400, wrap=caps.wrap,
                                env={"PYTHONPATH": os.pathsep.join(
                                    [os.path.dirname(TESTS_DIR), TESTS_DIR])})
            failure = ""
        except Exception as error:  # noqa: BLE001 - a killed task is what is checked
            results, failure = None, str(error)
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
    alone, capped = _run(_task, 1, "horovod", {}, WIDTH, LAYERS, BATCH, 1, 1)
    assert alone is None and capped["oom_killed"], capped
    sharded, figures = _run(held_slices, 4, "horovod", {"shard_parameters": True})
    assert sharded is not None, figures
    assert not figures["oom_killed"] and figures["peak"] <= CAP, figures
    want = reference_weights(WIDTH, LAYERS, BATCH, 0, STEPS)
    elements = [0, 0]  # (held by one worker, whole) of the sharded weights
    for index, reference in enumerate(want):
        flat = reference.reshape(-1)
        for worker in sharded:
            kind, *held = worker[index]
            if kind == "whole":
                np.testing.assert_allclose(held[0], reference, atol=1e-5)
                continue
            start, values = held
            stop = min(start + values.size, flat.size)
            np.testing.assert_allclose(values[:max(stop - start, 0)], flat[start:stop],
                                       atol=1e-5)
        if sharded[0][index][0] == "slice":
            elements[0] += sharded[0][index][2].size
            elements[1] += flat.size
    assert elements[1] > 0.99 * sum(w.size for w in want)  # every kernel sharded
    assert elements[0] == pytest.approx(elements[1] / 4, rel=0.01)
