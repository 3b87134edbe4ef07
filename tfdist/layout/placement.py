"""Placements (one per mesh axis) and a `Layout`, with the numpy reference of a value's
pieces: which piece each replica stores, the whole from the pieces, and a
redistribution to another layout on another mesh.

A layout's pieces are made axis by axis, in the mesh's axis order, as torch's DTensor
does: each `Shard(dim)` axis cuts the value so far into equal parts on ``dim``; a
`Flat` axis (at most one) then takes one padded 1/k slice of the flattened part (``k``:
its size), as fully sharded parameters and sharded optimizer slots store it; a
`Partial` axis holds partial sums, whose whole is their sum; a `Replicate` axis holds
the same piece on each of its replicas.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence, Union

import numpy as np

from tfdist.layout.mesh import Mesh


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every replica on the axis holds the same piece."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """The axis cuts the value into equal parts on dimension ``dim``."""

    dim: int


@dataclasses.dataclass(frozen=True)
class Flat:
    """The axis holds a 1/n slice of the flattened value, zero-padded to n equal slices."""


@dataclasses.dataclass(frozen=True)
class Partial:
    """The replicas on the axis hold partial sums; the value is their sum."""


Placement = Union[Replicate, Shard, Flat, Partial]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a value of some global shape is stored on a mesh: one placement per axis.

    Args:
        mesh: The `Mesh`.
        placements: One `Replicate`, `Shard`, `Flat` or `Partial` per mesh axis.

    Raises:
        ValueError: not one placement per axis, or not a placement.
    """

    mesh: Mesh
    placements: tuple

    def __post_init__(self):
        placements = tuple(self.placements)
        object.__setattr__(self, "placements", placements)
        if len(placements) != len(self.mesh.shape):
            raise ValueError(f"a Layout needs one placement per mesh axis "
                             f"{list(self.mesh.axis_names)}. Received: {placements}")
        for placement in placements:
            if not isinstance(placement, (Replicate, Shard, Flat, Partial)):
                raise ValueError(f"not a placement: {placement!r}")
        if sum(isinstance(p, Flat) for p in placements) > 1:
            raise ValueError(f"at most one mesh axis holds flat slices. Received: "
                             f"{placements}")

    # ---- making layouts ----------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: Mesh) -> "Layout":
        """Every replica holds the whole value."""
        return cls(mesh, (Replicate(),) * len(mesh.shape))

    @classmethod
    def from_axes(cls, mesh: Mesh, axes: Sequence[str | None]) -> "Layout":
        """The layout of a Keras ``TensorLayout``'s ``axes``: one entry per dimension of
        the value, a mesh axis name (that axis cuts this dimension) or None.

        Raises:
            ValueError: an axis name the mesh lacks, or one named twice.
        """
        placements = [Replicate()] * len(mesh.shape)
        for dim, name in enumerate(axes):
            if name is None:
                continue
            axis = mesh.axis(name)
            if placements[axis] != Replicate():
                raise ValueError(f"mesh axis {name!r} cuts two dimensions. "
                                 f"Received: axes={tuple(axes)}")
            placements[axis] = Shard(dim)
        return cls(mesh, tuple(placements))

    @classmethod
    def from_keras(cls, tensor_layout) -> "Layout":
        """The layout of a Keras ``TensorLayout`` (read duck-typed: ``axes`` and
        ``device_mesh``)."""
        return cls.from_axes(Mesh.from_keras(tensor_layout.device_mesh),
                             tuple(tensor_layout.axes))

    def fully_sharded(self, name: str = "batch") -> "Layout":
        """This layout with axis ``name`` holding flat slices where it replicated (fully
        sharded parameters over a tensor-parallel layout, as FSDP2 prepends its
        placement to a TP parameter's); unchanged where that axis already cuts."""
        axis = self.mesh.axis(name)
        if self.placements[axis] != Replicate():
            return self
        placements = list(self.placements)
        placements[axis] = Flat()
        return Layout(self.mesh, tuple(placements))

    # ---- shapes and holders ------------------------------------------------------------
    def _axes_of(self, kind) -> list[int]:
        return [i for i, p in enumerate(self.placements) if isinstance(p, kind)]

    @property
    def flat_slices(self) -> int:
        """Into how many flat slices the `Flat` axis cuts the value (1: none)."""
        return math.prod(self.mesh.shape[i] for i in self._axes_of(Flat))

    def block_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The part of the value the `Shard` axes leave each replica (before `Flat`).

        Raises:
            ValueError: a dimension does not split evenly, or a `Shard` names a
                dimension the value lacks.
        """
        shape = list(global_shape)
        for axis in self._axes_of(Shard):
            dim, parts = self.placements[axis].dim, self.mesh.shape[axis]
            if not 0 <= dim < len(shape):
                raise ValueError(f"Shard({dim}) on mesh axis {self.mesh.axis_names[axis]!r}"
                                 f" needs a value of more than {dim} dimensions. "
                                 f"Received: shape {tuple(global_shape)}")
            if shape[dim] % parts:
                raise ValueError(
                    f"dimension {dim} ({shape[dim]} so far) does not split evenly over the "
                    f"{parts} replicas of mesh axis {self.mesh.axis_names[axis]!r}. "
                    f"Received: shape {tuple(global_shape)}, {self}")
            shape[dim] //= parts
        return tuple(shape)

    def local_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the piece each replica stores."""
        block = self.block_shape(global_shape)
        if not self._axes_of(Flat):
            return block
        return (max(1, math.ceil(math.prod(block) / self.flat_slices)),)

    def holders(self) -> int:
        """How many replicas store each piece (the `Replicate` axes' sizes' product)."""
        return math.prod(self.mesh.shape[i] for i in self._axes_of(Replicate))

    # ---- the numpy reference -----------------------------------------------------------
    def _block_index(self, position) -> tuple:
        return tuple(position[i] for i in self._axes_of(Shard))

    def _flat_index(self, position) -> int:
        index = 0
        for axis in self._axes_of(Flat):
            index = index * self.mesh.shape[axis] + position[axis]
        return index

    def _block_slices(self, position, global_shape) -> tuple[slice, ...]:
        """Where the block of the replica at ``position`` sits in the whole value."""
        start, size = [0] * len(global_shape), list(global_shape)
        for axis in self._axes_of(Shard):
            dim, parts = self.placements[axis].dim, self.mesh.shape[axis]
            size[dim] //= parts
            start[dim] += position[axis] * size[dim]
        return tuple(slice(s, s + n) for s, n in zip(start, size))

    def piece(self, value, replica: int) -> np.ndarray:
        """The piece replica ``replica`` stores of the whole ``value`` (a copy)."""
        value = np.asarray(value)
        self.block_shape(value.shape)  # checks that it splits
        position = self.mesh.position(replica)
        if any(position[i] for i in self._axes_of(Partial)):
            value = np.zeros_like(value)  # the first replica holds the sum, the others 0
        block = value[self._block_slices(position, value.shape)]
        if not self._axes_of(Flat):
            return block.copy()
        size = self.local_shape(value.shape)[0]
        flat = np.pad(block.reshape(-1), (0, size * self.flat_slices - block.size))
        start = self._flat_index(position) * size
        return flat[start:start + size].copy()

    def pieces(self, value) -> list[np.ndarray]:
        """Every replica's piece of ``value``, in replica order."""
        return [self.piece(value, r) for r in range(self.mesh.size)]

    def assemble(self, pieces: Sequence, global_shape: Sequence[int]) -> np.ndarray:
        """The whole value from every replica's piece (replica order): the blocks put
        in place, the partial sums added.

        Raises:
            ValueError: not one piece per replica, or a piece of the wrong shape.
        """
        if len(pieces) != self.mesh.size:
            raise ValueError(f"assemble needs one piece per replica ({self.mesh.size}). "
                             f"Received: {len(pieces)}")
        global_shape = tuple(global_shape)
        local = self.local_shape(global_shape)
        dtype = np.result_type(*[np.asarray(p).dtype for p in pieces])
        whole = np.zeros(global_shape, dtype)
        partial, flat = self._axes_of(Partial), self._axes_of(Flat)
        block_shape = self.block_shape(global_shape)
        blocks: dict[tuple, dict] = {}
        for replica, piece in enumerate(pieces):
            piece = np.asarray(piece)
            if piece.shape != local:
                raise ValueError(f"replica {replica}'s piece has shape {piece.shape}, not "
                                 f"{local}. Received: {self}")
            position = self.mesh.position(replica)
            if any(position[i] for i in self._axes_of(Replicate)):
                continue  # the same piece as a replica at index 0 of those axes
            key = (tuple(position[i] for i in partial), self._block_index(position))
            blocks.setdefault(key, {"position": position, "slices": {}})
            blocks[key]["slices"][self._flat_index(position)] = piece
        for block in blocks.values():
            slices = block["slices"]
            if flat:
                joined = np.concatenate([slices[i] for i in range(self.flat_slices)])
                part = joined[:math.prod(block_shape)].reshape(block_shape)
            else:
                part = slices[0]
            whole[self._block_slices(block["position"], global_shape)] += part
        return whole

    def __str__(self):
        named = ", ".join(f"{n}: {_name(p)}" for n, p in zip(self.mesh.axis_names,
                                                              self.placements))
        return f"Layout({named} on {self.mesh.shape})"


def _name(placement) -> str:
    return f"Shard({placement.dim})" if isinstance(placement, Shard) else \
        f"{type(placement).__name__}()"


def redistribute(pieces: Sequence, source: Layout, target: Layout,
                 global_shape: Sequence[int]) -> list[np.ndarray]:
    """The pieces of ``target`` (any mesh: N replicas to M) holding the value whose
    ``source`` pieces are given: the numpy reference of an elastic resize and of a save
    loaded on another mesh."""
    return target.pieces(source.assemble(pieces, global_shape))


def every_layout(mesh: Mesh, rank: int) -> list[Layout]:
    """Every layout of a value of ``rank`` dimensions on ``mesh`` (tests, planners)."""
    choices = [Replicate(), Flat(), Partial()] + [Shard(d) for d in range(rank)]
    return [Layout(mesh, placements)
            for placements in itertools.product(choices, repeat=len(mesh.shape))
            if sum(isinstance(p, Flat) for p in placements) <= 1]
