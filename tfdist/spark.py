"""The public ``tfdist.spark`` module: run a function as a tfdist job in a Spark barrier
stage (`tfdist.runners.spark`)."""

from tfdist.runners.spark import MAX_RESULT_BYTES, cuda_visible_devices, run, session

__all__ = ["MAX_RESULT_BYTES", "cuda_visible_devices", "run", "session"]
