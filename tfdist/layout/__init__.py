"""One layout model for every variable stored in pieces (issue 40): a `Mesh` over the
replicas in sync, one placement per mesh axis (`Layout`), and the numpy reference of how
a whole value becomes pieces and back (`Layout.piece`, `Layout.assemble`,
`redistribute`), and the collectives per mesh axis that move pieces from one layout to
another (`tfdist.layout.transitions`). Knows no strategy and imports no TensorFlow."""

from tfdist.layout.mesh import Mesh
from tfdist.layout.placement import Flat, Layout, Partial, Replicate, Shard, redistribute

__all__ = ["Flat", "Layout", "Mesh", "Partial", "Replicate", "Shard", "redistribute"]
