"""How a split layer runs in a replica function (`tfdist.strategies.tensor_parallel.splits`):
Dense column- and row-parallel, Embedding vocabulary- and feature-parallel (and a
ReversibleEmbedding's tied head on its vocabulary rows), on the collectives of
`tfdist.strategies.tensor_parallel.ops`; which kind each is: `tfdist.strategies.tensor_parallel.kinds`."""

from __future__ import annotations

import weakref

from tfdist.strategies.tensor_parallel import ops
from tfdist.strategies.tensor_parallel.kinds import (  # noqa: F401 (how `splits` calls them)
    COLUMN, FEATURES, ROW, VOCAB, check_no_penalty, einsum_axes, is_elementwise,
    is_elementwise_activation, is_supported, kernel_kind, layer_kind, may_stay_split,
    split_axis, split_output_axis, takes_split)

# tfdist's own marks on the user's layers, kept here rather than as attributes on them:
# a split layer's call (what `splits` installed), and the attention
# projections whose rows their attention layer gathers already.
SPLIT_CALLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
ROWS_GATHERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def is_attention(layer) -> bool:
    import keras

    return type(layer) is keras.layers.MultiHeadAttention


def attention_projections(layer) -> list:
    """A MultiHeadAttention's projection layers that exist."""
    from tfdist._hooks.tensor_parallel import attention_parts

    return list(attention_parts(layer).values())


def check_attention(plan, layer) -> dict:
    """``{projection: keep its output split}`` for a MultiHeadAttention split by heads.

    Raises:
        ValueError: its query, key, value (and gate) kernels are not all split by heads
            and its output kernel on its heads.
    """
    from tfdist._hooks.tensor_parallel import attention_parts, split_of

    found = {}
    output = attention_parts(layer).get("output")
    for sub in attention_projections(layer):
        split = split_of(sub.kernel)
        want = 0 if sub is output else 1
        if split is None or split.axis != want:
            raise ValueError(
                f"MultiHeadAttention {layer.name!r} splits by heads when its query, key, "
                "value (and gate) kernels are laid out (None, 'model', None) and its "
                "attention_output kernel ('model', None, None). Received: "
                f"{sub.kernel.path!r} laid out {plan.layout_of(sub.kernel.path)}")
        found[sub] = sub is not output
    return found


def attention_call(plan, layer):
    """A MultiHeadAttention's call split by heads: its own code on every row (its query,
    value and key gathered once each: once in all for a self-attention; their masks and
    a per-row ``attention_mask`` alike) and on this replica's heads; its output
    projection scatters the rows back. Attention scores come back whole (every head)
    for this replica's rows."""
    original = type(layer).call

    def call(query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None,
             use_causal_mask=False):
        from tfdist._hooks.tensor_parallel import (in_shape_inference, keras_mask_of,
                                                   set_keras_mask)

        own_mask = keras_mask_of(query)  # what Keras' call reads (not query_mask)
        if not in_shape_inference():
            communicator, m = plan.communicator, plan.replicas
            gathered = {}

            def rows(x):
                if x is not None and id(x) not in gathered:
                    gathered[id(x)] = ops.gather_rows(communicator, x, m)
                return None if x is None else gathered[id(x)]

            mask_of = {}
            for mask in (own_mask, value_mask, key_mask, attention_mask):
                if mask is not None and id(mask) not in mask_of:
                    mask_of[id(mask)] = _mask_rows(rows, mask, query,
                                                   mask is not attention_mask)
            query, value, key = rows(query), rows(value), rows(key)
            value_mask, key_mask, attention_mask = (
                None if mask is None else mask_of[id(mask)]
                for mask in (value_mask, key_mask, attention_mask))
            set_keras_mask(query, None if own_mask is None else mask_of[id(own_mask)])
        result = original(layer, query, value, key=key, value_mask=value_mask,
                          key_mask=key_mask, attention_mask=attention_mask,
                          return_attention_scores=return_attention_scores,
                          training=training, use_causal_mask=use_causal_mask)
        if in_shape_inference():
            return result
        output = result[0] if return_attention_scores else result
        set_keras_mask(output, own_mask)  # this replica's rows, as the output's
        if not return_attention_scores:
            return output
        # (every row, own heads) -> (own rows, every head)
        return output, ops.gather_features(communicator, result[1], m, axis=1)

    return call


