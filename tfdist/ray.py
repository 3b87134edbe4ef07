"""The public ``tfdist.ray`` module: run a function as a tfdist job on Ray actors
(`tfdist.runners.ray`)."""

from tfdist.runners.ray import connect, run

__all__ = ["connect", "run"]
