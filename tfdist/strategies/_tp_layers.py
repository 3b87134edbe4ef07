"""How a split layer runs in a replica function (`tfdist.strategies._tensor_parallel`):
Dense column- and row-parallel, Embedding vocabulary- and feature-parallel, on the
collectives of `tfdist.strategies._tp_ops`."""

from __future__ import annotations

from tfdist.strategies import _tp_ops as ops

COLUMN, ROW = "column", "row"  # a Dense kernel split on its outputs / inputs
VOCAB, FEATURES = "vocab", "features"  # an Embedding table split on its rows / columns


def is_supported(layer, kind) -> bool:
    """Whether ``layer`` (its exact class) runs split as ``kind``."""
    import keras

    return (type(layer), kind) in {
        (keras.layers.Dense, COLUMN), (keras.layers.Dense, ROW),
        (keras.layers.Embedding, VOCAB), (keras.layers.Embedding, FEATURES)}


def split_call(plan, layer, kind, keep_split):
    """``layer``'s call, split as ``kind``; a column output stays split when
    ``keep_split`` (its consumers are row layers)."""
    import tensorflow as tf

    from tfdist._hooks.tensor_parallel import in_shape_inference, in_split_call

    run = {COLUMN: _column, ROW: _row, VOCAB: _vocab, FEATURES: _features}[kind]

    def call(inputs, *args, **kwargs):
        x = tf.convert_to_tensor(inputs)
        if in_shape_inference():  # Keras' symbolic build: only the whole shape matters
            spec = layer.compute_output_spec(keras_tensor(x))
            return tf.zeros([tf.shape(x)[i] if d is None else d
                             for i, d in enumerate(spec.shape)], spec.dtype)
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            raise ValueError(
                f"Layer {layer.name!r} is split over the 'model' axis: call the model "
                "through the strategy's fit, evaluate or predict. Received: a call "
                "outside a replica function")
        with in_split_call():
            return run(plan.strategy.communicator, plan.replicas, layer, x, keep_split)

    return call


def keras_tensor(x):
    import keras

    return keras.KerasTensor(x.shape, x.dtype.name)


def _column(communicator, m, layer, x, keep_split):
    import tensorflow as tf

    rows = int(layer.kernel.shape[0])
    if x.shape[-1] != rows:
        raise ValueError(f"Column-parallel layer {layer.name!r} takes every input feature "
                         f"({rows}). Received: an input of shape {x.shape}")
    y = tf.matmul(ops.gather_rows(communicator, x, m), tf.convert_to_tensor(layer.kernel))
    if layer.bias is not None:
        y = y + tf.convert_to_tensor(layer.bias)
    y = layer.activation(y)
    return y if keep_split else ops.gather_features(communicator, y, m)


def _row(communicator, m, layer, x, keep_split):
    import tensorflow as tf

    rows = int(layer.kernel.shape[0])
    if x.shape[-1] == rows * m:  # whole features, own rows: every row, own features
        x = ops.own_block(ops.gather_rows(communicator, x, m), len(x.shape) - 1, m)
    elif x.shape[-1] != rows:
        raise ValueError(f"Row-parallel layer {layer.name!r} takes {rows * m} features (or "
                         f"its {rows}). Received: an input of shape {x.shape}")
    y = ops.scatter_rows(communicator, tf.matmul(x, tf.convert_to_tensor(layer.kernel)), m)
    if layer.bias is not None:
        y = y + tf.convert_to_tensor(layer.bias)
    return layer.activation(y)


def _ids(x):
    import tensorflow as tf

    return x if x.dtype in (tf.int32, tf.int64) else tf.cast(x, tf.int32)


def _vocab(communicator, m, layer, x, keep_split):
    """Every row's ids looked up in this replica's rows of the table (others zero), the
    lookups summed over the replicas, each keeping its rows."""
    import tensorflow as tf

    ids = ops.gather_rows(communicator, _ids(x), m)
    table = tf.convert_to_tensor(layer.embeddings)
    size = tf.cast(tf.shape(table)[0], ids.dtype)
    start = tf.cast(ops.replica_id(), ids.dtype) * size
    mine = tf.logical_and(ids >= start, ids < start + size)
    found = tf.gather(table, tf.where(mine, ids - start, tf.zeros_like(ids)))
    found = found * tf.cast(mine, found.dtype)[..., None]
    return tf.cast(ops.scatter_rows(communicator, found, m), layer.compute_dtype)


def _features(communicator, m, layer, x, keep_split):
    """Every row's lookup in this replica's columns, then the columns gathered."""
    import tensorflow as tf

    ids = ops.gather_rows(communicator, _ids(x), m)
    found = tf.gather(tf.convert_to_tensor(layer.embeddings), ids)
    return tf.cast(ops.gather_features(communicator, found, m), layer.compute_dtype)
