"""All-reduce time between 2 processes, 4 KB to 64 MB, measured in one run.

Engines, each as two processes on this host:

- Horovod/Gloo: ``hvd.allreduce`` (sum, float32), processes started by ``horovodrun``.
- TF gRPC ring: ``tf.distribute.MultiWorkerMirroredStrategy`` with the RING
  collective implementation, processes started by `tfdist.launch`.
- Loopback bound: one TCP stream between two processes moving the bytes a ring
  all-reduce must send per rank (``S * 2(N-1)/N``), and ``memcpy`` of ``S`` bytes
  measured the same way (median of repeated calls).

Reported: median time per all-reduce and bus bandwidth ``S / t * 2(N-1)/N`` (N = 2).

    python -m benchmarks.allreduce [--quick] [--output DIR]   # DIR/allreduce.{json,md,png}
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (machine_info, markdown_table, parse_section_args, pyplot,
                               run_horovod, save_figure, section_parser, task_env)

NPROC = 2
FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10]


def repetitions(nbytes: int, quick: bool) -> int:
    if quick:
        return 1
    if nbytes <= 256 << 10:
        return 30
    if nbytes <= 4 << 20:
        return 15
    return 7


def bus_factor(n: int = NPROC) -> float:
    return 2 * (n - 1) / n


def _median_times(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ---- engines (run inside the worker processes) -----------------------------------------

def horovod_task(sizes, quick):
    """Runs in each horovodrun rank; returns {bytes: median seconds}."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from tfdist.engines.horovod import ops as comm

    hvd = comm.hvd()
    out = {}
    for nbytes in sizes:
        tensor = tf.ones([nbytes // 4], tf.float32)
        expected = float(hvd.size())

        def step():
            result = hvd.allreduce(tensor, op=hvd.Sum)
            return result[0].numpy()   # wait for the value

        assert step() == expected
        out[nbytes] = _median_times(step, repetitions(nbytes, quick))
    return out


def tf_ring_task(sizes, quick):
    """Runs in each tfdist.launch worker (TF_CONFIG set); returns {bytes: seconds}."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    return {nbytes: strategy_allreduce_seconds(strategy, nbytes, quick) for nbytes in sizes}


def strategy_allreduce_seconds(strategy, nbytes: int, quick: bool) -> float:
    """Median seconds of a float32 SUM all-reduce of ``nbytes`` through ``strategy``'s
    replica context, the way ``fit`` reduces gradients; checks the sum first."""
    import tensorflow as tf

    with tf.device("/cpu:0"):
        tensor = tf.ones([nbytes // 4], tf.float32)

    @tf.function
    def reduce_sum():
        return strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce("SUM", tensor))

    def step():
        return strategy.experimental_local_results(reduce_sum())[0][0].numpy()

    if step() != strategy.num_replicas_in_sync:
        raise AssertionError(f"all-reduce gave {step()}, expected "
                             f"{strategy.num_replicas_in_sync}")
    return _median_times(step, repetitions(nbytes, quick))


def _tcp_receiver(port: int, sizes, reps_list):
    import numpy as np

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = memoryview(np.empty(max(sizes), np.uint8))
        for nbytes, reps in zip(sizes, reps_list):
            for _ in range(reps):
                got = 0
                while got < nbytes:
                    got += sock.recv_into(buffer[got:nbytes])
                sock.sendall(b"k")


def loopback_bounds(sizes, quick):
    """One TCP stream (to a second process) and memcpy; returns two {bytes: seconds}."""
    import multiprocessing as mp

    import numpy as np

    # Bytes each rank of a ring all-reduce sends.
    sends = [int(s * bus_factor()) for s in sizes]
    warmup = 2
    reps_list = [repetitions(s, quick) + warmup for s in sizes]
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_tcp_receiver, args=(port, sends, reps_list), daemon=True)
    child.start()
    tcp = {}
    try:
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(120)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(np.ones(max(sends), np.uint8))
        ack = bytearray(1)
        for size, nbytes in zip(sizes, sends):
            def send():
                conn.sendall(payload[:nbytes])
                conn.recv_into(ack)
            tcp[size] = _median_times(send, repetitions(size, quick), warmup=warmup)
        conn.close()
    finally:
        server.close()
        child.join(30)
        if child.is_alive():
            child.kill()
    memcpy = {}
    for size in sizes:
        src = np.ones(size, np.uint8)
        dst = np.empty_like(src)
        memcpy[size] = _median_times(lambda: np.copyto(dst, src), repetitions(size, quick))
    return tcp, memcpy


# ---- drivers -------------------------------------------------------------------------

def horovod_times(sizes, quick, timeout):
    """{bytes: median seconds} of rank 0 of a horovodrun job."""
    if not (Path(sys.executable).parent / "horovodrun").exists():
        from tfdist.engines.horovod.ops import INSTALL_HINT

        raise SystemExit(INSTALL_HINT)
    return run_horovod(horovod_task, sizes, quick, np=NPROC, timeout=timeout)[0]


def tf_ring_times(sizes, quick, timeout):
    """{bytes: median seconds} of worker 0 of a `tfdist.launch` job."""
    import tfdist

    results = tfdist.launch(tf_ring_task, sizes, quick, workers=NPROC, timeout=timeout,
                            env=task_env(), stream=None)
    return {int(k): v for k, v in results[0].items()}


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def report(results: dict, command: str) -> str:
    engines = results["engines"]
    rows = [["size"] + [f"{name} ms (GB/s)" for name in engines] + ["memcpy ms"]]
    for size in results["sizes"]:
        row = [_fmt_bytes(size)]
        for name in engines:
            t = results["seconds"][name][str(size)]
            row.append(f"{t * 1e3:.3f} ({size * bus_factor() / t / 1e9:.2f})")
        row.append(f"{results['seconds']['memcpy'][str(size)] * 1e3:.3f}")
        rows.append(row)
    largest = str(results["sizes"][-1])
    s = results["seconds"]
    ratio = "\n".join(
        f"- {_fmt_bytes(int(largest))}: {name} takes {s[name][largest] / s['loopback bound'][largest]:.1f}x the loopback bound"
        for name in ("Horovod/Gloo", "TF gRPC ring"))
    return (f"# All-reduce between {NPROC} processes on one host\n\n"
            f"Command: `{command}`\n\n"
            "Median time per all-reduce of a float32 tensor (sum) and bus bandwidth "
            f"`size / time * 2(N-1)/N`. The loopback bound is one TCP stream sending the "
            "bytes a ring all-reduce must send per rank (`size * 2(N-1)/N`) to a second "
            "process; memcpy copies `size` bytes once.\n\n"
            + markdown_table(rows) + "\n\n" + ratio + "\n\n"
            f"Machine: {json.dumps(results['machine'])}\n\n"
            f"1-minute load average before/after the run: "
            f"{results['load_average_1min']['before']} / {results['load_average_1min']['after']} "
            f"({results['machine']['cpus']} CPUs; other jobs on the machine inflate the times).\n")


def plot(results: dict, path: Path) -> None:
    sizes = results["sizes"]
    fig, (ax_t, ax_bw) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    for name in list(results["engines"]) + ["memcpy"]:
        times = [results["seconds"][name][str(s)] for s in sizes]
        style = "--" if name in ("loopback bound", "memcpy") else "-o"
        ax_t.plot(sizes, [t * 1e3 for t in times], style, label=name)
        if name != "memcpy":
            ax_bw.plot(sizes, [s * bus_factor() / t / 1e9 for s, t in zip(sizes, times)],
                       style, label=name)
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("all-reduce size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_bw.set_yscale("log")
    ax_t.set_ylabel("median time (ms)")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_t.legend()
    fig.suptitle(f"All-reduce between {NPROC} processes (float32 sum)")
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = section_parser("benchmarks.allreduce", __doc__)
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds per engine before its processes are killed")
    parser.add_argument("--out", metavar="DIR/allreduce", default=None,
                        help="deprecated: --output DIR")
    args = parse_section_args(parser, argv)
    if args.out:
        print("allreduce: --out is deprecated; use --output DIR", file=sys.stderr, flush=True)
        args.output = Path(args.out).resolve().parent
        args.output.mkdir(parents=True, exist_ok=True)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    command = "python -m benchmarks.allreduce" + (" --quick" if args.quick else "")
    print(f"[allreduce] sizes {[_fmt_bytes(s) for s in sizes]}", flush=True)
    seconds = {}
    load_before = os.getloadavg()
    print("[allreduce] Horovod/Gloo (horovodrun, 2 processes)", flush=True)
    seconds["Horovod/Gloo"] = horovod_times(sizes, args.quick, args.timeout)
    print("[allreduce] TF gRPC ring (tfdist.launch, 2 workers)", flush=True)
    seconds["TF gRPC ring"] = tf_ring_times(sizes, args.quick, args.timeout)
    print("[allreduce] loopback bound: one TCP stream, memcpy", flush=True)
    seconds["loopback bound"], seconds["memcpy"] = loopback_bounds(sizes, args.quick)
    results = {"command": command, "nproc": NPROC, "sizes": sizes,
               "engines": ["Horovod/Gloo", "TF gRPC ring", "loopback bound"],
               "seconds": {k: {str(s): v[s] for s in sizes} for k, v in seconds.items()},
               "machine": machine_info(),
               "load_average_1min": {"before": round(load_before[0], 2),
                                     "after": round(os.getloadavg()[0], 2)},
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = args.output / "allreduce"
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(report(results, command))
    plot(results, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text(), flush=True)
    return results


if __name__ == "__main__":
    main()
