"""Fragments of a model (Streaming DiLoCo): variables split in order into parts of
about equal bytes, each averaged at its own step of the period."""

from __future__ import annotations


def split_fragments(sizes: list, count: int) -> list:
    """Splits variables, in order, into ``count`` contiguous fragments of about equal bytes.

    Args:
        sizes: Each variable's size in bytes, in layer order.
        count: The number of fragments (1 <= count <= len(sizes)).

    Returns:
        ``count`` non-empty lists of variable indices, in order; fragment ``k`` ends
        where the running total of bytes is closest to ``(k + 1) / count`` of the total.

    Raises:
        ValueError: ``count`` is below 1 or above the number of variables.
    """
    if not 1 <= count <= len(sizes):
        raise ValueError("fragments must be between 1 and the number of trainable "
                         f"variables ({len(sizes)}). Received: fragments={count}")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + int(size))
    total = prefix[-1]
    cuts = [0]
    for k in range(1, count):
        target = total * k / count
        # Leave at least one variable for each later fragment.
        options = range(cuts[-1] + 1, len(sizes) - (count - k) + 1)
        cuts.append(min(options, key=lambda i: (abs(prefix[i] - target), i)))
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def fragment_offset(fragment: int, period: int, fragments: int) -> int:
    """The step of each period (after the warm-up) at which ``fragment`` averages."""
    return fragment * period // fragments
