"""Tensor parallelism (issue #34): the hybrid CNN and a transformer block, split against
replicated, on the same workers.

    .venv/bin/python -m benchmarks.tensor_parallel [--quick] [--output DIR]
                                                   [--engine horovod|tf]

At m = 2 and 4 worker processes on 127.0.0.1 (one replica each: m is the "model" axis),
two launches run side by side: `tfdist.MultiWorkerModelParallelStrategy` and
`tfdist.MultiWorkerMirroredStrategy` (pure data parallelism). In each, every worker
trains (`benchmarks.tp_workloads`):

1. the seeds' hybrid CNN on scikit-learn's digits: convolutions data-parallel, a head
   ``head_up`` 512 -> 4096 (column) and ``head_down`` 4096 -> 4096 (row) split over
   "model", from the same initial weights on the same global batches for the same
   epochs. Measured: ``bytes_communicated`` per step, each worker's elements of the
   head's split variables, the test accuracy (261 held-out digits) after each epoch;
2. a transformer block (MultiHeadAttention split by heads, a feed-forward pair): bytes
   per step against Megatron-LM's formula for the same B, sequence, width and m, the
   median step time against the same block replicated, and each worker's bytes of the
   split layers' parameters.

Ring bytes are computed from the collectives each strategy runs (an all-reduce of S
sends 2(m-1)/m S per worker in a ring, an all-gather of the whole S or a reduce-scatter
of S (m-1)/m S); the counted bytes are measured (``bytes_communicated``).
"""

from __future__ import annotations

import sys

from benchmarks.common import (engine_section_args, machine_info, markdown_table, pyplot,
                               run_tasks, save_figure, write_section)
from benchmarks.tp_workloads import worker_task

NAME = "tensor_parallel"
TITLE = "Tensor parallelism: the hybrid CNN and a transformer block, split against replicated"
FLAT = 512  # the hybrid CNN's flattened features, head_up's input


def settings(quick: bool) -> dict:
    if quick:
        return {"head_width": 64, "train_rows": 64, "epochs": 1, "cnn_batch": 32,
                "learning_rate": 0.03, "seq": 8, "width": 16, "heads": 4,
                "block_batch": 8, "warmup": 0, "steps": 2, "workers": (2,)}
    return {"head_width": 4096, "train_rows": 1536, "epochs": 4, "cnn_batch": 64,
            "learning_rate": 0.03, "seq": 64, "width": 256, "heads": 8,
            "block_batch": 16, "warmup": 2, "steps": 10, "workers": (2, 4)}


def hybrid_bytes(config: dict, m: int, replicated: int, split: bool) -> dict:
    """Per worker and step, counted (tfdist's convention: an all-gather what the worker
    contributes, a reduce-scatter or all-reduce its whole payload) and in a ring.
    Split: the head's input rows gathered (b x 512) and their gradient reduce-scattered
    (B x 512), head_down's partial sums reduce-scattered (B x W) and their gradient's
    rows gathered (b x W); the ``replicated`` trainable elements' gradients all-reduced
    (all of them when not split)."""
    big_b, width, share = config["cnn_batch"], config["head_width"], (m - 1) / m
    if not split:
        return {"counted": 4 * replicated, "ring": 2 * share * 4 * replicated}
    rows = big_b * (FLAT + width)  # gathered and reduce-scattered, once each way
    return {"counted": 4 * (rows / m + rows + replicated),
            "ring": share * 4 * 2 * rows + 2 * share * 4 * replicated}


def block_bytes(config: dict, m: int, replicated: int) -> dict:
    """The split block per worker and step (counted and ring), and Megatron-LM's
    formula: two all-reduces of B x seq x width forward and two backward."""
    tokens = config["block_batch"] * config["seq"] * config["width"]  # B s h
    share = (m - 1) / m
    # Attention and feed-forward: rows in gathered, partial sums out reduce-scattered,
    # then backward their gradient's rows gathered and the input's gradient scattered.
    return {"counted": 4 * (2 * (2 * tokens / m + 2 * tokens) + replicated),
            "ring": 4 * (2 * 4 * share * tokens + 2 * share * replicated),
            "megatron_counted": 4 * 4 * tokens,
            "megatron_ring": 4 * 4 * 2 * share * tokens}


