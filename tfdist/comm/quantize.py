"""Compressed outer gradients: quantisers, their wire format, and error feedback.

Model averaging's ``outer_compression`` (`tfdist.ModelAverageStrategy`). Each replica
adds its error-feedback residual to its outer gradient (the weight delta
``anchor - w``), quantises the sum, and all-gathers the packed result: int8/int4 values
with one float32 scale per chunk cannot be summed on the wire, so every replica
dequantises every peer's part and sums in float32. What rounding lost stays in the
residual for that variable's next exchange.

Wire format of one exchange (one replica's part), one int32 tensor: the payload bytes of
every variable in order, zero-padded to a multiple of 4, then every variable's chunk
scales (float32 bits). Per variable of ``n`` elements, flattened, in chunks of `CHUNK`:

- ``int8``: symmetric, ``scale = absmax / 127`` per chunk, ``q = round(x / scale)``
  (half to even) clipped to [-127, 127]; ``n`` bytes and ``ceil(n / CHUNK)`` scales.
- ``int4``: the same with 7; ``q + 8`` packed two per byte (low nibble first);
  ``ceil(n / 2)`` bytes and ``ceil(n / CHUNK)`` scales.
- ``fp16``/``bf16``: a cast, ``2 n`` bytes, no scales.

A chunk with a non-finite value gets a NaN scale, so NaN and inf reach every replica's
weights as without compression. `wire_bytes` gives one replica's bytes per exchange.
"""

from __future__ import annotations

import dataclasses

