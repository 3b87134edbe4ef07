"""Horovod's Gloo reduce-scatter against tfdist's, with rank 0 reading slowly.

``gloo::ReduceScatterHalvingDoubling`` (Horovod's ``reducescatter`` on Gloo) lets every
rank but 0 overwrite its send buffer before its sends complete, so the end of rank 0's
block is sometimes wrong (jax-ml/jax#40830). tfdist's
`tfdist.engines.horovod.ops.reducescatter` runs an alltoall and a local sum instead.

Each of ``--workers`` Horovod workers (launched by tfdist, engine "horovod") reduces a
tensor of integer-valued floats, whose sum is exact, ``--iterations`` times with each
implementation, while a helper process stops and continues rank 0 (SIGSTOP 20 ms,
SIGCONT 30 ms). It prints, per implementation, how many (rank, iteration) results were
wrong and where.

With ``--time`` it measures instead, without stopping anyone: the median seconds of
each implementation and of Horovod's ``allreduce`` of the same tensor.

Usage: ``.venv/bin/python scripts/gloo_reducescatter.py [--workers 4]
[--iterations 20] [--elements 4194304] [--time]`` (elements per rank's block).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _task(elements: int, iterations: int) -> dict:
    """On each worker: ``{implementation: [(iteration, wrong, first, last)]}``."""
    import signal
    import subprocess

    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.engines.horovod import ops

    tfdist.MultiWorkerMirroredStrategy(engine="horovod")
    rank, size = hvd.rank(), hvd.size()
    base = np.arange(elements * size, dtype=np.float32) % 1000
    value = tf.constant(base + rank)
    want = (base * size + sum(range(size))).reshape(size, elements)[rank]
    runs = {"horovod": lambda i: hvd.reducescatter(value, op=hvd.Sum, name=f"stock{i}"),
            "tfdist": lambda i: ops.reducescatter(value)}
    wrong = {name: [] for name in runs}
    stopper = None
    if rank == 0:
        pid = os.getpid()
        stopper = subprocess.Popen(["bash", "-c", f"while kill -STOP {pid}; do sleep 0.02; "
                                    f"kill -CONT {pid}; sleep 0.03; done"])
    try:
        for i in range(iterations):
            for name, run in runs.items():
                bad = np.nonzero(run(i).numpy() != want)[0]
                if bad.size:
                    wrong[name].append((i, int(bad.size), int(bad[0]), int(bad[-1])))
    finally:
        if stopper is not None:
            stopper.kill()
            stopper.wait()
            os.kill(os.getpid(), signal.SIGCONT)
    return wrong


def _timed(elements: int, iterations: int) -> dict:
    """On each worker: the median seconds of each op over ``iterations`` calls."""
    import time

    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.engines.horovod import ops

    tfdist.MultiWorkerMirroredStrategy(engine="horovod")
    value = tf.ones([elements * hvd.size()])
    runs = {"horovod": lambda i: hvd.reducescatter(value, op=hvd.Sum, name=f"stock{i}"),
            "tfdist": lambda i: ops.reducescatter(value),
            "allreduce": lambda i: hvd.allreduce(value, op=hvd.Sum, name=f"all{i}")}
    medians = {}
    for name, run in runs.items():
        run(-1).numpy()  # warm-up
        seconds = []
        for i in range(iterations):
            start = time.perf_counter()
            run(i).numpy()
            seconds.append(time.perf_counter() - start)
        medians[name] = float(np.median(seconds))
    return medians


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--elements", type=int, default=4 * 2**20)
    parser.add_argument("--time", action="store_true")
    args = parser.parse_args(argv)
    from benchmarks.common import run_tasks

    if args.time:
        for rank, medians in enumerate(run_tasks(_timed, args.elements, args.iterations,
                                                 workers=args.workers, timeout=1800)):
            print(f"worker {rank}: " + ", ".join(
                f"{name} {seconds * 1000:.0f} ms" for name, seconds in medians.items()) +
                  f"; tfdist / horovod {medians['tfdist'] / medians['horovod']:.2f}, "
                  f"tfdist / allreduce {medians['tfdist'] / medians['allreduce']:.2f}")
        return

    results = run_tasks(_task, args.elements, args.iterations, workers=args.workers,
                        timeout=1800)
    for name in ("horovod", "tfdist"):
        cases = [(rank, *case) for rank, result in enumerate(results) for case in result[name]]
        print(f"{name}: {len(cases)} of {args.workers * args.iterations} results wrong "
              f"(rank, iteration, wrong elements, first, last): {cases}")


if __name__ == "__main__":
    main()