def measure(engine: str, config: dict) -> dict:
    runs, summary = {}, {}
    for m in config["workers"]:
        for mode in ("replicated", "split"):
            print(f"{NAME}: {m} workers, {mode} ({engine})", flush=True)
            runs[f"{m}/{mode}"] = run_tasks(worker_task, mode, engine, config, workers=m,
                                            timeout=1800)
        summary[str(m)] = _summarize(config, m, runs[f"{m}/replicated"], runs[f"{m}/split"])
        print(f"{NAME}: {m} workers: {summary[str(m)]['headline']}", flush=True)
    return {"runs": runs, "summary": summary}


def _summarize(config: dict, m: int, plain: list, split: list) -> dict:
    dp, tp = plain[0]["hybrid"], split[0]["hybrid"]
    dp_bytes = hybrid_bytes(config, m, dp["replicated_elements"], split=False)
    tp_bytes = hybrid_bytes(config, m, tp["replicated_elements"], split=True)
    held = max(r["hybrid"]["split_elements_held"] for r in split)
    hybrid = {
        "dp_bytes_per_step": dp["bytes_per_step"], "split_bytes_per_step": tp["bytes_per_step"],
        "dp_expected": dp_bytes, "split_expected": tp_bytes,
        # The counter against the collectives listed in hybrid_bytes (its ring bytes hold
        # only if these are true).
        "counter_matches_collectives": [dp["bytes_per_step"] == dp_bytes["counted"],
                                        tp["bytes_per_step"] == tp_bytes["counted"]],
        "counted_ratio": tp["bytes_per_step"] / dp["bytes_per_step"],
        "ring_ratio": tp_bytes["ring"] / dp_bytes["ring"],
        "split_elements_held": held, "split_elements_whole": tp["split_elements_whole"],
        "split_held_times_m": held * m / tp["split_elements_whole"],
        "head_held_times_m": max(r["hybrid"]["head_elements_held"] for r in split) * m
        / tp["head_elements_whole"],
        "dp_accuracy": dp["test_accuracy"], "split_accuracy": tp["test_accuracy"],
        "accuracy_gap_points": abs(dp["test_accuracy"][-1] - tp["test_accuracy"][-1]) * 100,
        "step_ratio": tp["step_seconds"] / dp["step_seconds"],
        "parameters": tp["parameters"]}
    bdp, btp = plain[0]["block"], split[0]["block"]
    expected = block_bytes(config, m, btp["replicated_elements"])
    block = {
        "split_bytes_per_step": btp["bytes_per_step"], "expected": expected,
        "counter_matches_collectives": btp["bytes_per_step"] == expected["counted"],
        "replicated_bytes_per_step": bdp["bytes_per_step"],
        "measured_over_megatron": btp["bytes_per_step"] / expected["megatron_counted"],
        "ring_over_megatron": expected["ring"] / expected["megatron_ring"],
        "step_ratio": btp["step_seconds"] / bdp["step_seconds"],
        "split_step_seconds": btp["step_seconds"], "replicated_step_seconds":
        bdp["step_seconds"],
        "split_layer_bytes_held": max(r["block"]["split_layer_bytes_held"] for r in split),
        "split_layer_bytes_whole": btp["split_layer_bytes_whole"]}
    block["held_times_m"] = block["split_layer_bytes_held"] * m / block["split_layer_bytes_whole"]
    headline = (f"hybrid bytes {hybrid['counted_ratio']:.3f}x data parallelism, accuracy "
                f"{tp['test_accuracy'][-1]:.4f} vs {dp['test_accuracy'][-1]:.4f}; block "
                f"bytes {block['measured_over_megatron']:.2f}x Megatron, step "
                f"{block['step_ratio']:.2f}x replicated")
    return {"hybrid": hybrid, "block": block, "headline": headline}


