"""``python -m benchmarks``: every section, then RESULTS.md (see docs/benchmarks.md)."""

import sys

from benchmarks.runner import build_parser, main

sys.exit(main(build_parser().parse_args()))
