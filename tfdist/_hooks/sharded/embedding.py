"""Hook: Keras' ``Embedding`` looks ids up on the parameter servers that hold the rows.

See `install_sharded_embedding_lookup` for why; ``tests/test_hooks_sharded.py`` fails
loudly when a Keras upgrade removes what it touches.
"""

from __future__ import annotations

from tfdist._hooks.sharded.parts import sharded_parts


def div_partitioned(parts) -> bool:
    """Whether shards split axis 0 as ``tf.nn.embedding_lookup`` expects ("div": the
    first ``rows % n`` shards hold one row more), as TF's partitioners do.

    Why: the lookup hook may use the partitioned lookup only for that layout.
    """
    rows = sum(int(p.shape[0]) for p in parts)
    base, extra = divmod(rows, len(parts))
    return [int(p.shape[0]) for p in parts] == [base + (i < extra) for i in range(len(parts))]


def _on_a_ps(variable):
    """``[the TF variable]`` when it lives on a parameter server, else None."""
    value = getattr(variable, "value", variable)
    return [value] if "/job:ps/" in (getattr(value, "device", "") or "") else None


def install_sharded_embedding_lookup() -> None:
    """Keras' ``Embedding`` looks ids up on the parameter servers when its table is
    sharded or on a ps. Idempotent.

    Why: its ``call`` is ``ops.take(self.embeddings, ids)``, which reads a
    `ShardedVariable` whole: every step each worker copies every shard and joins them
    (3.6x the table per worker, benchmarks/sharded_embedding.md); a table on one ps is
    read whole too. TF's partitioned ``tf.nn.embedding_lookup`` gathers each id on the ps
    that holds its row. Other tables, LoRA and quantized tables run Keras' own ``call``.
    """
    import tensorflow as tf
    from keras.src.layers.core.embedding import Embedding

    if getattr(Embedding.call, "_tfdist_shard_lookup", False):
        return
    original = Embedding.call

    def call(self, inputs):
        parts = None
        if not self.lora_enabled and not getattr(self, "quantization_mode", None):
            parts = sharded_parts(self._embeddings) or _on_a_ps(self._embeddings)
        if not parts or not div_partitioned(parts):
            return original(self, inputs)
        ids = tf.convert_to_tensor(inputs)
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        return tf.cast(tf.nn.embedding_lookup(parts, ids), self.compute_dtype)

    call._tfdist_shard_lookup = True
    call._tfdist_original = original
    Embedding.call = call
