"""Engine "tf" on CPU: reduce-scatter as an all-to-all + local sum against the old
all-reduce (each worker keeping its block), wire bytes and seconds.

Each of ``--workers`` workers (launched by tfdist, engine "tf", one CPU replica each)
reduce-scatters a float32 tensor of ``--megabytes`` MB ``--repeats`` times with each
implementation, alternating: "all_to_all" is the strategy communicator's
``reduce_scatter`` (``CollectiveAllToAllV2``), "all_reduce" the base
``Communicator.reduce_scatter`` it replaced (the strategy's all-reduce, then a slice).
Wire bytes are what the worker's TCP sockets sent (``ss``'s ``bytes_sent`` summed over
its own sockets, gRPC framing included) per call. It prints rank 0's medians and the
all_to_all / all_reduce ratios.

Usage: ``.venv/bin/python scripts/tf_reducescatter.py [--workers 2] [--megabytes 64]
[--repeats 5]``
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sent_bytes() -> int:
    """Bytes this process's TCP sockets have sent (``ss -tinp``, its own pid only)."""
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True,
                          check=True).stdout
    total, mine = 0, False
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={os.getpid()}," in line
        elif mine:
            match = re.search(r"bytes_sent:(\d+)", line)
            total += int(match.group(1)) if match else 0
    return total


def _task(megabytes: int, repeats: int) -> dict:
    """On each worker: ``{implementation: [(seconds, bytes sent)]}``."""
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.comm.communicator import Communicator

    strategy = tfdist.MultiWorkerMirroredStrategy(engine="tf")
    inner = strategy.communicator.inner
    elements = megabytes * 2 ** 20 // 4
    value = tf.constant(np.full(elements, strategy.rank + 1.0, np.float32))

    device = strategy.extended.worker_devices[0]

    def on_device(v):  # placed: the all-reduce lands on its value's device
        with tf.device(device):
            return tf.identity(v)

    @tf.function
    def all_to_all(v):
        return inner.reduce_scatter(strategy, [on_device(v)])[0]

    @tf.function
    def all_reduce(v):
        return Communicator.reduce_scatter(inner, strategy, [on_device(v)])[0]

    runs = {"all_to_all": all_to_all, "all_reduce": all_reduce}
    want = sum(range(1, strategy.num_replicas_in_sync + 1))
    out = {name: [] for name in runs}
    for name, run in runs.items():  # trace and warm up
        got = run(value).numpy()
        assert got.shape == (elements // strategy.num_replicas_in_sync,) and (got == want).all()
    for _ in range(repeats):
        for name, run in runs.items():
            sent = _sent_bytes()
            start = time.perf_counter()
            run(value).numpy()
            out[name].append((time.perf_counter() - start, _sent_bytes() - sent))
    return out


def main(argv=None) -> None:
    import statistics

    import tfdist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    results = tfdist.launch(_task, args.megabytes, args.repeats, workers=args.workers,
                            timeout=600)
    medians = {name: (statistics.median(s for s, _ in runs),
                      statistics.median(b for _, b in runs))
               for name, runs in results[0].items()}
    for name, (seconds, sent) in medians.items():
        print(f"{name}: median {seconds:.3f} s, {sent / 2 ** 20:.1f} MB sent by rank 0 "
              f"({args.megabytes} MB float32, {args.workers} workers, "
              f"{args.repeats} repeats)")
    (new_s, new_b), (old_s, old_b) = medians["all_to_all"], medians["all_reduce"]
    print(f"all_to_all / all_reduce: time {new_s / old_s:.2f}, bytes {new_b / old_b:.2f}")


if __name__ == "__main__":
    main()
