"""Benchmarks of the source checkout (not in the wheel): `python -m benchmarks`.

Ratios measured side by side in one run; see docs/benchmarks.md and RESULTS.md.
"""
