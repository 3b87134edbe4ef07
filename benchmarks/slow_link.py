"""Synchronous training, model averaging and Streaming DiLoCo on a 100 Mbit/s link.

    sudo .venv/bin/python -m benchmarks.slow_link [--quick] [--output DIR]

Two workers, each in its own network namespace, joined only by a veth pair whose two
ends carry the private addresses 10.213.7.1/30 and 10.213.7.2/30 and are limited by
``tc qdisc ... tbf rate 100mbit`` in both directions (netem is not available on these
machines; GSO is capped at 16 KB so tbf's 32 KB bucket never drops a packet). No other
interface is in the namespaces, so every byte between the workers crosses the shaped link.

Variants (`VARIANTS`): sync (`tfdist.MultiWorkerMirroredStrategy`),
`tfdist.ModelAverageStrategy(period=16)`, the same with 4 fragments and ``sync_delay=2``
(Streaming DiLoCo), that with int8 and with int4 outer gradients, and the floor: pure
local training (no average before ``fit`` ends). Model: the digits CNN of
`benchmarks.throughput` and its wide variant, trained on 80% of the 1797 digits (global
batch 64, 32 steps per epoch: two averaging periods, so every window of whole epochs
holds whole periods; the data repeats) and tested on the other 20%. Measured: the median time
per epoch (after one warm-up epoch); bytes per step and the largest single step's bytes,
both as the strategy counts them and as the worker's veth sent them (``/proc/net/dev`` in
its namespace: payload + gRPC/TCP overhead); the final loss and test accuracy.

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
TRAIN_SAMPLES = 1440        # the first 80% of the digits; the rest is the test set
PERIOD = 16
EPOCH_STEPS = 2 * PERIOD  # whole periods: every fragment exchanges equally often per epoch
# Timed epochs of the digits CNN: 8 (+1 warm-up, 288 steps) take every variant past the
# steep start of its curve, where one outer step more or less moves test accuracy by
# points (with 3, sync reached 82% and the variants scattered 3 points either side).
TIMED_EPOCHS = 8
STREAMING = {"period": PERIOD, "fragments": 4, "sync_delay": 2}
# Name -> ModelAverageStrategy arguments (None: synchronous training).
VARIANTS = {"sync": None, "period=16": {"period": PERIOD},
            "streaming": STREAMING,
            "streaming int8": {**STREAMING, "outer_compression": "int8"},
            "streaming int4": {**STREAMING, "outer_compression": "int4"},
            "local": {"period": 10**6}}
QUICK_VARIANTS = ("sync", "streaming int4")  # a smoke run: the plainest and the most involved
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


def link_task(variant: dict | None, epochs: int, steps: int, width: int = 64) -> dict:
    """Runs in each worker (inside its namespace): 1 + ``epochs`` epochs, timed."""
    import tfdist

    if variant is None:
        strategy = tfdist.MultiWorkerMirroredStrategy()
    else:
        strategy = tfdist.ModelAverageStrategy(**variant)
    import keras
    import tensorflow as tf

    from benchmarks.common import compile_digits, digits_cnn, digits_data

    def strategy_bytes():
        return int(getattr(strategy, "bytes_communicated", 0) or 0)

    class Meter(keras.callbacks.Callback):
        """Epoch times and bytes; the largest step's bytes (after the warm-up epoch)."""

        def __init__(self):
            super().__init__()
            self.seconds, self.tx, self.comm = [], [], []
            self.max_step_tx = self.max_step_comm = 0

        def on_epoch_begin(self, epoch, logs=None):
            self._tx, self._comm = _tx_bytes(), strategy_bytes()
            self._step_tx, self._step_comm = self._tx, self._comm
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            tx, comm = _tx_bytes(), strategy_bytes()
            if self.seconds:  # not in the warm-up epoch
                self.max_step_tx = max(self.max_step_tx, tx - self._step_tx)
                self.max_step_comm = max(self.max_step_comm, comm - self._step_comm)
            self._step_tx, self._step_comm = tx, comm

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)
            self.tx.append(_tx_bytes() - self._tx)
            self.comm.append(strategy_bytes() - self._comm)

    x, y = digits_data()
    train = (tf.data.Dataset.from_tensor_slices((x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]))
             .shuffle(TRAIN_SAMPLES, seed=0).repeat()
             .batch(GLOBAL_BATCH, drop_remainder=True))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with strategy.scope():
        model = compile_digits(digits_cnn(width=width))
    meter = Meter()
    history = model.fit(train.with_options(options), epochs=1 + epochs, steps_per_epoch=steps,
                        verbose=0, callbacks=[meter])
    test_loss, test_accuracy = model.evaluate(x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:],
                                              batch_size=GLOBAL_BATCH, verbose=0)
    gradient_bytes = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    timed = slice(1, None)
    counted = variant is not None
    return {
        "epoch_seconds": meter.seconds[timed],
        "first_epoch_seconds": meter.seconds[0],
        "wire_tx_bytes_per_step": statistics.mean(meter.tx[timed]) / steps,
        "wire_max_step_bytes": meter.max_step_tx,
        "payload_bytes_per_step": (statistics.mean(meter.comm[timed]) / steps if counted
                                   else float(gradient_bytes)),
        "payload_max_step_bytes": meter.max_step_comm if counted else gradient_bytes,
        "payload_counted": counted,
        "gradient_bytes": gradient_bytes,
        "loss": [float(v) for v in history.history["loss"]],
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
    }


