"""From one layout to another on the same mesh, as collectives per mesh axis: the plan
(`plan`), written once for every pair of placements, and its numpy reference
(`run`), which applies it to the pieces group by group as the collectives would.

A layout's pieces are cut in its application order: the `Shard` axes in mesh order,
then the `Flat` axes. The axes both layouts cut alike, first in that order, are kept;
from the first difference the source's cuts are undone by all-gathers, innermost
first, and the target's made by local slices, outermost first. A `Partial` axis is
summed where the target cuts it (a reduce-scatter, in place of the slice) or by an
all-reduce where the target replicates it. Sums commute with the gathers and slices
(all are linear, and the replicas of one axis' group share every other position).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tfdist.layout.placement import Flat, Layout, Partial, Replicate, Shard

ALL_GATHER, SLICE, REDUCE_SCATTER, ALL_REDUCE, KEEP_FIRST = (
    "all_gather", "slice", "reduce_scatter", "all_reduce", "keep_first")
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)  # the ops that communicate


@dataclasses.dataclass(frozen=True)
class Step:
    """One op on mesh axis ``axis`` (its index), with the placement it undoes
    (`ALL_GATHER`) or makes (`SLICE`, `REDUCE_SCATTER`)."""

    op: str
    axis: int
    placement: object = None


def _cuts(layout: Layout) -> list[tuple[int, object]]:
    """``(axis, placement)`` of the axes that cut, in application order."""
    shards = [(i, p) for i, p in enumerate(layout.placements) if isinstance(p, Shard)]
    flats = [(i, p) for i, p in enumerate(layout.placements) if isinstance(p, Flat)]
    return shards + flats


def plan(source: Layout, target: Layout) -> list[Step]:
    """The steps that turn ``source``'s pieces into ``target``'s (same mesh).

    Raises:
        ValueError: the layouts are on different meshes (redistribute through the whole
            value: `tfdist.layout.redistribute`).
    """
    if source.mesh != target.mesh:
        raise ValueError(f"a plan moves pieces on one mesh. Received: {source.mesh} and "
                         f"{target.mesh}")
    before, after = _cuts(source), _cuts(target)
    common = 0
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    undone = reversed(before[common:])  # innermost first
    steps = [Step(ALL_GATHER, axis, placement) for axis, placement in undone]
    summed = {i for i, p in enumerate(source.placements)
              if isinstance(p, Partial) and not isinstance(target.placements[i], Partial)}
    for axis, placement in after[common:]:
        steps.append(Step(REDUCE_SCATTER if axis in summed else SLICE, axis, placement))
        summed.discard(axis)
    steps += [Step(ALL_REDUCE, axis) for axis in sorted(summed)]
    for axis, (was, becomes) in enumerate(zip(source.placements, target.placements)):
        if isinstance(becomes, Partial) and not isinstance(was, Partial):
            steps.append(Step(KEEP_FIRST, axis))
    return steps


def collectives(steps: list[Step]) -> int:
    """How many of ``steps`` communicate."""
    return sum(step.op in COLLECTIVES for step in steps)


def run(pieces: list, source: Layout, target: Layout, global_shape) -> list[np.ndarray]:
    """The numpy reference of `plan`: ``source``'s pieces (replica order) moved group
    by group into ``target``'s."""
    mesh, global_shape = source.mesh, tuple(global_shape)
    state = list(source.placements)
    pieces = [np.asarray(p) for p in pieces]
    for step in plan(source, target):
        if step.op == ALL_GATHER:
            state[step.axis] = Replicate()
            block = Layout(mesh, tuple(state)).block_shape(global_shape)
            pieces = _gather(pieces, mesh, step, block)
        elif step.op in (SLICE, REDUCE_SCATTER):
            if step.op == REDUCE_SCATTER:
                pieces = _sum(pieces, mesh, step.axis)
            block = Layout(mesh, tuple(state)).block_shape(global_shape)
            state[step.axis] = step.placement
            pieces = [_cut(p, mesh.position(r)[step.axis], mesh.shape[step.axis],
                           step.placement, block) for r, p in enumerate(pieces)]
        elif step.op == ALL_REDUCE:
            pieces = _sum(pieces, mesh, step.axis)
            state[step.axis] = Replicate()
        else:  # KEEP_FIRST: the first replica of the axis holds the sum, the others 0
            pieces = [p if mesh.position(r)[step.axis] == 0 else np.zeros_like(p)
                      for r, p in enumerate(pieces)]
            state[step.axis] = Partial()
    return pieces


def _groups(mesh, axis: int):
    return mesh.groups(mesh.axis_names[axis])


def _gather(pieces, mesh, step, block) -> list[np.ndarray]:
    out = list(pieces)
    for group in _groups(mesh, step.axis):
        parts = [pieces[r] for r in group]
        if isinstance(step.placement, Flat):
            whole = np.concatenate(parts)[:math.prod(block)].reshape(block)
        else:
            whole = np.concatenate(parts, axis=step.placement.dim)
        for r in group:
            out[r] = whole
    return out


def _sum(pieces, mesh, axis: int) -> list[np.ndarray]:
    out = list(pieces)
    for group in _groups(mesh, axis):
        total = sum(pieces[r] for r in group)
        for r in group:
            out[r] = total
    return out


def _cut(piece, index: int, parts: int, placement, block) -> np.ndarray:
    if isinstance(placement, Shard):
        return np.split(piece, parts, axis=placement.dim)[index].copy()
    size = max(1, math.ceil(math.prod(block) / parts))
    flat = np.pad(piece.reshape(-1), (0, size * parts - piece.size))
    return flat[index * size:(index + 1) * size].copy()