def _mask_rows(rows, mask, query, keras_mask):
    """A mask of this replica's rows as every row (through ``rows``, as floats: the
    collectives carry no booleans). An ``attention_mask`` broadcast over the batch
    (rank 2, or first axis 1 when the query's is not) is the same for every row: kept."""
    import tensorflow as tf

    mask = tf.convert_to_tensor(mask)
    if not keras_mask and (len(mask.shape) < 3 or (mask.shape[0] == 1
                                                   and query.shape[0] != 1)):
        return mask
    return tf.cast(rows(tf.stop_gradient(tf.cast(mask, tf.float32))), tf.bool)


def split_call(plan, layer, kind, keep_split):
    """``layer``'s call, split as ``kind``; a column output stays split when
    ``keep_split`` (its consumers are row layers)."""
    import tensorflow as tf

    from tfdist._hooks.tensor_parallel import in_shape_inference, in_split_call

    import keras

    run = {COLUMN: _column, ROW: _row, VOCAB: _vocab, FEATURES: _features}[kind]
    if type(layer) is keras.layers.EinsumDense:
        run = _einsum_column if kind == COLUMN else _einsum_row
    reversible = type(layer) is keras.layers.ReversibleEmbedding

    def call(inputs, *args, **kwargs):
        x = tf.convert_to_tensor(inputs)
        reverse = {"reverse": bool(kwargs.get("reverse", args[0] if args else False))
                   } if reversible else {}
        if reverse.get("reverse"):  # the tied head: logits from this replica's rows
            run_now = _tied_head
        else:
            run_now = run
        if in_shape_inference():  # Keras' symbolic build: only the whole shape matters
            spec = layer.compute_output_spec(keras_tensor(x), **reverse)
            return tf.zeros([tf.shape(x)[i] if d is None else d
                             for i, d in enumerate(spec.shape)], spec.dtype)
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            raise ValueError(
                f"Layer {layer.name!r} is split over the 'model' axis: call the model "
                "through the strategy's fit, evaluate or predict. Received: a call "
                "outside a replica function")
        with in_split_call():
            return run_now(plan.communicator, plan.replicas, layer, x, keep_split)

    return call


def keras_tensor(x):
    import keras

    return keras.KerasTensor(x.shape, x.dtype.name)


def _column(communicator, m, layer, x, keep_split):
    import tensorflow as tf

    rows = kernel_shape(layer)[0]
    if x.shape[-1] != rows:
        raise ValueError(f"Column-parallel layer {layer.name!r} takes every input feature "
                         f"({rows}). Received: an input of shape {x.shape}")
    y = tf.matmul(ops.gather_rows(communicator, x, m), tf.convert_to_tensor(layer.kernel))
    if layer.bias is not None:
        y = y + tf.convert_to_tensor(layer.bias)
    return _activated(communicator, m, layer, y, keep_split, -1)


def _activated(communicator, m, layer, y, keep_split, axis):
    """A column layer's output ``y`` (split on ``axis``) through its activation: on the
    slice when element-wise, else on the gathered whole (as one device computes it)."""
    activation = layer.activation or (lambda v: v)
    if keep_split:  # its activation is element-wise (`may_stay_split`)
        return activation(y)
    if is_elementwise_activation(layer.activation):
        return ops.gather_features(communicator, activation(y), m, axis)
    return activation(ops.gather_features(communicator, y, m, axis))


def _row(communicator, m, layer, x, keep_split):
    import tensorflow as tf

    rows = kernel_shape(layer)[0]
    if x.shape[-1] == rows * m:  # whole features, own rows: every row, own features
        x = ops.own_block(ops.gather_rows(communicator, x, m), len(x.shape) - 1, m)
    elif x.shape[-1] != rows:
        raise ValueError(f"Row-parallel layer {layer.name!r} takes {rows * m} features (or "
                         f"its {rows}). Received: an input of shape {x.shape}")
    y = ops.scatter_rows(communicator, tf.matmul(x, tf.convert_to_tensor(layer.kernel)), m)
    if layer.bias is not None:
        y = y + tf.convert_to_tensor(layer.bias)
    return layer.activation(y)


