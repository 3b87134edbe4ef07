"""Which engine moves a multi-process strategy's tensors: TF collectives or Horovod.

Measured on 2 processes of one 2-core host (benchmarks/RESULTS.md, "Engines in fit";
``python -m benchmarks.engines``): a ``fit`` step with 32 MB of gradients took 163 ms with
``engine="tf"`` and 72 ms with ``engine="horovod"`` (0.44x; compute alone: 14 ms), and a
64 MB all-reduce 566 ms on TF's gRPC ring against 74 ms on Horovod/Gloo.
"""

from __future__ import annotations

import logging
import os

ENGINES = ("tf", "horovod", "auto")
ENV_VAR = "TFDIST_ENGINE"
logger = logging.getLogger("tfdist")
_logged = set()


def select_engine(engine: str, num_workers: int, on_gpus: bool, is_chief: bool = True) -> str:
    """The engine a strategy uses: ``engine`` itself, or the choice of ``"auto"``.

    The rule for ``"auto"``, from the figures in this module's docstring:

    - ``"horovod"`` when the job has several workers, the replicas are CPUs and
      Horovod is installed: its Gloo all-reduce made a ``fit`` step 0.44x as long.
    - ``"tf"`` otherwise: one worker needs no engine; on GPUs TF's NCCL collectives
      are not measured against Horovod's; without Horovod there is no choice.

    The environment variable ``TFDIST_ENGINE`` (``"tf"`` or ``"horovod"``), when set,
    replaces ``"auto"``'s choice for every strategy of the job. The choice is logged
    once, by the chief.

    Args:
        engine: ``"tf"``, ``"horovod"`` or ``"auto"``.
        num_workers: Processes in the job.
        on_gpus: Whether the replicas are GPUs.
        is_chief: Whether this process logs the choice.

    Raises:
        ValueError: ``engine`` or ``TFDIST_ENGINE`` is not an engine.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}. Received: engine={engine!r}")
    if engine != "auto":
        return engine
    override = os.environ.get(ENV_VAR)
    if override:
        if override not in ("tf", "horovod"):
            raise ValueError(f"{ENV_VAR} must be 'tf' or 'horovod'. Received: "
                             f"{ENV_VAR}={override!r}")
        chosen, why = override, f"{ENV_VAR}={override}"
    elif num_workers <= 1:
        return "tf"
    elif on_gpus:
        chosen, why = "tf", "the replicas are GPUs (NCCL)"
    elif not _horovod_installed():
        chosen, why = "tf", "Horovod is not installed (see docs/horovod.md)"
    else:
        chosen, why = "horovod", "Gloo's all-reduce is faster than TF's gRPC ring on CPUs"
    key = (chosen, num_workers, on_gpus)
    if is_chief and key not in _logged:
        _logged.add(key)
        logger.info("engine='auto' chose %r for %d workers: %s (see tfdist.comm.engines).",
                    chosen, num_workers, why)
    return chosen


def _horovod_installed() -> bool:
    from tfdist.comm import horovod

    return horovod.is_available()
