"""Model averaging against synchronous training on a 100 Mbit/s link.

    sudo .venv/bin/python -m benchmarks.slow_link [--quick] [--output DIR]

Two workers, each in its own network namespace, joined only by a veth pair whose two
ends carry the private addresses 10.213.7.1/30 and 10.213.7.2/30 and are limited by
``tc qdisc ... tbf rate 100mbit`` in both directions (netem is not available on these
machines; GSO is capped at 16 KB so tbf's 32 KB bucket never drops a packet). No other
interface is in the namespaces, so every byte between the workers crosses the shaped link.

Measured for sync (`tfdist.MultiWorkerMirroredStrategy`) and
`tfdist.ModelAverageStrategy(period=4)` / ``(period=16)`` on the digits CNN of
`benchmarks.throughput` (global batch 64, one epoch = 28 steps = one pass over the
1797 digits): the median time per epoch (after one warm-up epoch) and the bytes per
step, both as the strategy's all-reduce payload and as what the worker's veth actually
sent (``/proc/net/dev`` in its namespace: payload + gRPC/TCP overhead).

The namespaces are created by this script (needs root and ``ip netns``) and removed when
it ends (try/finally); stale ones left by a killed earlier run (same name prefix, PID no
longer alive) are removed first. Without the permissions the section says so and skips.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (machine_info, markdown_table, parse_section_args, pyplot,
                               run_tasks, save_figure, section_parser, skip_section,
                               write_section)
from tfdist.files import is_process_alive

PREFIX = "tfdist-bench-"
ADDRESSES = ("10.213.7.1", "10.213.7.2")
PREFIX_LEN = 30
RATE = "100mbit"
PORT = 23456
GLOBAL_BATCH = 64
EPOCH_STEPS = 1797 // GLOBAL_BATCH  # 28: one pass over the digits
VARIANTS = {"sync": None, "period=4": 4, "period=16": 16}
# The models: the digits CNN of the other sections, and the same CNN with a wider dense
# layer, whose gradient (4.3 MB) takes several compute-steps to cross the link.
MODELS = {"": ("digits CNN", 64), "wide_": ("wide digits CNN (dense 512)", 512)}


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def cleanup_stale() -> list[str]:
    """Deletes namespaces of earlier runs of this benchmark whose process is gone."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not is_process_alive(pid) or pid == os.getpid():
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class SlowLink:
    """Two namespaces joined by a veth pair shaped to ``rate``; removed on exit.

    Attributes:
        namespaces: The two namespace names (worker 0's, worker 1's).
        devices: The veth end in each namespace.
    """

    def __init__(self, rate: str = RATE):
        pid = os.getpid()
        self.rate = rate
        self.namespaces = (f"{PREFIX}{pid}-a", f"{PREFIX}{pid}-b")
        self.devices = (f"tfb{pid}a", f"tfb{pid}b")  # <= 15 characters (IFNAMSIZ)

    def __enter__(self):
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("link", "add", self.devices[0], "type", "veth", "peer", "name",
                self.devices[1])
            for ns, dev, address in zip(self.namespaces, self.devices, ADDRESSES):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "gso_max_size", "16384")
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                                "root", "tbf", "rate", self.rate, "burst", "32kb", "latency",
                                "100ms"], capture_output=True, text=True, check=True,
                               timeout=30)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        for ns in self.namespaces:  # deleting a namespace deletes its veth end, and the pair
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.devices[0], check=False)

    def cluster(self):
        from tfdist.cluster import ClusterSpec

        return ClusterSpec(worker=tuple(f"{a}:{PORT}" for a in ADDRESSES))

    def wrap(self, task):
        return ["ip", "netns", "exec", self.namespaces[task.index]]


def why_no_namespaces() -> str | None:
    """Why this machine cannot run the benchmark, or None if it can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the benchmark as root)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    return None


def _tx_bytes() -> int:
    """Bytes sent by every interface but lo in this process's network namespace."""
    total = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() != "lo":
            total += int(fields.split()[8])
    return total


