"""The vocabulary of `tfdist.strategies.options.pairs`: launch modes and the two decisions
(`Composes`, `Refused`). Data only; imports nothing from TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Launch modes.
ELASTIC = "elastic"  # tfdist launch --min-workers
MULTI_NODE = "multi_node"  # tfdist launch --nnodes / cluster.mode = "nodes"
SPARK = "spark"  # tfdist.spark.run / cluster.mode = "spark"
RAY = "ray"  # tfdist.ray.run / cluster.mode = "ray"
MAX_RESTARTS = "max_restarts"  # tfdist launch --max-restarts N > 0
MODES = (ELASTIC, MULTI_NODE, SPARK, RAY, MAX_RESTARTS)
MODE_WORDS = {ELASTIC: "an elastic job (tfdist launch --min-workers)",
              MULTI_NODE: "a multi-node job (tfdist launch --nnodes)",
              SPARK: "a Spark job (tfdist.spark.run)", RAY: "a Ray job (tfdist.ray.run)",
              MAX_RESTARTS: "a job that restarts (tfdist launch --max-restarts)"}
# Strategies an elastic launch runs (with engine='horovod'; docs/elastic.md).
ELASTIC_STRATEGIES = ("multi_worker", "model_average")


@dataclass(frozen=True)
class Composes:
    """The pair works; ``tests`` are the node ids that show it (``tests/f.py::name``,
    ``[id]`` for one case of a parametrized test)."""

    tests: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Refused:
    """The pair is refused before anything runs, in one line.

    Attributes:
        reason: Why; for an (option, mode) pair the words after ``In <mode>, `` in the
            refusal (``{value!r}`` is the option's value).
        example: Values of the pair's option(s) that are refused.
        allowed: For an (option, mode) pair: values of the option that compose (the
            default always does).
    """

    reason: str
    example: Mapping[str, Any]
    allowed: tuple = ()
