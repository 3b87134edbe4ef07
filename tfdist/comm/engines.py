"""Which engine moves a multi-process strategy's tensors: TF collectives or Horovod.

Measured on 2 processes of one 2-core host (benchmarks/RESULTS.md, "Engines in fit";
``python -m benchmarks.engines``): a ``fit`` step with 32 MB of gradients took 163 ms with
``engine="tf"`` and 72 ms with ``engine="horovod"`` (0.44x; compute alone: 14 ms), and a
64 MB all-reduce 566 ms on TF's gRPC ring against 74 ms on Horovod/Gloo.
"""

from __future__ import annotations

import logging

ENGINES = ("tf", "horovod", "auto")
logger = logging.getLogger("tfdist")
_logged = set()


def select_engine(engine: str, num_workers: int, on_gpus: bool) -> str:
    """The engine a strategy uses: ``engine`` itself, or the choice of ``"auto"``.

    The rule for ``"auto"``: ``"tf"``. TF's engine is the one whose faults tfdist
    names (a worker that never joins, a frozen or killed peer: docs/faults.md); the
    Horovod engine is 2-4x faster on CPU hosts (see this module's docstring) but a
    missing or frozen rank ends in Gloo's timeout abort. Ask for it with
    ``engine="horovod"``.

    Args:
        engine: ``"tf"``, ``"horovod"`` or ``"auto"``.
        num_workers: Processes in the job.
        on_gpus: Whether the replicas are GPUs.

    Raises:
        ValueError: ``engine`` is not one of `ENGINES`.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}. Received: engine={engine!r}")
    if engine != "auto":
        return engine
    chosen = "tf"
    key = (num_workers, on_gpus)
    if num_workers > 1 and key not in _logged:
        _logged.add(key)
        logger.info("engine='auto' chose %r for %d workers on %s (engine='horovod' is "
                    "faster on CPU hosts; see tfdist.comm.engines).", chosen, num_workers,
                    "GPUs" if on_gpus else "CPUs")
    return chosen
