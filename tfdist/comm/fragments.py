"""Fragments of a model (Streaming DiLoCo): the variables split in order into parts of
about equal bytes, each averaged at its own step of the period.

A fragment is a list of *pieces*: a `Piece` is a block of rows (along axis 0) of one
variable, or the whole variable. A variable larger than what is left of a fragment's
share of the bytes is cut into row blocks, so one dominant variable (a large dense
kernel) does not make one fragment hold most of the model.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple


class Piece(NamedTuple):
    """Rows ``start:stop`` (axis 0) of variable number ``variable`` (of ``rows``)."""

    variable: int
    start: int
    stop: int
    rows: int

    @property
    def whole(self) -> bool:
        """Whether the piece is the whole variable (then it is not sliced)."""
        return self.start == 0 and self.stop == self.rows


def variable_rows(shape) -> int:
    """The rows a variable of ``shape`` may be cut into: its axis 0 (1 for a scalar)."""
    shape = list(shape)
    return int(shape[0]) if shape and shape[0] else 1


def split_fragments(sizes: list, count: int, rows: list | None = None) -> list:
    """Splits variables, in order, into ``count`` contiguous fragments of about equal bytes.

    A fragment ends at the cut point (between two variables, or between two rows of a
    variable) whose running total of bytes is closest to ``(k + 1) / count`` of the
    total (ties: the earlier point), leaving at least one point to each later fragment.

    Args:
        sizes: Each variable's size in bytes, in layer order.
        count: The number of fragments (1 <= count <= len(sizes)).
        rows: Each variable's rows along axis 0 (`variable_rows`); a variable of one
            row (or a scalar) is never cut. Default: no variable is cut.

    Returns:
        ``count`` non-empty lists of `Piece`, in order; every row of every variable is
        in exactly one piece.

    Raises:
        ValueError: ``count`` is below 1 or above the number of variables.
    """
    if not 1 <= count <= len(sizes):
        raise ValueError("fragments must be between 1 and the number of trainable "
                         f"variables ({len(sizes)}). Received: fragments={count}")
    rows = [1] * len(sizes) if rows is None else [max(1, int(r)) for r in rows]
    prefix, first = [0], [0]  # bytes before, and first cut point of, each variable
    for size, row_count in zip(sizes, rows):
        prefix.append(prefix[-1] + int(size))
        first.append(first[-1] + row_count)
    points = first[-1]  # cut points 0 .. points (point p: row p - first[i] of variable i)

    def offset(point):
        i = min(bisect.bisect_right(first, point) - 1, len(sizes))
        if i == len(sizes):
            return prefix[-1]
        return prefix[i] + (point - first[i]) * int(sizes[i]) / rows[i]

    total = prefix[-1]
    cuts = [0]
    for k in range(1, count):
        low, high = cuts[-1] + 1, points - (count - k)
        target = total * k / count
        below = bisect.bisect_right(range(points + 1), target, key=offset) - 1
        options = {min(max(p, low), high) for p in (below, below + 1)}
        cuts.append(min(options, key=lambda p: (abs(offset(p) - target), p)))
    cuts.append(points)
    fragments = []
    for a, b in zip(cuts, cuts[1:]):
        fragment = []
        for i, row_count in enumerate(rows):
            start, stop = max(a, first[i]) - first[i], min(b, first[i + 1]) - first[i]
            if start < stop:
                fragment.append(Piece(i, start, stop, row_count))
        fragments.append(fragment)
    return fragments


def fragment_offset(fragment: int, period: int, fragments: int) -> int:
    """The step of each period (after the warm-up) at which ``fragment`` averages."""
    return fragment * period // fragments
