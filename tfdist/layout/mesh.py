"""A mesh over the replicas in sync: axis names and sizes in Keras' ``DeviceMesh`` order."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Replicas arranged on named axes, row-major as Keras' ``DeviceMesh`` lists devices.

    On a ``(d, m)`` mesh named ``("batch", "model")`` replica r has data index r // m and
    model index r % m. A 1-axis mesh is data parallelism.

    Args:
        shape: The size of each axis.
        axis_names: One name per axis, all different.

    Raises:
        ValueError: the names do not match the shape, repeat, or a size is not positive.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __post_init__(self):
        shape, names = tuple(self.shape), tuple(self.axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        if len(shape) != len(names) or not shape:
            raise ValueError(f"a Mesh needs one name per axis. Received: shape={shape}, "
                             f"axis_names={names}")
        if len(set(names)) != len(names):
            raise ValueError(f"a Mesh's axis names must differ. Received: {names}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            raise ValueError(f"a Mesh's axis sizes must be positive integers. "
                             f"Received: shape={shape}")

    @classmethod
    def data_parallel(cls, replicas: int, name: str = "batch") -> "Mesh":
        """A 1-axis mesh of ``replicas``."""
        return cls((replicas,), (name,))

    @classmethod
    def from_keras(cls, device_mesh) -> "Mesh":
        """The mesh of a Keras ``DeviceMesh`` (read duck-typed: ``shape``,
        ``axis_names``)."""
        return cls(tuple(int(n) for n in device_mesh.shape), tuple(device_mesh.axis_names))

    @property
    def size(self) -> int:
        """The number of replicas."""
        return math.prod(self.shape)

    def axis(self, name: str) -> int:
        """The index of axis ``name``.

        Raises:
            ValueError: the mesh has no such axis (names the ones it has).
        """
        if name not in self.axis_names:
            raise ValueError(f"the mesh has no axis {name!r}; its axes are "
                             f"{list(self.axis_names)}. Received: {name!r}")
        return self.axis_names.index(name)

    def position(self, replica: int) -> tuple[int, ...]:
        """Replica ``replica``'s index on each axis."""
        if not 0 <= replica < self.size:
            raise ValueError(f"replica {replica} is not on a mesh of {self.size}")
        position = []
        for size in reversed(self.shape):
            replica, index = divmod(replica, size)
            position.append(index)
        return tuple(reversed(position))

    def replica_at(self, position: tuple[int, ...]) -> int:
        """The replica at ``position`` (one index per axis)."""
        replica = 0
        for index, size in zip(position, self.shape):
            replica = replica * size + index
        return replica

    def group_of(self, replica: int, name: str) -> tuple[int, ...]:
        """The replicas that differ from ``replica`` only on axis ``name``, in that axis'
        order: the group a collective on that axis runs in."""
        axis, position = self.axis(name), list(self.position(replica))
        group = []
        for index in range(self.shape[axis]):
            position[axis] = index
            group.append(self.replica_at(tuple(position)))
        return tuple(group)

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group of axis ``name``, each once, ordered by its first replica."""
        return sorted({self.group_of(r, name) for r in range(self.size)})
