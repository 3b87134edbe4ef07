"""The main job's report: plain text tables, the topology in words, the history plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def format_table(rows: list[tuple]) -> str:
    """A plain text table, first row the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plural(count: int, word: str) -> str:
    """``1 replica``, ``2 replicas``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def describe_topology(report: dict[str, Any]) -> str:
    """``2 replicas``, ``4 replicas on 2 workers``, ``2 workers, 1 parameter server``."""
    workers, ps = report.get("workers", 1), report.get("ps", 0)
    if ps:
        return f"{plural(workers, 'worker')}, {plural(ps, 'parameter server')}"
    text = plural(report["num_replicas"], "replica")
    return text + (f" on {plural(workers, 'worker')}" if workers > 1 and
                   workers != report["num_replicas"] else "")


def plot_history(report: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch, training and validation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = report["history"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        for key, style in ((metric, "-o"), (f"val_{metric}", "--s")):
            if key in history:
                ax.plot(range(1, len(history[key]) + 1), history[key], style, label=key,
                        markersize=4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.suptitle(f"{report.get('name', 'config')}: {report['strategy']}, "
                 f"{describe_topology(report)}")
    fig.tight_layout()
    fig.savefig(path, dpi=80, format="png")
    plt.close(fig)
