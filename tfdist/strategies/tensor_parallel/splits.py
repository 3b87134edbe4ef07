"""Tensor parallelism ("split weights", Megatron-LM): Dense kernels split over the
replicas of the "model" axis, from a layout map.

A variable whose layout names ``"model"`` is stored split on that axis: replica r of m
holds slice r (`Split`; `tfdist._hooks.tensor_parallel` makes it). A Dense kernel laid
out ``(None, "model")`` is column-parallel (each replica computes its output columns,
its bias split alike unless the map says otherwise); ``("model", None)`` is
row-parallel (each replica multiplies its input rows; the partial sums are added over
the replicas, then the whole bias once). A column layer whose every consumer is a row
layer hands it its activation still split (no gather); otherwise its output is gathered
whole. An Embedding table laid out ``("model", None)`` is vocabulary-parallel (each
replica looks up the ids in its rows, the others masked to zero, and the lookups are
summed over the replicas); ``(None, "model")`` splits its features (gathered after the
lookup). How each runs: `tfdist.strategies.tensor_parallel.layers`. Any other layer with a split
variable is refused in one error naming it and its layout.

A split variable's gradient is whole on its replica (the layer saw every row), so the
strategy does not all-reduce it (on a data x model mesh it sums it over the batch axis).
On a mesh with d > 1 a Dense or EinsumDense kernel laid out with "batch" on its other
axis (``("batch", "model")``, ``("model", "batch")``) is also fully sharded over the
batch axis, and a variable laid out over "batch" alone (``("batch", None)``) is stored
as its block of d: `tfdist.strategies.tensor_parallel.batch_axis`.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from tfdist.comm.communicator import gather_numpy, initial_value, per_replica, replica_ids
from tfdist.comm.groups import ReplicaGroups, is_mesh
from tfdist.strategies.tensor_parallel import batch_axis as _batch
from tfdist.strategies.tensor_parallel import layers
from tfdist.strategies.tensor_parallel.layers import COLUMN, FEATURES, ROW, VOCAB

MODEL = "model"
BATCH_ONLY = "batch"  # `TensorParallel.split_axis` of a variable laid out over "batch" alone


class ModelAxis:
    """A communicator's collectives within the "model" groups of a data x model mesh, in
    the shape `tfdist.strategies.tensor_parallel.ops` calls them (each result per replica)."""

    def __init__(self, communicator, groups):
        self.inner, self.groups = communicator, groups

    def all_gather(self, distribution, value):
        if self.groups.size == 1:  # m = 1: each replica is its own group, nothing sent
            return value
        return self.inner.in_group(self.groups, "all_gather", distribution, value)

    def reduce_scatter(self, distribution, values, op="sum"):
        if self.groups.size == 1:
            return list(values)
        return [self.inner.in_group(self.groups, "reduce_scatter", distribution, v, op)
                for v in values]


@dataclasses.dataclass(eq=False)
class Split:
    """How one variable is cut: ``full_shape`` in ``replicas`` equal slices on ``axis``
    (``local_shape``: one slice, as its layer's call sees it); with ``batch_axis``, each
    slice stored in ``batches`` (d) blocks on that axis over the "batch" axis
    (`tfdist.strategies.tensor_parallel.batch_axis`). ``axis`` None: not split over "model" (the slice
    is the whole variable, laid out over "batch" alone)."""

    plan: "TensorParallel"
    path: str
    axis: int | None
    full_shape: tuple
    local_shape: tuple
    batch_axis: int | None = None
    batches: int = 1

    @property
    def stored_shape(self) -> tuple:
        """What each replica stores: its slice, or its block of it."""
        shape = list(self.local_shape)
        if self.batch_axis is not None:
            shape[self.batch_axis] //= self.batches
        return tuple(shape)

    def like(self, path: str) -> "Split":
        """The same cut for another variable of the same shape (an optimizer slot)."""
        return dataclasses.replace(self, path=path)

    def gather(self, local):
        """Replica context: the slice from this replica's stored ``local`` (as it is
        without a batch axis; else gathered over the batch group)."""
        return local if self.batch_axis is None else _batch.gather(self, local)

    def full_numpy(self, value):
        """The whole value from every replica's slice (cross-replica; with several
        workers an all-gather, so every worker must call it)."""
        if self.batch_axis is not None:
            return _batch.full_numpy(self, value)
        strategy, m = self.plan.strategy, self.plan.replicas
        if getattr(strategy, "num_workers", 1) == 1:  # model index r holds slice r % m
            return np.concatenate([np.asarray(v) for v in value.values[:m]], axis=self.axis)
        whole = gather_numpy(strategy, value, axis=self.axis)
        return np.take(whole, range(self.full_shape[self.axis]), axis=self.axis)

    def assign_full(self, target, value):
        """Each local replica of ``target`` takes its slice of the whole ``value``."""
        value = np.asarray(value, dtype=np.dtype(target.dtype.name))
        if tuple(value.shape) != self.full_shape:
            raise ValueError(f"The value assigned to {self.path!r} must have shape "
                             f"{list(self.full_shape)}. Received: shape={list(value.shape)}")
        for component, replica in zip(target.values, replica_ids(self.plan.strategy)):
            component.assign(_batch.block(value, self, replica))


def layout_axes(layout) -> tuple:
    """A layout's axis names: a tuple (``""`` for None), or a
    ``keras.distribution.TensorLayout``."""
    axes = getattr(layout, "axes", layout)
    if not isinstance(axes, (tuple, list)) or not all(a is None or isinstance(a, str)
                                                       for a in axes):
        raise ValueError("A layout must be a tuple of axis names or None, or a "
                         f"keras.distribution.TensorLayout. Received: {layout!r}")
    return tuple(a or None for a in axes)  # '': None (a TOML config has no null)


class TensorParallel:
    """A strategy's ``tensor_parallel``: which variables are split, and how layers run.

    Args:
        strategy: The strategy (its replicas and ``communicator``).
        layout_map: ``{path regex: layout}`` (a dict or a
            ``keras.distribution.LayoutMap``); a variable's layout is the one key equal
            to its path, else the one key that ``re.fullmatch``-es it (Keras' rule).
        model_parallel: The size m of the "model" axis (None: every replica). With
            m < n replicas, they form a ``(n // m, m)`` data x model mesh
            (`tfdist.comm.groups`): replica r holds slice ``r % m`` of each split
            variable, the model-axis collectives run within its group of m, and a split
            variable's gradient is summed over the n / m replicas of its slice.

    Attributes:
        model_groups, batch_groups: The mesh's two axes (`ReplicaGroups`), or None
            when m = n.
    """

    def __init__(self, strategy, layout_map, model_parallel=None):
        self.strategy = strategy
        self.rules = [(key, layout_axes(layout)) for key, layout in layout_map.items()]
        self.kinds = {}  # layer path -> COLUMN, ROW, VOCAB or FEATURES
        self.kernels = {}  # column layer path -> the output axis its kernel splits (< 0)
        n = strategy.num_replicas_in_sync
        self.model_parallel = n if model_parallel is None else model_parallel
        self.model_groups = self.batch_groups = None
        if is_mesh(n, self.model_parallel):
            timeout = getattr(getattr(strategy, "communication", None), "timeout_seconds",
                              None)
            devices = strategy.extended.worker_devices
            self.model_groups = ReplicaGroups(n, self.model_parallel, "model", devices, timeout)
            self.batch_groups = ReplicaGroups(n, self.model_parallel, "batch", devices, timeout)

    @property
    def replicas(self) -> int:
        """The replicas of one "model" group (m)."""
        return self.model_parallel

    @property
    def communicator(self):
        """What the model-axis collectives go through: the strategy's communicator, within
        the model groups on a data x model mesh (`ModelAxis`)."""
        if self.model_groups is None:
            return self.strategy.communicator
        return ModelAxis(self.strategy.communicator, self.model_groups)

    def reduce_split_gradients(self, distribution, grads):
        """Cross-replica: each split variable's gradient summed over the replicas holding
        the same slice (the "batch" axis); as they are when m = n."""
        import tensorflow as tf

        if self.batch_groups is None:
            return list(grads)
        out, communicator = [], self.strategy.communicator
        for grad in grads:
            parts = distribution.experimental_local_results(grad)
            if not isinstance(parts[0], tf.IndexedSlices):
                out.append(communicator.in_group(self.batch_groups, "all_reduce",
                                                 distribution, grad, "sum"))
                continue
            # A lookup's gradient stays sparse, as on one device (Keras' optimizers
            # update sparse gradients their own way): its rows gathered over the axis.
            values, indices = (communicator.in_group(
                self.batch_groups, "all_gather", distribution,
                per_replica([getattr(p, name) for p in parts]))
                for name in ("values", "indices"))
            out.append(per_replica([
                tf.IndexedSlices(v, i, p.dense_shape) for v, i, p in zip(
                    distribution.experimental_local_results(values),
                    distribution.experimental_local_results(indices), parts)]))
        return out

    def layout_of(self, path: str):
        """The layout axes the map gives ``path``, or None."""
        for key, axes in self.rules:
            if key == path:
                return axes
        found = [(key, axes) for key, axes in self.rules if re.fullmatch(key, path)]
        if len(found) > 1:
            raise ValueError(f"Path {path!r} matches more than one layout map key. "
                             f"Received: keys={[key for key, _ in found]}")
        return found[0][1] if found else None

    def split_axis(self, path: str, shape: tuple, trainable: bool):
        """The axis the variable of ``path`` and ``shape`` is split on, `BATCH_ONLY`
        (sharded over "batch" alone), or None."""
        layer, _, name = path.rpartition("/")
        axes = self.layout_of(path)
        if axes is None:  # a column layer's bias follows its kernel's output axis
            from_end = self.kernels.get(layer)
            if name == "bias" and self.kinds.get(layer) == COLUMN and from_end is not None:
                at = from_end + len(shape)  # a bias is aligned on the output's last axes
                if 0 <= at < len(shape) and shape[at] != 1:
                    return self._checked(path, shape, tuple(
                        MODEL if i == at else None for i in range(len(shape))), trainable)
            return None
        if MODEL not in axes:
            return self._batch_only(path, shape, axes, trainable)
        axis = self._checked(path, shape, axes, trainable)
        if name == "kernel" and len(shape) >= 2:
            self.kinds[layer], self.kernels[layer] = layers.kernel_kind(axis, len(shape))
        if name == "embeddings" and len(shape) == 2:
            self.kinds[layer] = VOCAB if axis == 0 else FEATURES
        return axis

    def _batch_only(self, path, shape, axes, trainable):
        """`BATCH_ONLY` for a trainable variable laid out over "batch" and not "model" on a
        mesh with d > 1 (stored as its block of d, as Keras on JAX shards it), else None
        (replicated: a non-trainable one, such as a BatchNormalization statistic, stays
        whole on every replica)."""
        if "batch" not in axes or self.batch_groups is None or not trainable:
            return None  # on d = 1 the "batch" entry means nothing
        _batch.check_alone(path, shape, axes, self.batch_groups.size)
        return BATCH_ONLY

    def _checked(self, path, shape, axes, trainable):
        if len(axes) != len(shape) or axes.count(MODEL) != 1 or any(
                a not in (None, MODEL, "batch") for a in axes):
            raise ValueError(
                f"The layout of {path!r} must name 'model' once and have one entry per "
                f"axis of its shape {list(shape)}. Received: layout={axes}")
        axis = axes.index(MODEL)
        if "batch" in axes and self.batch_groups is not None:
            d = self.batch_groups.size
            at = axes.index("batch")
            if axes.count("batch") > 1 or shape[at] % d:
                raise ValueError(
                    f"Variable {path!r} of shape {list(shape)} cannot be sharded on axis "
                    f"{at} over the {d} replicas of the 'batch' axis (name 'batch' once, on "
                    f"an axis that is a multiple of {d}). Received: layout={axes}")
        if not trainable or shape[axis] % self.replicas:
            raise ValueError(
                f"Variable {path!r} of shape {list(shape)} cannot be split on axis {axis} "
                f"over {self.replicas} 'model' replicas (it must be trainable and that axis "
                f"a multiple of {self.replicas}). Received: layout={axes}")
        return axis

    def create(self, path, shape, axis, value, arguments):
        """The mirrored variable whose replica r holds slice r of the initial ``value``
        (a tensor, or a function returning one); ``arguments``: its ``tf.Variable``
        keyword arguments.

        Returns:
            ``(the mirrored variable, its Split)``.
        """
        import tensorflow as tf

        axes = self.layout_of(path)
        batch_axis = None
        if axes is not None and "batch" in axes and self.batch_groups is not None:
            batch_axis = axes.index("batch")
        local = list(shape)
        if axis == BATCH_ONLY:
            axis = None
        else:
            local[axis] //= self.replicas
        split = Split(self, path, axis, tuple(shape), tuple(local), batch_axis,
                      self.batch_groups.size if batch_axis is not None else 1)
        with tf.init_scope():
            full = initial_value(self.strategy, value, arguments["dtype"])
            full = full.numpy()
            ids = replica_ids(self.strategy)
            created = tf.Variable(_batch.block(full, split, ids[0]), **arguments)
            for component, replica in zip(created.values, ids):
                component.assign(_batch.block(full, split, replica))
        return created, split

    # ---- layers ---------------------------------------------------------------------

    def prepare(self, model) -> int:
        """Makes every layer of ``model`` with a split variable run split (idempotent).
        Returns the number of split layers.

        Raises:
            ValueError: a layer it cannot split, naming it and its variable's layout.
        """
        from tfdist._hooks.tensor_parallel import all_layers, output_layers, split_of

        count = 0
        outputs = {id(layer) for layer in output_layers(model)}
        inside = {}  # a split attention's projections -> whether their output stays split
        for layer in all_layers(model):
            if layers.is_attention(layer):
                split = layers.attention_projections(layer)
                if any(_over_model(v) for sub in split for v in sub.weights):
                    for sub, keep in layers.check_attention(self, layer).items():
                        inside[id(sub)] = keep
                        layers.ROWS_GATHERED[sub] = keep  # the attention gathers them
                    if layers.SPLIT_CALLS.get(layer) is None:
                        layer.call = layers.attention_call(self, layer)
                        layers.SPLIT_CALLS[layer] = "heads"
        for layer in all_layers(model):
            own = [v for v in layer.weights if split_of(v) is not None
                   and v.path.startswith(layer.path + "/")
                   and v.path.count("/") == layer.path.count("/") + 1]
            if not own:
                continue
            if not any(_over_model(v) for v in own):
                self._check_batch_only(layer, own)  # runs as it is, its blocks gathered
                continue
            if not all(_over_model(v) for v in own):
                alone = next(v for v in own if not _over_model(v))
                raise ValueError(
                    "A layer with a variable split over 'model' cannot have another laid out "
                    "over 'batch' alone: lay it out on 'model' or leave it out of the map. "
                    f"Received: layer {layer.name!r} with {alone.path!r} laid out "
                    f"{self.layout_of(alone.path)}")
            kind = self.kinds[layer.path] = layers.layer_kind(layer, self.kinds.get(
                layer.path))
            if not layers.is_supported(layer, kind):
                split = split_of(own[0])
                raise ValueError(
                    "ModelParallelStrategy splits Dense and EinsumDense kernels (column or "
                    "row), MultiHeadAttention by heads and Embedding tables (vocabulary or "
                    f"features) only. Received: layer {layer.name!r} "
                    f"({type(layer).__name__}) with {own[0].path!r} laid out "
                    f"{self.layout_of(own[0].path)} (split on axis {split.axis})")
            sharded = [v for v in own if split_of(v).batch_axis is not None]
            if sharded and kind not in (COLUMN, ROW):
                raise ValueError(
                    "A variable split over 'model' is also sharded over 'batch' for Dense "
                    "and EinsumDense kernels only: lay it out on 'model' alone. Received: "
                    f"layer {layer.name!r} ({type(layer).__name__}) with "
                    f"{sharded[0].path!r} laid out {self.layout_of(sharded[0].path)}")
            if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode",
                                                                None):
                raise ValueError(f"ModelParallelStrategy does not split a LoRA or quantized "
                                 f"layer. Received: layer {layer.name!r}")
            layers.check_no_penalty(layer, own)
            keep = inside.get(id(layer), kind == COLUMN and layers.may_stay_split(layer)
                              and self._feeds_rows_only(layer, outputs))
            if layers.SPLIT_CALLS.get(layer) != (kind, keep):
                layer.call = layers.split_call(self, layer, kind, keep)
                layers.SPLIT_CALLS[layer] = (kind, keep)
                if kind == ROW:
                    layer.input_spec = None  # its input may arrive split
            count += 1
        return count

    def _check_batch_only(self, layer, own) -> None:
        """A layer whose split variables are laid out over "batch" alone runs its own call
        (each read gathers the whole variable); a lookup table is refused."""
        import keras

        if isinstance(layer, keras.layers.Embedding):
            raise ValueError(
                "An Embedding table is not sharded over 'batch' alone: lay it out on "
                f"'model' (or leave it out of the map). Received: layer {layer.name!r} "
                f"with {own[0].path!r} laid out {self.layout_of(own[0].path)}")

    def _feeds_rows_only(self, layer, outputs, axis=None) -> bool:
        """Whether every path out of the column ``layer`` reaches a row-parallel Dense or
        EinsumDense split on the same axis through element-wise layers only (so its
        output, split on ``axis`` from the end, may stay split)."""
        from tfdist._hooks.tensor_parallel import consumers

        axis = layers.split_output_axis(layer) if axis is None else axis
        after = consumers(layer)
        if not after or id(layer) in outputs:
            return False
        for consumer in after:
            if layers.takes_split(consumer, self.kinds.get(consumer.path), axis):
                continue
            if not (layers.is_elementwise(consumer)
                    and self._feeds_rows_only(consumer, outputs, axis)):
                return False
        return True


def _over_model(variable) -> bool:
    """Whether ``variable`` is stored split over the "model" axis."""
    from tfdist._hooks.tensor_parallel import split_of

    split = split_of(variable)
    return split is not None and split.axis is not None
