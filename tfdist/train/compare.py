"""``tfdist compare CONFIG...``: runs each config, then one table and one plot side by
side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tfdist.train.report import describe_topology, format_table


def compare_main(args) -> int:
    """``tfdist compare``: runs each config, then one table and one plot side by side."""
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for index, config_file in enumerate(args.configs):
        run_dir = out / f"{index}-{Path(config_file).stem}"
        command = [sys.executable, "-m", "tfdist.cli", "train", config_file,
                   "--set", f"train.output_dir={json.dumps(str(run_dir))}",
                   *sum((["--set", s] for s in args.set), [])]
        print(f"tfdist compare: [{index + 1}/{len(args.configs)}] {config_file}", flush=True)
        if subprocess.run(command).returncode:
            print(f"tfdist compare: {config_file} failed", file=sys.stderr)
            return 1
        report = json.loads((run_dir / "report.json").read_text())
        report["name"] = Path(config_file).stem
        reports.append(report)
    rows = [("config", "strategy", "topology", "val_accuracy", "loss", "time (s)",
             "bytes communicated")]
    for r in reports:
        rows.append((r["name"], r["strategy"], describe_topology(r),
                     f"{r['final'].get('val_accuracy', float('nan')):.4f}",
                     f"{r['final'].get('loss', float('nan')):.4f}",
                     f"{r['wall_time_seconds']:.1f}", f"{r['bytes_communicated']:,}"))
    table = format_table(rows)
    print(table)
    summary = [{k: r.get(k) for k in ("name", "strategy", "num_replicas", "workers", "ps",
                                      "final", "wall_time_seconds", "bytes_communicated",
                                      "history")}
               for r in reports]
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    (out / "compare.md").write_text(
        "```\n" + table + "\n```\n\nbytes communicated: gradients all-reduced (mirrored, "
        "multi-worker, Horovod), weights averaged (model average), or nothing counted "
        "(parameter server: workers push gradients to the ps).\n")
    plot_compare(summary, out / "compare.png")
    print(f"tfdist compare: wrote {out / 'compare.json'}, {out / 'compare.md'} and "
          f"{out / 'compare.png'}")
    return 0


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")


def coinciding(curves: dict[str, list[float]], atol: float = 1e-6) -> list[list[str]]:
    """Groups of names whose curves are the same (same length, values within ``atol``)."""
    groups: list[list[str]] = []
    for name, curve in curves.items():
        for group in groups:
            other = curves[group[0]]
            if len(other) == len(curve) and all(abs(a - b) <= atol
                                                for a, b in zip(other, curve)):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def plot_compare(summary: list[dict], path: Path) -> None:
    """Validation accuracy per epoch, and final accuracy against bytes and time.

    Each config has its own marker and line style, and smaller markers are drawn over
    larger ones, so identical curves stay visible; a note names the configs whose
    curves coincide.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric = "val_accuracy" if all(r["history"].get("val_accuracy") for r in summary) \
        else "accuracy"
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    curves = {}
    for index, r in enumerate(summary):
        curve = r["history"].get(metric, [])
        curves[r["name"]] = curve
        style = dict(marker=_MARKERS[index % len(_MARKERS)], label=r["name"],
                     markersize=9 - 1.5 * (index % 4), fillstyle="none" if index % 2 else "full")
        axes[0].plot(range(1, len(curve) + 1), curve, linestyle=_LINES[index % len(_LINES)],
                     **style)
        accuracy = r["final"].get(metric, 0.0)
        style.pop("label")
        axes[1].plot(max(r["bytes_communicated"], 1), accuracy, linestyle="none",
                     label=r["name"], **style)
        axes[2].plot(r["wall_time_seconds"], accuracy, linestyle="none", label=r["name"],
                     **style)
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set(xlabel="epoch", ylabel=metric, title=f"{metric} per epoch")
    sent = [max(r["bytes_communicated"], 1) for r in summary]
    log = max(sent) >= 10 * min(sent)  # a log axis over a narrow range shows no labels
    axes[1].set(xlabel="bytes communicated" + (" (log)" if log else ""),
                ylabel=f"final {metric}", xscale="log" if log else "linear",
                title=f"{metric} vs bytes communicated")
    axes[2].set(xlabel="wall time (s)", ylabel=f"final {metric}",
                title=f"{metric} vs time")
    notes = [" = ".join(group) + ": identical curves" for group in coinciding(curves)]
    if notes:
        axes[0].set_xlabel("epoch\n" + "\n".join(notes), fontsize=8)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
