"""Tensor parallelism: split variables, how split layers run, their checks."""
