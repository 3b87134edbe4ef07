"""The layout model (tfdist/layout/): a mesh in Keras' DeviceMesh order, placements per
axis, and the numpy reference of pieces, wholes and redistributions, checked against
the storage rules tfdist uses today (fully sharded slices, tensor-parallel splits)."""

import math

import numpy as np
import pytest

from tfdist.layout import Flat, Layout, Mesh, Partial, Replicate, Shard, redistribute
from tfdist.layout.placement import every_layout

pytestmark = pytest.mark.unit

DATA_MODEL = Mesh((2, 2), ("batch", "model"))


def _value(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_replicas_follow_keras_device_mesh_order():
    mesh = Mesh((2, 3), ("batch", "model"))
    assert [mesh.position(r) for r in range(6)] == [(r // 3, r % 3) for r in range(6)]
    assert all(mesh.replica_at(mesh.position(r)) == r for r in range(6))
    assert mesh.group_of(4, "model") == (3, 4, 5)
    assert mesh.group_of(4, "batch") == (1, 4)
    assert mesh.groups("batch") == [(0, 3), (1, 4), (2, 5)]
    assert Mesh.data_parallel(4).groups("batch") == [(0, 1, 2, 3)]


def test_bad_meshes_and_layouts_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match=r"one name per axis"):
        Mesh((2, 2), ("batch",))
    with pytest.raises(ValueError, match=r"must differ"):
        Mesh((2, 2), ("batch", "batch"))
    with pytest.raises(ValueError, match=r"positive integers"):
        Mesh((2, 0), ("batch", "model"))
    with pytest.raises(ValueError, match=r"has no axis 'modle'; its axes are "
                                         r"\['batch', 'model'\]"):
        Layout.from_axes(DATA_MODEL, (None, "modle"))
    with pytest.raises(ValueError, match=r"one placement per mesh axis"):
        Layout(DATA_MODEL, (Replicate(),))
    with pytest.raises(ValueError, match=r"cuts two dimensions"):
        Layout.from_axes(DATA_MODEL, ("model", "model"))
    with pytest.raises(ValueError, match=r"dimension 1 \(5 so far\) does not split evenly "
                                         r"over the 2 replicas of mesh axis 'model'"):
        Layout.from_axes(DATA_MODEL, (None, "model")).local_shape((4, 5))


def test_keras_axes_become_one_placement_per_mesh_axis():
    class KerasMesh:  # what Keras' DeviceMesh and TensorLayout expose
        shape, axis_names = (2, 2), ["batch", "model"]

    class KerasLayout:
        axes, device_mesh = (None, "model"), KerasMesh()

    layout = Layout.from_keras(KerasLayout())
    assert layout.mesh == DATA_MODEL
    assert layout.placements == (Replicate(), Shard(1))
    cut = Layout.from_axes(DATA_MODEL, ("batch", "model"))
    assert cut.placements == (Shard(0), Shard(1))
    assert Layout.from_axes(DATA_MODEL, (None, None)) == Layout.replicated(DATA_MODEL)


def test_a_column_split_is_the_tensor_parallel_slice_of_today():
    """Split(axis=1) over "model": replica r holds columns [r % m * c, (r % m + 1) * c)."""
    kernel = _value((6, 8))
    layout = Layout.from_axes(DATA_MODEL, (None, "model"))
    assert layout.local_shape(kernel.shape) == (6, 4) and layout.holders() == 2
    for replica, piece in enumerate(layout.pieces(kernel)):
        np.testing.assert_array_equal(piece, np.split(kernel, 2, axis=1)[replica % 2])


@pytest.mark.parametrize("size,replicas", [(27, 2), (27, 4), (3, 4), (64, 4), (1, 3)])
def test_flat_slices_are_the_fully_sharded_rule_of_today(size, replicas):
    """ceil(size / N) elements; replica r holds [r*s, (r+1)*s) of the zero-padded
    flattened value (tfdist/strategies/fsdp/shards.py)."""
    value = _value((size,)).reshape(-1)
    layout = Layout(Mesh.data_parallel(replicas), (Flat(),))
    s = max(1, math.ceil(size / replicas))
    padded = np.pad(value, (0, s * replicas - size))
    assert layout.local_shape(value.shape) == (s,)
    for r, piece in enumerate(layout.pieces(value)):
        np.testing.assert_array_equal(piece, padded[r * s:(r + 1) * s])


def test_fully_sharded_over_a_split_stores_a_quarter_on_2_x_2():
    """FSDP over tensor parallelism: the "batch" axis, which replicated the column
    kernel, now holds flat slices of each model slice; a replica stores 1/4."""
    kernel = _value((6, 8))
    layout = Layout.from_axes(DATA_MODEL, (None, "model")).fully_sharded("batch")
    assert layout.placements == (Flat(), Shard(1))
    assert layout.local_shape(kernel.shape) == (12,) and layout.holders() == 1
    assert sum(p.size for p in layout.pieces(kernel)) == kernel.size
    np.testing.assert_array_equal(layout.assemble(layout.pieces(kernel), kernel.shape),
                                  kernel)
    cut = Layout.from_axes(DATA_MODEL, ("batch", "model"))
    assert cut.fully_sharded("batch") == cut  # "batch" already cuts: unchanged


@pytest.mark.parametrize("mesh", [Mesh.data_parallel(3), DATA_MODEL,
                                  Mesh((1, 4), ("batch", "model")),
                                  Mesh((2, 1, 2), ("batch", "seq", "model"))],
                         ids=lambda m: "x".join(map(str, m.shape)))
def test_every_layout_assembles_its_own_pieces_bitwise(mesh):
    value = _value((4, 6, 2))
    for layout in every_layout(mesh, value.ndim):
        try:
            pieces = layout.pieces(value)
        except ValueError:  # a dimension that does not split: refused, as above
            continue
        assert all(p.shape == layout.local_shape(value.shape) for p in pieces)
        whole = layout.assemble(pieces, value.shape)
        if any(isinstance(p, Partial) for p in layout.placements):
            np.testing.assert_allclose(whole, value, rtol=0, atol=0)
        else:
            np.testing.assert_array_equal(whole, value, err_msg=str(layout))


def test_partial_sums_assemble_to_their_sum():
    layout = Layout(Mesh.data_parallel(2), (Partial(),))
    whole = layout.assemble([np.ones((2, 2)), 2 * np.ones((2, 2))], (2, 2))
    np.testing.assert_array_equal(whole, 3 * np.ones((2, 2)))


def test_a_piece_of_the_wrong_shape_or_count_is_refused():
    layout = Layout.from_axes(DATA_MODEL, (None, "model"))
    with pytest.raises(ValueError, match=r"one piece per replica \(4\)\. Received: 3"):
        layout.assemble([np.zeros((6, 4))] * 3, (6, 8))
    with pytest.raises(ValueError, match=r"replica 0's piece has shape \(6, 8\), not "
                                         r"\(6, 4\)"):
        layout.assemble([np.zeros((6, 8))] * 4, (6, 8))


@pytest.mark.parametrize("source,target", [
    (Layout.from_axes(DATA_MODEL, (None, "model")).fully_sharded("batch"),
     Layout.from_axes(Mesh((1, 4), ("batch", "model")), (None, "model"))),
    (Layout.from_axes(DATA_MODEL, ("model", None)),
     Layout(Mesh.data_parallel(3), (Flat(),))),
    (Layout(Mesh.data_parallel(3), (Flat(),)), Layout(Mesh.data_parallel(2), (Flat(),))),
    (Layout(Mesh.data_parallel(2), (Flat(),)), Layout.replicated(Mesh.data_parallel(1))),
], ids=["2x2-fsdp-tp-to-1x4", "2x2-rows-to-3-flat", "3-to-2-flat", "2-flat-to-plain"])
def test_redistribute_moves_pieces_to_another_mesh_bitwise(source, target):
    """N replicas to M: the elastic resize and the save loaded on another mesh."""
    value = _value((8, 4), seed=3)
    moved = redistribute(source.pieces(value), source, target, value.shape)
    assert len(moved) == target.mesh.size
    for r, piece in enumerate(moved):
        np.testing.assert_array_equal(piece, target.piece(value, r))
    np.testing.assert_array_equal(target.assemble(moved, value.shape), value)


# ---- transitions: one layout to another on the same mesh, as collectives per axis ----

@pytest.mark.parametrize("mesh,shape", [
    (Mesh.data_parallel(2), (4, 6, 2)), (DATA_MODEL, (4, 6, 2)),
    (DATA_MODEL, (1, 3, 7)),  # flat slices padded
    (Mesh((2, 3), ("batch", "model")), (2, 6, 7)),
    (Mesh((2, 1, 2), ("batch", "seq", "model")), (12,))],
    ids=["2", "2x2", "2x2-padded", "2x3", "2x1x2"])
def test_every_plan_moves_pieces_as_the_whole_value_would(mesh, shape):
    """For every pair of layouts: the pieces moved group by group by the plan's
    collectives equal the target's pieces of the whole value."""
    from tfdist.layout import transitions

    value = _value(shape, seed=1)
    layouts = []
    for layout in every_layout(mesh, value.ndim):
        try:
            layout.local_shape(value.shape)
        except ValueError:
            continue
        layouts.append(layout)
    pairs = 0
    for source in layouts:
        pieces = source.pieces(value)
        for target in layouts:
            moved = transitions.run(pieces, source, target, value.shape)
            for r, piece in enumerate(moved):
                np.testing.assert_allclose(piece, target.piece(value, r), rtol=0,
                                           atol=1e-6, err_msg=f"{source} -> {target}")
            pairs += 1
    assert pairs == len(layouts) ** 2 > 1


def test_plans_of_the_gradient_paths_use_one_collective_per_axis():
    """Partial -> Flat (fully sharded gradients) is one reduce-scatter; Flat ->
    Replicate (the forward gather) one all-gather; FSDP over a column split gathers on
    both axes; the same layout moves nothing."""
    from tfdist.layout import transitions
    from tfdist.layout.transitions import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Step

    mesh = Mesh.data_parallel(4)
    partial, flat = Layout(mesh, (Partial(),)), Layout(mesh, (Flat(),))
    assert transitions.plan(partial, flat) == [Step(REDUCE_SCATTER, 0, Flat())]
    assert transitions.plan(flat, Layout.replicated(mesh)) == [Step(ALL_GATHER, 0, Flat())]
    assert transitions.plan(partial, Layout.replicated(mesh)) == [Step(ALL_REDUCE, 0)]
    both = Layout.from_axes(DATA_MODEL, (None, "model")).fully_sharded("batch")
    whole = transitions.plan(both, Layout.replicated(DATA_MODEL))
    assert [(s.op, s.axis) for s in whole] == [(ALL_GATHER, 0), (ALL_GATHER, 1)]
    column = Layout.from_axes(DATA_MODEL, (None, "model"))
    assert [(s.op, s.axis) for s in transitions.plan(both, column)] == [(ALL_GATHER, 0)]
    grads = Layout(DATA_MODEL, (Partial(), Shard(1)))
    assert transitions.collectives(transitions.plan(grads, both)) == 1
    assert transitions.plan(both, both) == []
    with pytest.raises(ValueError, match=r"one mesh"):
        transitions.plan(flat, Layout(Mesh.data_parallel(2), (Flat(),)))