def plot(results, path):
    keys = [p + n for p in MODELS for n in VARIANTS if "epoch_seconds" in results.get(p + n, {})]
    labels = [("wide\n" if k.startswith("wide_") else "CNN\n") + k.replace("wide_", "")
              .replace("streaming ", "str.\n") for k in keys]
    fig, axes = pyplot().subplots(1, 3, figsize=(13, 3.4))
    series = [([results[k]["epoch_seconds"] for k in keys], "seconds per epoch", "{:.2f}s",
               "tab:orange", True),
              ([results[k]["wire_tx_bytes_per_step"] / 1e3 for k in keys],
               "KB sent per step per worker", "{:.1f}", "tab:purple", True),
              ([100 * results[k]["test_accuracy"] for k in keys], "test accuracy (%)",
               "{:.1f}", "tab:green", False)]
    for ax, (vals, label, fmt, color, log) in zip(axes, series):
        ax.bar(labels, vals, color=color)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="x", labelsize=6)
        for i, v in enumerate(vals):
            ax.text(i, v, fmt.format(v), ha="center", va="bottom", fontsize=6)
    fig.suptitle(f"2 workers over a {RATE} veth (tbf): sync, model averaging, "
                 "Streaming DiLoCo")
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse_section_args(section_parser("benchmarks.slow_link", __doc__), argv)
    title = f"Sync, model averaging and Streaming DiLoCo on a {RATE} link"
    out = args.output
    why = why_no_namespaces()
    if why:
        skip_section(out, "slow_link", title, why)
        return {"skipped": why}
    stale = cleanup_stale()
    if stale:
        print(f"slow_link: removed stale namespaces {stale}", flush=True)
    epochs, steps, rounds = (1, 4, 1) if args.quick else (TIMED_EPOCHS, EPOCH_STEPS, 2)
    timeout = 240 if args.quick else 900
    # (model prefix, timed epochs, rounds): the wide model's sync epochs are ~10 s each.
    plan = [("", epochs, rounds)] + ([] if args.quick else [("wide_", 1, 1)])
    names = list(QUICK_VARIANTS if args.quick else VARIANTS)
    runs = _run_plan(plan, names, steps, timeout)
    results = _summarise(runs)
    for prefix, _, _ in plan:
        sync = results.get(prefix + "sync", {})
        for name in names[1:]:
            r = results.get(prefix + name, {})
            if "epoch_seconds" not in sync or "epoch_seconds" not in r:
                continue
            tag = name.replace("=", "").replace(" ", "_")
            results[f"{prefix}speedup_{tag}"] = sync["epoch_seconds"] / r["epoch_seconds"]
            results[f"{prefix}wire_reduction_{tag}"] = (sync["wire_tx_bytes_per_step"]
                                                        / r["wire_tx_bytes_per_step"])
    text = [f"# {title}", "", "Command (root): `.venv/bin/python -m benchmarks.slow_link`", "",
            f"2 workers in 2 network namespaces, veth {ADDRESSES[0]} <-> {ADDRESSES[1]}/"
            f"{PREFIX_LEN}, `tc tbf rate {RATE}` on both ends. Global batch {GLOBAL_BATCH}, "
            f"{steps} steps per epoch over {TRAIN_SAMPLES} training digits, median of "
            f"{epochs} timed epoch(s) x {rounds} round(s) after a warm-up epoch (wide model: "
            "1 epoch x 1 round); test accuracy on the other 357 digits after the same epochs. "
            "Counted: what the strategy sends per step (sync: one gradient; averaging: its "
            "all-reduce or all-gather payload); wire: what this worker's veth sent (payload "
            "+ gRPC/TCP/IP overhead + the epoch's metric reduction). Largest step: the most "
            "bytes one step sent. Streaming: `period=16, fragments=4, sync_delay=2`; local: "
            "no average before `fit` ends (the floor).", "",
            markdown_table(_rows(plan, names, results)), ""]
    if any("epoch_seconds" in r for r in results.values() if isinstance(r, dict)):
        plot(results, out / "slow_link.png")
        text += ["![slow link](slow_link.png)", ""]
    data = {"machine": machine_info(), "rate": RATE, "epochs": epochs, "steps": steps,
            "rounds": rounds, "variants": {n: VARIANTS[n] for n in names},
            "results": results}
    write_section(out, "slow_link", "\n".join(text), data)
    print("\n".join(text), flush=True)
    return data