def link_task(period: int | None, epochs: int, steps: int, width: int = 64) -> dict:
    """Runs in each worker (inside its namespace): 1 + ``epochs`` epochs, timed."""
    import tfdist

    if period is None:
        strategy = tfdist.MultiWorkerMirroredStrategy()
    else:
        strategy = tfdist.ModelAverageStrategy(period=period)
    import keras

    from benchmarks.common import compile_digits, digits_cnn, digits_dataset

    class Meter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds, self.tx, self.comm = [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self._tx, self._comm = _tx_bytes(), strategy_bytes()
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)
            self.tx.append(_tx_bytes() - self._tx)
            self.comm.append(strategy_bytes() - self._comm)

    def strategy_bytes():
        return int(getattr(strategy, "bytes_communicated", 0) or 0)

    with strategy.scope():
        model = compile_digits(digits_cnn(width=width))
    meter = Meter()
    history = model.fit(digits_dataset(GLOBAL_BATCH), epochs=1 + epochs, steps_per_epoch=steps,
                        verbose=0, callbacks=[meter])
    gradient_bytes = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    timed = slice(1, None)
    counted = period is not None and hasattr(strategy, "bytes_communicated")
    return {
        "epoch_seconds": meter.seconds[timed],
        "first_epoch_seconds": meter.seconds[0],
        "wire_tx_bytes_per_step": statistics.mean(meter.tx[timed]) / steps,
        "payload_bytes_per_step": (statistics.mean(meter.comm[timed]) / steps if counted
                                   else float(gradient_bytes)),
        "payload_counted": counted,
        "gradient_bytes": gradient_bytes,
        "loss": [float(v) for v in history.history["loss"]],
    }


