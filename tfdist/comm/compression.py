"""Gradient / weight compression for all-reduce, after Horovod's compression.py.

A policy casts floating tensors to a smaller dtype before the all-reduce and back after
it. Non-floating tensors pass through unchanged.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Compression:
    """Casts floating tensors to ``wire_dtype`` for the wire (None: no compression)."""

    name: str
    wire_dtype: str | None

    def compress(self, tensor):
        """Returns ``(wire_tensor, original_dtype)``."""
        import tensorflow as tf

        dtype = tensor.dtype
        if self.wire_dtype is None or not dtype.is_floating or dtype == self.wire_dtype:
            return tensor, dtype
        return tf.cast(tensor, self.wire_dtype), dtype

    def decompress(self, tensor, dtype):
        import tensorflow as tf

        return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)

    def wire_bytes(self, tensor) -> int:
        """Bytes ``tensor`` takes on the wire under this policy (static shape)."""
        import tensorflow as tf

        dtype = tf.as_dtype(tensor.dtype)
        if self.wire_dtype is not None and dtype.is_floating:
            dtype = tf.as_dtype(self.wire_dtype)
        return int(tensor.shape.num_elements()) * dtype.size


NONE = Compression("none", None)
FP16 = Compression("fp16", "float16")
BF16 = Compression("bf16", "bfloat16")
_BY_NAME = {None: NONE, "none": NONE, "fp16": FP16, "bf16": BF16}


def get_compression(compression: str | Compression | None) -> Compression:
    """Turns ``None | "fp16" | "bf16" | Compression`` into a `Compression`."""
    if isinstance(compression, Compression):
        return compression
    if compression is None or (isinstance(compression, str) and compression in _BY_NAME):
        return _BY_NAME[compression]
    raise ValueError("compression must be None, 'fp16' or 'bf16'. "
                     f"Received: compression={compression!r}")
