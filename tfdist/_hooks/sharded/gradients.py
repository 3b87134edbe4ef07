"""Hook: ``GradientTape.gradient`` for Keras variables a partitioner split into shards.

See `install_shard_aware_gradients` for why; ``tests/test_hooks_sharded.py`` fails loudly
when a TF/Keras upgrade removes what it touches.
"""

from __future__ import annotations

import contextlib

from tfdist._hooks.sharded.parts import sharded_parts


def _join_shard_gradients(grads, parts):
    """One gradient for a sharded variable from its shards' gradients (axis 0)."""
    import tensorflow as tf

    if all(g is None for g in grads):
        return None
    if not any(isinstance(g, tf.IndexedSlices) for g in grads):
        return tf.concat([tf.zeros(p.shape, p.dtype) if g is None else g
                          for g, p in zip(grads, parts)], axis=0)
    values, indices, offset = [], [], 0
    for g, p in zip(grads, parts):
        if g is not None:
            if not isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]))
            values.append(g.values)
            indices.append(tf.cast(g.indices, tf.int64) + offset)
        offset += int(p.shape[0])
    full_shape = tf.constant([offset] + parts[0].shape.as_list()[1:], tf.int64)
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), full_shape)


def _shard_aware_gradient(original):
    """``GradientTape.gradient`` that takes each shard's gradient and joins them."""
    import tensorflow as tf

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        flat = tf.nest.flatten(sources)
        layout, expanded = [], []
        for source in flat:
            parts = sharded_parts(source)
            layout.append((len(expanded), parts))
            expanded.extend(parts if parts is not None else [source])
        if len(expanded) == len(flat):
            return original(self, target, sources, output_gradients, unconnected_gradients)
        grads = original(self, target, expanded, output_gradients, unconnected_gradients)
        joined = [grads[start] if parts is None else
                  _join_shard_gradients(grads[start:start + len(parts)], parts)
                  for start, parts in layout]
        return tf.nest.pack_sequence_as(sources, joined)

    gradient.__doc__ = original.__doc__
    gradient._tfdist_shard_aware = True
    return gradient


@contextlib.contextmanager
def shard_aware_gradients():
    """``GradientTape.gradient`` works for sharded Keras variables inside this context.

    Why: see `install_shard_aware_gradients`, which does the same for good; this
    context restores the class attribute after.
    """
    import tensorflow as tf

    original = tf.GradientTape.gradient
    tf.GradientTape.gradient = _shard_aware_gradient(original)
    try:
        yield
    finally:
        tf.GradientTape.gradient = original


def install_shard_aware_gradients() -> None:
    """``tape.gradient(loss, sources)`` works when a source is sharded. Idempotent.

    Why: a Keras 3 variable whose value a partitioner split into a `ShardedVariable`
    has no ``handle``, so ``tape.gradient(loss, model.trainable_variables)`` (Keras'
    ``train_step``, or a custom loop) fails with "'ShardedVariable' object has no
    attribute 'handle'". The patched ``GradientTape.gradient`` takes the gradient of
    each shard and joins them along axis 0 (IndexedSlices with global row indices, or a
    dense concat): one full-shape gradient per sharded variable, which the optimizer
    applies shard by shard (`install_sharded_optimizer_state`). Calls without a sharded
    source run TF's method unchanged.
    """
    import tensorflow as tf

    if not getattr(tf.GradientTape.gradient, "_tfdist_shard_aware", False):
        tf.GradientTape.gradient = _shard_aware_gradient(tf.GradientTape.gradient)