def plot(results, path):
    keys = [p + n for p in MODELS for n in VARIANTS if "epoch_seconds" in results.get(p + n, {})]
    labels = [("wide\n" if k.startswith("wide_") else "CNN\n") + k.replace("wide_", "")
              for k in keys]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(9, 3.2))
    times = [results[k]["epoch_seconds"] for k in keys]
    wire = [results[k]["wire_tx_bytes_per_step"] / 1e6 for k in keys]
    left.bar(labels, times, color="tab:orange")
    left.set_ylabel("seconds per epoch (28 steps)")
    left.set_yscale("log")
    right.bar(labels, wire, color="tab:purple")
    right.set_ylabel("MB sent per step per worker")
    right.set_yscale("log")
    for ax, vals, fmt in ((left, times, "{:.2f}s"), (right, wire, "{:.3f}")):
        ax.tick_params(axis="x", labelsize=8)
        for i, v in enumerate(vals):
            ax.text(i, v, fmt.format(v), ha="center", va="bottom", fontsize=7)
    fig.suptitle(f"2 workers over a {RATE} veth (tbf): sync vs model averaging")
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse_section_args(section_parser("benchmarks.slow_link", __doc__), argv)
    import tfdist

    title = f"Model averaging against sync on a {RATE} link"
    out = args.output
    why = why_no_namespaces()
    if why:
        skip_section(out, "slow_link", title, why)
        return {"skipped": why}
    stale = cleanup_stale()
    if stale:
        print(f"slow_link: removed stale namespaces {stale}", flush=True)
    epochs, steps, rounds = (1, 4, 1) if args.quick else (3, EPOCH_STEPS, 2)
    timeout = 240 if args.quick else 900
    # (model prefix, timed epochs, rounds): the wide model's sync epochs are ~10 s each.
    plan = [("", epochs, rounds)] + ([] if args.quick else [("wide_", 1, 1)])
    results: dict = {}
    runs: dict[str, list] = {}
    if "ModelAverageStrategy" not in tfdist._LAZY:
        for prefix, _, _ in plan:
            for name, period in VARIANTS.items():
                if period is not None:
                    results[prefix + name] = {"skipped": "not available (tfdist."
                                              "ModelAverageStrategy does not exist yet)"}
    with SlowLink() as link:
        print(f"slow_link: namespaces {link.namespaces} joined by {RATE} veth "
              f"{ADDRESSES[0]} <-> {ADDRESSES[1]}", flush=True)
        for prefix, model_epochs, model_rounds in plan:
            width = MODELS[prefix][1]
            for round_ in range(model_rounds):
                names = list(VARIANTS) if round_ % 2 == 0 else list(VARIANTS)[::-1]
                if args.quick:  # the smoke run: the two ends of the comparison
                    names = ["sync", "period=16"]
                for name in names:
                    key = prefix + name
                    if key in results:
                        continue
                    print(f"slow_link: {MODELS[prefix][0]}: {name} (round {round_ + 1}/"
                          f"{model_rounds}) ...", flush=True)
                    try:
                        values = run_tasks(link_task, VARIANTS[name], model_epochs, steps,
                                           width, workers=2, timeout=timeout,
                                           cluster=link.cluster(), wrap=link.wrap)
                    except Exception as error:
                        text = str(error).strip()
                        results[key] = {"failed": f"{type(error).__name__}: "
                                        f"{text.splitlines()[0][:300] if text else ''}",
                                        "output_tail": text[-1500:]}
                        print(f"slow_link: {key}: FAILED: {results[key]['failed']}",
                              flush=True)
                        continue
                    runs.setdefault(key, []).append(values)
                    print(f"slow_link: {key}: "
                          f"{statistics.median(values[0]['epoch_seconds']):.2f} s/epoch, "
                          f"{values[0]['wire_tx_bytes_per_step']:,.0f} B/step on the wire",
                          flush=True)
    for key, rounds_ in runs.items():
        if key in results:
            continue
        epoch_times = [t for values in rounds_ for t in values[0]["epoch_seconds"]]
        results[key] = {
            "epoch_seconds": statistics.median(epoch_times),
            "wire_tx_bytes_per_step": statistics.mean(
                v["wire_tx_bytes_per_step"] for values in rounds_ for v in values),
            "payload_bytes_per_step": rounds_[-1][0]["payload_bytes_per_step"],
            "payload_counted": rounds_[-1][0]["payload_counted"],
            "gradient_bytes": rounds_[-1][0]["gradient_bytes"],
            "final_loss": rounds_[-1][0]["loss"][-1],
            "runs": rounds_}
    rows = [["model", "variant", "s/epoch", "speed-up vs sync", "all-reduce payload B/step",
             "sent on the wire B/step/worker", "final loss"]]
    for prefix, _, _ in plan:
        label = MODELS[prefix][0]
        sync = results.get(prefix + "sync", {}).get("epoch_seconds")
        for name in VARIANTS:
            r = results.get(prefix + name, {"skipped": "not run in --quick" if args.quick
                                            else "not run"})
            if "epoch_seconds" in r:
                payload = f"{r['payload_bytes_per_step']:,.0f}" + (
                    "" if r["payload_counted"] else " (gradient size)")
                rows.append([label, name, f"{r['epoch_seconds']:.2f}",
                             f"**{sync / r['epoch_seconds']:.2f}x**" if sync else "-",
                             payload, f"{r['wire_tx_bytes_per_step']:,.0f}",
                             f"{r['final_loss']:.3f}"])
            else:
                rows.append([label, name, r.get("skipped") and f"skipped: {r['skipped']}"
                             or f"failed: {r['failed']}", "", "", "", ""])
            if sync and name != "sync" and "epoch_seconds" in r:
                results[f"{prefix}speedup_{name.replace('=', '')}"] = sync / r["epoch_seconds"]
    if args.quick:
        rows.append([MODELS["wide_"][0], "all", "not run in --quick", "", "", "", ""])
    text = [f"# {title}", "", "Command (root): `.venv/bin/python -m benchmarks.slow_link`", "",
            f"2 workers in 2 network namespaces, veth {ADDRESSES[0]} <-> {ADDRESSES[1]}/"
            f"{PREFIX_LEN}, `tc tbf rate {RATE}` on both ends. Global batch {GLOBAL_BATCH}, "
            f"{steps} steps per epoch, median of {epochs} timed epoch(s) x {rounds} "
            "round(s) after a warm-up epoch (wide model: 1 epoch x 1 round). Payload: what "
            "the strategy all-reduces per step (sync: one gradient); wire: what this "
            "worker's veth sent (payload + gRPC/TCP/IP overhead + Keras' per-step metric "
            "all-reduce).", "", markdown_table(rows), ""]
    if any("epoch_seconds" in r for r in results.values() if isinstance(r, dict)):
        plot(results, out / "slow_link.png")
        text += ["![slow link](slow_link.png)", ""]
    data = {"machine": machine_info(), "rate": RATE, "epochs": epochs, "steps": steps,
            "rounds": rounds, "results": results}
    write_section(out, "slow_link", "\n".join(text), data)
    print("\n".join(text), flush=True)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