def _ids(communicator, m, layer, x):
    """Every row's ids, as Keras' lookup takes them: a negative id counts from the end
    (``ops.take``), and one outside ``[0, input_dim)`` raises as one device's lookup does
    (TF's gather names it and the range; a split table would give a zero row)."""
    import tensorflow as tf

    ids = x if x.dtype in (tf.int32, tf.int64) else tf.cast(x, tf.int32)
    ids = ops.gather_rows(communicator, ids, m)
    size = tf.constant(layer.input_dim, ids.dtype)
    ids = tf.where(ids < 0, ids + size, ids)
    return tf.gather(tf.range(size), ids)


def _vocab(communicator, m, layer, x, keep_split):
    """Every row's ids looked up in this replica's rows of the table (others zero), the
    lookups summed over the replicas, each keeping its rows."""
    import tensorflow as tf

    ids = _ids(communicator, m, layer, x)
    table = tf.convert_to_tensor(layer.embeddings)
    size = tf.cast(tf.shape(table)[0], ids.dtype)
    start = tf.cast(ops.model_index(m), ids.dtype) * size
    mine = tf.logical_and(ids >= start, ids < start + size)
    found = tf.gather(table, tf.where(mine, ids - start, tf.zeros_like(ids)))
    found = found * tf.cast(mine, found.dtype)[..., None]
    return tf.cast(ops.scatter_rows(communicator, found, m), layer.compute_dtype)


def _tied_head(communicator, m, layer, x, keep_split):
    """A ReversibleEmbedding called ``reverse=True`` with its table split by rows: every
    row's hidden state times this replica's rows (its slice of the vocabulary's logits),
    the slices gathered whole."""
    import tensorflow as tf

    h = ops.gather_rows(communicator, x, m)
    logits = tf.matmul(h, tf.convert_to_tensor(layer.embeddings), transpose_b=True)
    if layer.logit_soft_cap is not None:  # element-wise: on the slice
        cap = layer.logit_soft_cap
        logits = tf.tanh(logits / cap) * cap
    return ops.gather_features(communicator, logits, m)


def _features(communicator, m, layer, x, keep_split):
    """Every row's lookup in this replica's columns, then the columns gathered."""
    import tensorflow as tf

    ids = _ids(communicator, m, layer, x)
    found = tf.gather(tf.convert_to_tensor(layer.embeddings), ids)
    return tf.cast(ops.gather_features(communicator, found, m), layer.compute_dtype)


def _einsum_column(communicator, m, layer, x, keep_split):
    """Every row through this replica's output slice (EinsumDense's own call); the rows
    of an attention's projection arrive gathered already."""
    import keras

    if not ROWS_GATHERED.get(layer, False):
        x = ops.gather_rows(communicator, x, m)
    y = keras.ops.einsum(layer.equation, x, layer.kernel)  # EinsumDense's own call
    if layer.bias is not None:
        y = keras.ops.add(y, layer.bias)
    return _activated(communicator, m, layer, y, keep_split, einsum_axes(layer, COLUMN))


def _einsum_row(communicator, m, layer, x, keep_split):
    """This replica's input slice through its kernel rows, summed over the replicas."""
    import tensorflow as tf

    axis = einsum_axes(layer, ROW)
    local = kernel_shape(layer)[split_axis(layer)]
    if x.shape[axis] == local * m:  # whole, own rows: every row, own slice
        x = ops.own_block(ops.gather_rows(communicator, x, m), axis % len(x.shape), m)
    elif x.shape[axis] != local:
        raise ValueError(f"Row-parallel layer {layer.name!r} takes {local * m} (or its "
                         f"{local}) on axis {axis}. Received: an input of shape {x.shape}")
    y = tf.einsum(layer.equation, x, tf.convert_to_tensor(layer.kernel))
    y = ops.scatter_rows(communicator, y, m)
    if layer.bias is not None:
        y = y + tf.convert_to_tensor(layer.bias)
    return y if layer.activation is None else layer.activation(y)




def kernel_shape(layer) -> tuple:
    """The shape of the kernel slice ``layer``'s call multiplies by (its stored block
    gathered over the batch axis when sharded there)."""
    from tfdist._hooks.tensor_parallel import split_of

    return split_of(layer.kernel).local_shape