def goal_values(data: dict, quick: bool) -> dict:
    """The figures docs/benchmarks.md's ``tp-*`` goals are checked on (`benchmarks.goals`)."""
    if quick:
        return {"goal_values_missing": "a --quick run (small models)"}
    s = data["summary"]
    return {"goal_values": {
        "tp-wire": {**{f"{m} workers: counted bytes": r["hybrid"]["counted_ratio"]
                       for m, r in s.items()},
                    **{f"{m} workers: ring bytes": r["hybrid"]["ring_ratio"]
                       for m, r in s.items()}},
        "tp-head": {f"{m} workers: head split elements x m": r["hybrid"]["split_held_times_m"]
                    for m, r in s.items()},
        "tp-accuracy": {f"{m} workers: test accuracy gap (points)":
                        r["hybrid"]["accuracy_gap_points"] for m, r in s.items()},
        "tp-block-params": {f"{m} workers: split layers' bytes x m": r["block"]["held_times_m"]
                            for m, r in s.items()},
    }}


def _plot(out, config: dict, summary: dict) -> None:
    plt = pyplot()
    fig, (wire, acc, block) = plt.subplots(1, 3, figsize=(13, 4))
    ms = list(summary)
    xs = range(len(ms))
    dp = [summary[m]["hybrid"]["dp_bytes_per_step"] / 1e6 for m in ms]
    tp = [summary[m]["hybrid"]["split_bytes_per_step"] / 1e6 for m in ms]
    wire.bar([x - 0.2 for x in xs], dp, 0.4, label="data parallel")
    wire.bar([x + 0.2 for x in xs], tp, 0.4, label="hybrid (head split)")
    wire.set(xticks=list(xs), xticklabels=[f"m = {m}" for m in ms], yscale="log",
             ylabel="MB counted per worker and step", title="Hybrid CNN: bytes per step")
    wire.legend(loc="center")
    for m in ms:
        h = summary[m]["hybrid"]
        epochs = range(1, len(h["dp_accuracy"]) + 1)
        acc.plot(epochs, h["dp_accuracy"], marker="o", label=f"data parallel, m = {m}")
        acc.plot(epochs, h["split_accuracy"], marker="x", linestyle="--",
                 label=f"hybrid, m = {m}")
    acc.set(xlabel="epoch", ylabel="test accuracy (261 digits)", title="Hybrid CNN: accuracy",
            xticks=list(epochs))
    acc.legend(fontsize=8)
    bars = {"bytes / Megatron (counted)": "measured_over_megatron",
            "ring bytes / Megatron ring": "ring_over_megatron",
            "step time / replicated": "step_ratio", "split layers' bytes x m": "held_times_m"}
    for i, (label, key) in enumerate(bars.items()):
        block.bar([x + (i - 1.5) * 0.2 for x in xs], [summary[m]["block"][key] for m in ms],
                  0.2, label=label)
    block.axhline(1, color="grey", linewidth=0.8)
    block.set(xticks=list(xs), xticklabels=[f"m = {m}" for m in ms], ylabel="ratio",
              title=f"Transformer block\n(B={config['block_batch']}, seq={config['seq']}, "
                    f"width={config['width']})")
    block.legend(fontsize=8)
    save_figure(fig, out / f"{NAME}.png")