def _run_plan(plan, names, steps, timeout) -> dict:
    """{model prefix + variant: [per-round task results] or {"failed": ...}}."""
    runs: dict = {}
    with SlowLink() as link:
        print(f"slow_link: namespaces {link.namespaces} joined by {RATE} veth "
              f"{ADDRESSES[0]} <-> {ADDRESSES[1]}", flush=True)
        for prefix, model_epochs, model_rounds in plan:
            width = MODELS[prefix][1]
            for round_ in range(model_rounds):
                for name in names if round_ % 2 == 0 else names[::-1]:
                    key = prefix + name
                    if isinstance(runs.get(key), dict):
                        continue  # failed before
                    print(f"slow_link: {MODELS[prefix][0]}: {name} (round {round_ + 1}/"
                          f"{model_rounds}) ...", flush=True)
                    try:
                        values = run_tasks(link_task, VARIANTS[name], model_epochs, steps,
                                           width, workers=2, timeout=timeout,
                                           cluster=link.cluster(), wrap=link.wrap)
                    except Exception as error:
                        text = str(error).strip()
                        runs[key] = {"failed": f"{type(error).__name__}: "
                                     f"{text.splitlines()[0][:300] if text else ''}",
                                     "output_tail": text[-1500:]}
                        print(f"slow_link: {key}: FAILED: {runs[key]['failed']}", flush=True)
                        continue
                    runs.setdefault(key, []).append(values)
                    print(f"slow_link: {key}: "
                          f"{statistics.median(values[0]['epoch_seconds']):.2f} s/epoch, "
                          f"{values[0]['wire_tx_bytes_per_step']:,.0f} B/step on the wire, "
                          f"test accuracy {values[0]['test_accuracy']:.3f}", flush=True)
    return runs


def _summarise(runs) -> dict:
    results = {}
    for key, rounds_ in runs.items():
        if isinstance(rounds_, dict):
            results[key] = rounds_
            continue
        every = [v for values in rounds_ for v in values]  # every worker of every round
        last = rounds_[-1][0]
        results[key] = {
            "epoch_seconds": statistics.median(
                t for values in rounds_ for t in values[0]["epoch_seconds"]),
            "wire_tx_bytes_per_step": statistics.mean(v["wire_tx_bytes_per_step"]
                                                      for v in every),
            "wire_max_step_bytes": max(v["wire_max_step_bytes"] for v in every),
            "payload_bytes_per_step": last["payload_bytes_per_step"],
            "payload_max_step_bytes": last["payload_max_step_bytes"],
            "payload_counted": last["payload_counted"],
            "gradient_bytes": last["gradient_bytes"],
            "final_loss": last["loss"][-1],
            "test_accuracy": last["test_accuracy"],
            "runs": rounds_}
    return results


def _rows(plan, names, results) -> list:
    rows = [["model", "variant", "s/epoch", "vs sync", "vs local floor",
             "counted B/step", "wire B/step/worker", "wire vs sync",
             "largest step: counted / wire B", "final loss", "test accuracy"]]
    for prefix, _, _ in plan:
        label = MODELS[prefix][0]
        sync = results.get(prefix + "sync", {})
        floor = results.get(prefix + "local", {}).get("epoch_seconds")
        for name in names:
            r = results.get(prefix + name, {"failed": "not run"})
            if "epoch_seconds" not in r:
                rows.append([label, name, f"failed: {r['failed']}"] + [""] * 8)
                continue
            payload = f"{r['payload_bytes_per_step']:,.0f}" + (
                "" if r["payload_counted"] else " (gradient)")
            vs_sync = (f"**{sync['epoch_seconds'] / r['epoch_seconds']:.2f}x**"
                       if "epoch_seconds" in sync else "-")
            wire_vs = (f"{sync['wire_tx_bytes_per_step'] / r['wire_tx_bytes_per_step']:.0f}x"
                       if "epoch_seconds" in sync else "-")
            rows.append([label, name, f"{r['epoch_seconds']:.2f}", vs_sync,
                         f"{r['epoch_seconds'] / floor:.2f}x" if floor else "-", payload,
                         f"{r['wire_tx_bytes_per_step']:,.0f}", f"**{wire_vs}** less",
                         f"{r['payload_max_step_bytes']:,.0f} / {r['wire_max_step_bytes']:,.0f}",
                         f"{r['final_loss']:.3f}", f"{100 * r['test_accuracy']:.1f}%"])
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