CHUNK = 1024  # elements per scale (int8, int4)
CHOICES = (None, "fp16", "bf16", "int8", "int4")


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """One outer-compression scheme.

    Attributes:
        name: ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
        levels: Largest quantised magnitude (127, 7), or 0 for a cast.
        cast_dtype: The dtype of a cast scheme, else None.
        chunk: Elements per scale.
    """

    name: str
    levels: int = 0
    cast_dtype: str | None = None
    chunk: int = CHUNK

    @property
    def scaled(self) -> bool:
        return self.levels > 0

    def payload_bytes(self, n: int) -> int:
        """Payload bytes of one variable of ``n`` elements (scales apart)."""
        if not self.scaled:
            return 2 * n
        return n if self.levels == 127 else (n + 1) // 2

    def num_scales(self, n: int) -> int:
        return -(-n // self.chunk) if self.scaled else 0

    def wire_bytes(self, sizes) -> int:
        """One replica's bytes per exchange of variables of ``sizes`` elements."""
        payload = sum(self.payload_bytes(n) for n in sizes)
        return 4 * (-(-payload // 4)) + 4 * sum(self.num_scales(n) for n in sizes)

    # ---- one flat float32 tensor ------------------------------------------------------

    def encode(self, x):
        """Returns ``(payload uint8 bytes, float32 scales, dequantised x)`` of a flat
        float32 tensor ``x`` (static size)."""
        import tensorflow as tf

        n = int(x.shape[0])
        if not self.scaled:
            wire = tf.cast(x, self.cast_dtype)
            return (tf.reshape(tf.bitcast(wire, tf.uint8), [-1]), tf.zeros([0], tf.float32),
                    tf.cast(wire, tf.float32))
        chunks = self.num_scales(n)
        padded = tf.reshape(tf.pad(x, [[0, chunks * self.chunk - n]]), [chunks, self.chunk])
        finite = tf.reduce_all(tf.math.is_finite(padded), axis=1)
        absmax = tf.reduce_max(tf.where(tf.math.is_finite(padded), tf.abs(padded), 0.0),
                               axis=1)
        scale = tf.where(finite, absmax / float(self.levels), float("nan"))
        q = tf.where(finite[:, None] & (scale[:, None] > 0),
                     tf.round(tf.math.divide_no_nan(padded, scale[:, None])), 0.0)
        q = tf.reshape(tf.clip_by_value(q, -self.levels, self.levels), [-1])[:n]
        deq = tf.reshape(tf.reshape(tf.pad(q, [[0, chunks * self.chunk - n]]),
                                    [chunks, self.chunk]) * scale[:, None], [-1])[:n]
        q = tf.cast(q, tf.int8)
        if self.levels == 127:
            payload = tf.bitcast(q, tf.uint8)
        else:
            nibbles = tf.cast(tf.pad(q, [[0, n % 2]]) + 8, tf.uint8)
            pairs = tf.reshape(nibbles, [-1, 2])
            payload = tf.bitwise.bitwise_or(pairs[:, 0],
                                            tf.bitwise.left_shift(pairs[:, 1], 4))
        return payload, scale, deq

    def decode(self, payload, scales, n: int):
        """The float32 values of ``n`` elements from their payload bytes and scales."""
        import tensorflow as tf

        if not self.scaled:
            wire = tf.bitcast(tf.reshape(payload, [n, 2]), self.cast_dtype)
            return tf.cast(wire, tf.float32)
        if self.levels == 127:
            q = tf.cast(tf.bitcast(payload, tf.int8), tf.float32)
        else:
            low = tf.bitwise.bitwise_and(payload, 15)
            high = tf.bitwise.right_shift(payload, 4)
            q = tf.cast(tf.reshape(tf.stack([low, high], axis=1), [-1])[:n], tf.float32) - 8.0
        chunks = self.num_scales(n)
        values = tf.reshape(tf.pad(q, [[0, chunks * self.chunk - n]]), [chunks, self.chunk])
        return tf.reshape(values * scales[:, None], [-1])[:n]

    # ---- a list of tensors <-> one int32 wire tensor -----------------------------------

    def pack(self, tensors):
        """Returns ``(int32 wire tensor, dequantised tensors)`` of float tensors."""
        import tensorflow as tf

        payloads, scales, dequantised = [], [], []
        for tensor in tensors:
            payload, scale, deq = self.encode(tf.reshape(tf.cast(tensor, tf.float32), [-1]))
            payloads.append(payload)
            scales.append(scale)
            dequantised.append(tf.reshape(deq, tensor.shape))
        payload = tf.concat(payloads, axis=0)
        payload = tf.pad(payload, [[0, -int(payload.shape[0]) % 4]])
        words = tf.concat([tf.bitcast(tf.reshape(payload, [-1, 4]), tf.int32),
                           tf.bitcast(tf.concat(scales, axis=0), tf.int32)], axis=0)
        return words, dequantised

    def unpack(self, words, shapes):
        """The float32 tensors of ``shapes`` from one replica's int32 wire tensor."""
        import tensorflow as tf

        sizes = [int(tf.TensorShape(s).num_elements()) for s in shapes]
        payload_words = -(-sum(self.payload_bytes(n) for n in sizes) // 4)
        payload = tf.reshape(tf.bitcast(words[:payload_words], tf.uint8), [-1])
        scales = tf.bitcast(words[payload_words:], tf.float32)
        out, byte, scale = [], 0, 0
        for n, shape in zip(sizes, shapes):
            nbytes, nscales = self.payload_bytes(n), self.num_scales(n)
            values = self.decode(payload[byte:byte + nbytes], scales[scale:scale + nscales], n)
            out.append(tf.reshape(values, shape))
            byte, scale = byte + nbytes, scale + nscales
        return out


_QUANTIZERS = {"fp16": Quantizer("fp16", cast_dtype="float16"),
               "bf16": Quantizer("bf16", cast_dtype="bfloat16"),
               "int8": Quantizer("int8", levels=127),
               "int4": Quantizer("int4", levels=7)}


def get_quantizer(outer_compression) -> Quantizer | None:
    """The `Quantizer` for ``outer_compression`` (None: no outer compression).

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if outer_compression is None or isinstance(outer_compression, Quantizer):
        return outer_compression
    if not isinstance(outer_compression, str) or outer_compression not in _QUANTIZERS:
        raise ValueError(f"outer_compression must be one of {list(CHOICES)}. "
                         f"Received: outer_compression={outer_compression!r}")
    return _QUANTIZERS[outer_compression]


def check_outer_compression(outer_compression, compression=None):
    """``outer_compression`` checked (see `get_quantizer`), and refused with a cast
    ``compression`` (None, ``"none"``, or a policy named so, passes).

    Returns:
        ``outer_compression``.
    """
    get_quantizer(outer_compression)
    name = getattr(compression, "name", compression)
    if outer_compression is not None and name not in (None, "none"):
        raise ValueError("outer_compression and compression (the cast of the averaged "
                         "deltas) cannot be used together; give one. Received: "
                         f"compression={name!r}, outer_compression={outer_compression!r}")
    return outer_compression


def quantized_mean(communicator, distribution, quantizer, deltas, residuals):
    """Cross-replica: the mean over every replica of ``deltas`` sent quantised, with
    error feedback.

    Each replica quantises ``delta + residual`` and its ``residual`` becomes what
    rounding lost; the packed parts are all-gathered through ``communicator`` (which
    counts them), each is dequantised, and they are summed in float32 in replica
    order and divided by the number of replicas.

    Args:
        communicator: A communicator with ``all_gather`` (an `Accounted` one).
        distribution: The strategy.
        quantizer: A `Quantizer`.
        deltas: Per-replica outer gradients (one per variable).
        residuals: The residual variables (per-replica TF variables), one per delta.

    Returns:
        One float32 tensor per delta: the mean, the same on every replica.
    """
    import tensorflow as tf

    from tfdist._hooks import tf as tf_hooks

    regroup = tf_hooks.tf_distribute_internals().regroup
    local = distribution.experimental_local_results
    parts = [local(d) for d in deltas]
    residual_parts = [local(r) for r in residuals]
    shapes = [p[0].shape for p in parts]
    words, new_residuals = [], [[] for _ in deltas]
    for replica in range(len(parts[0]) if parts else 0):
        with tf.device(parts[0][replica].device):
            sums = [tf.cast(p[replica], tf.float32) + r[replica].read_value()
                    for p, r in zip(parts, residual_parts)]
            packed, dequantised = quantizer.pack(sums)
            words.append(packed)
            for i, (total, deq) in enumerate(zip(sums, dequantised)):
                new_residuals[i].append(total - deq)
    if not words:
        return []
    gathered = communicator.all_gather(distribution, regroup(words) if len(words) > 1
                                       else words[0])
    rows = tf.reshape(gathered, [-1, int(words[0].shape[0])])
    count = distribution.num_replicas_in_sync
    total = None
    for row in range(count):
        values = quantizer.unpack(rows[row], shapes)
        total = values if total is None else [t + v for t, v in zip(total, values)]
    extended = distribution.extended
    for residual, values in zip(residuals, new_residuals):
        extended.update(residual, lambda r, v: r.assign(v),
                        args=(regroup(values) if len(values) > 1 else values[0],),
                        group=False)
    return [t / float(count) for t in total]