def report(engine: str, config: dict, summary: dict) -> str:
    mb = 1e6
    hybrid = [["m", "DP counted / step (MB)", "hybrid counted / step (MB)", "counted ratio",
               "ring ratio", "head split elements x m", "whole head x m", "test accuracy DP",
               "test accuracy hybrid", "gap (points)", "step time hybrid / DP"]]
    block = [["m", "split counted / step (MB)", "Megatron formula (MB)", "measured / formula",
              "ring / Megatron ring", "replicated counted / step (MB)",
              "step split (ms)", "step replicated (ms)", "step ratio", "split layers' bytes x m"]]
    for m, s in summary.items():
        h, b = s["hybrid"], s["block"]
        hybrid.append([m, f"{h['dp_bytes_per_step'] / mb:.2f}",
                       f"{h['split_bytes_per_step'] / mb:.3f}", f"{h['counted_ratio']:.3f}",
                       f"{h['ring_ratio']:.3f}", f"{h['split_held_times_m']:.3f}",
                       f"{h['head_held_times_m']:.3f}", f"{h['dp_accuracy'][-1]:.4f}",
                       f"{h['split_accuracy'][-1]:.4f}", f"{h['accuracy_gap_points']:.2f}",
                       f"{h['step_ratio']:.2f}"])
        block.append([m, f"{b['split_bytes_per_step'] / mb:.3f}",
                      f"{b['expected']['megatron_counted'] / mb:.3f}",
                      f"{b['measured_over_megatron']:.3f}", f"{b['ring_over_megatron']:.3f}",
                      f"{b['replicated_bytes_per_step'] / mb:.3f}",
                      f"{b['split_step_seconds'] * 1e3:.0f}",
                      f"{b['replicated_step_seconds'] * 1e3:.0f}", f"{b['step_ratio']:.2f}",
                      f"{b['held_times_m']:.3f}"])
    first = next(iter(summary.values()))["hybrid"]
    return "\n".join([
        f"# {TITLE}", "", f"Command: `.venv/bin/python -m benchmarks.{NAME}`", "",
        f"Engine `{engine}`; m worker processes of one replica each, "
        "`MultiWorkerModelParallelStrategy` against `MultiWorkerMirroredStrategy` on the "
        "same workers, data and initial weights.", "",
        f"**Hybrid CNN** on scikit-learn's digits ({config['train_rows']} train, 261 test): "
        "conv 16, pool, "
        f"conv 32, head_up {FLAT} -> {config['head_width']} (column), head_down "
        f"{config['head_width']} -> {config['head_width']} (row), 10 logits; "
        f"{first['parameters'] / 1e6:.1f} M parameters; SGD "
        f"{config['learning_rate']} momentum 0.9, global batch {config['cnn_batch']}, "
        f"{config['epochs']} epochs. Counted: `bytes_communicated` per step (measured); "
        "ring: the same collectives' ring bytes, computed. Head split elements: each "
        "worker's elements of head_up/kernel, head_up/bias and head_down/kernel (whole "
        "head: with head_down's bias, whole on every worker).", "",
        markdown_table(hybrid), "",
        f"**Transformer block**: an input Dense, MultiHeadAttention ({config['heads']} heads, "
        f"split by heads), add & LayerNorm, feed-forward {config['width']} -> "
        f"{4 * config['width']} -> {config['width']} (column/row), add & LayerNorm; "
        f"B = {config['block_batch']}, seq = {config['seq']}, width = {config['width']}; "
        f"median of {config['steps']} steps. Megatron-LM's formula: 4 all-reduces of "
        "B x seq x width floats per layer (counted as payloads, or 2(m-1)/m of each in a "
        "ring). Measured counts add what runs data-parallel here (the replicated weights' "
        "gradients) and count an all-gather as the rows a worker contributes.", "",
        markdown_table(block), "", f"![plots]({NAME}.png)", ""])


def main(argv=None) -> dict:
    args = engine_section_args(NAME, __doc__, argv)
    engine = args.engine
    config = settings(args.quick)
    data = {"machine": machine_info(), "engine": engine, "settings": config,
            **measure(engine, config)}
    data.update(goal_values(data, args.quick))
    _plot(args.output, config, data["summary"])
    markdown = report(engine, config, data["summary"])
    write_section(args.output, NAME, markdown, data)
    print(markdown)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
