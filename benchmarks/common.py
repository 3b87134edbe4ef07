"""Shared benchmark plumbing: interleaved timing, machine facts, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def machine_info() -> dict:
    """Machine and versions, recorded next to every result."""
    info = {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import keras
        import tensorflow as tf

        info.update(tensorflow=tf.__version__, keras=keras.__version__)
    except ImportError:
        pass
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except ImportError:
        info["horovod"] = None
    return info


def interleaved_medians(candidates: dict, rounds: int, repeats: int) -> dict:
    """Times each callable ``repeats`` times per round, alternating candidates every
    round so machine noise hits all of them alike. Returns the median seconds per call."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            samples[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(values) for name, values in samples.items()}


def markdown_table(rows: list[list]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in body]
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2))
