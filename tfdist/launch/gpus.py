"""GPU pinning: which GPUs each task of this node gets in ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence

from tfdist.checks import check_int
from tfdist.cluster import TaskSpec

def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The node's GPUs, by the ids CUDA_VISIBLE_DEVICES would use. Does not import TF.

    CUDA_VISIBLE_DEVICES, if set, is the list (empty or ``-1``: none); otherwise
    ``nvidia-smi -L`` counts them, if it is installed; otherwise there are none.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = [i.strip() for i in environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
        return [] if not ids or ids[0].startswith("-") else ids
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(
        l for l in listing.splitlines() if l.startswith("GPU "))]


def assign_gpus(gpus: Sequence[str], ntasks: int,
                gpus_per_task: int | None = None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of ``ntasks`` tasks (None: leave it alone).

    Args:
        gpus: The node's GPU ids (`visible_gpus`); none means nothing is pinned.
        ntasks: Tasks on this node.
        gpus_per_task: GPUs each task gets, in order; default: ``len(gpus) // ntasks``
            (at least 1: with fewer GPUs than tasks, tasks share them round-robin).

    Raises:
        ValueError: ``gpus_per_task`` is not >= 1, or asks for more GPUs than the node has.
    """
    if gpus_per_task is not None:
        check_int("gpus_per_task", gpus_per_task, 1)
    if not gpus or ntasks < 1:
        return [None] * ntasks
    if gpus_per_task is None:
        if len(gpus) < ntasks:
            return [gpus[i % len(gpus)] for i in range(ntasks)]
        gpus_per_task = len(gpus) // ntasks
    if gpus_per_task * ntasks > len(gpus):
        raise ValueError(f"gpus_per_task={gpus_per_task} needs {gpus_per_task * ntasks} GPUs "
                         f"for {ntasks} task(s); this node has {len(gpus)} "
                         f"({','.join(gpus)})")
    return [",".join(gpus[i * gpus_per_task:(i + 1) * gpus_per_task]) for i in range(ntasks)]


def gpu_env(specs: Sequence[TaskSpec], environ: dict[str, str],
            gpus_per_task: int | None = None) -> dict[str, dict[str, str]]:
    """Task name -> ``{"CUDA_VISIBLE_DEVICES": ...}`` (empty without GPUs)."""
    pins = assign_gpus(visible_gpus(environ), len(specs), gpus_per_task)
    return {spec.name: ({} if pin is None else {"CUDA_VISIBLE_DEVICES": pin})
            for spec, pin in zip(specs, pins)}


def elastic_gpu_env(max_workers: int, environ: dict[str, str],
                    gpus_per_task: int | None = None):
    """Pins of an elastic job: the GPUs are split over ``max_workers`` worker slots (a
    worker cannot take more GPUs when others leave), and ``worker-k``, an added one
    included, takes slot ``k % max_workers``.

    Returns:
        A function: `TaskSpec` -> ``{"CUDA_VISIBLE_DEVICES": ...}`` (empty without GPUs).
    """
    slots = gpu_env([TaskSpec("worker", i) for i in range(max_workers)], environ,
                    gpus_per_task)
    return lambda spec: slots[f"worker-{spec.index % max_workers}"]
