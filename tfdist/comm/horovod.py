"""Horovod as a communication engine: the only tfdist module that imports horovod.

Horovod is imported lazily, on the first call that needs it, so ``import tfdist`` and
every other mode work without it. Only Horovod's raw collective ops are used
(``allreduce``, ``broadcast``, ``allgather``); its Keras layer is broken under Keras 3.

Processes are started by ``horovodrun -np 2 -H localhost:2 --gloo python train.py``;
Gloo carries the tensors on CPU (NCCL on GPU builds). Outside ``horovodrun`` a process
is a world of size 1, so the same code runs alone.
"""

from __future__ import annotations

import os

from tfdist.comm.compression import get_compression

INSTALL_HINT = (
    "Horovod is not installed in this environment. tfdist builds it from source for "
    "TensorFlow 2.21 (pip install horovod fails): run `make horovod` in the tfdist "
    "checkout, or `bash scripts/install_horovod.sh /path/to/python` (about 4 minutes "
    "on 2 cores). See docs/horovod.md.")

_OPS = {"average": "Average", "sum": "Sum"}
# dtypes Horovod's Gloo ops accept; others travel as a wider type (bit-exact for ints).
_WIRE_FOR = {"uint32": "int64", "uint16": "int32", "int16": "int32", "bfloat16": "float32"}

_hvd = None


def hvd():
    """Returns ``horovod.tensorflow``, imported and initialized on first use.

    Raises:
        ImportError: Horovod is missing; the message says how to install it.
    """
    global _hvd
    if _hvd is None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            import horovod.tensorflow as module
        except ImportError as e:  # missing, or built against another TF
            raise ImportError(f"{INSTALL_HINT} (import error: {e})") from e
        if not module.is_initialized():
            module.init()
        _hvd = module
    return _hvd


def is_available() -> bool:
    """True if ``horovod.tensorflow`` can be imported (does not initialize it)."""
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


def init() -> None:
    """Initializes Horovod (idempotent). Every rank must call it."""
    hvd()


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return hvd().rank()


def size() -> int:
    """Number of Horovod processes."""
    return hvd().size()


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return hvd().local_rank()


def _check_op(op: str) -> str:
    if op not in _OPS:
        raise ValueError(f"op must be 'average' or 'sum'. Received: op={op!r}")
    return op


def _to_wire(tensor, compression):
    """Returns ``(wire, restore)``: the tensor as sent, and a function undoing that.

    Compresses floating tensors and widens dtypes Horovod's ops lack (bit-exact).
    """
    import tensorflow as tf

    wire, dtype = compression.compress(tf.convert_to_tensor(tensor))
    compressed = wire.dtype
    if compressed == tf.bool:
        wire = tf.cast(wire, tf.uint8)
    elif compressed.name in _WIRE_FOR:
        wire = tf.cast(wire, _WIRE_FOR[compressed.name])

    def restore(result):
        if result.dtype != compressed:
            result = tf.cast(result, compressed)
        return compression.decompress(result, dtype)

    return wire, restore


def allreduce(tensors: list, op: str = "average", compression=None, name: str | None = None) -> list:
    """All-reduces each tensor across all Horovod processes.

    Works eagerly and inside ``tf.function``. Every rank must call it with tensors of
    the same shapes and dtypes in the same order.

    Args:
        tensors: A list of dense tensors (IndexedSlices are densified).
        op: ``"average"`` (divide by `size()`) or ``"sum"``.
        compression: None, ``"fp16"``, ``"bf16"`` or a `Compression`: floating tensors
            travel in that dtype and come back in their own.
        name: Optional name prefix for the Horovod ops (graph mode names them after the
            tensors otherwise).

    Returns:
        A list of reduced tensors, same dtypes and order as ``tensors``.
    """
    import tensorflow as tf

    _check_op(op)
    policy = get_compression(compression)
    h = hvd()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    wires, restores = zip(*(_to_wire(t, policy) for t in tensors))
    # Integers are summed and divided here: Horovod's Average on ints truncates.
    results = []
    hop = h.Sum if op == "sum" or not all(w.dtype.is_floating for w in wires) else h.Average
    for i, wire in enumerate(wires):
        op_name = None if name is None else f"{name}_{i}"
        results.append(h.allreduce(wire, op=hop, name=op_name))
    out = []
    for wire, restore, tensor in zip(results, restores, tensors):
        value = restore(wire)
        dtype = tensor.dtype
        if op == "average" and hop == h.Sum:
            if dtype.is_floating:
                value = value / tf.cast(h.size(), dtype)
            else:
                value = tf.cast(tf.math.floordiv(tf.cast(value, tf.int64), h.size()), dtype)
        out.append(value)
    return out


def broadcast(tensor, root_rank: int = 0, name: str | None = None):
    """Returns ``root_rank``'s value of ``tensor`` on every rank (eager or graph)."""
    wire, restore = _to_wire(tensor, get_compression(None))
    return restore(hvd().broadcast(wire, root_rank=root_rank, name=name))


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    Args:
        variables: An iterable of variables (plain or distributed: every local copy
            of a mirrored variable gets the value).
        root_rank: The rank whose values win.
    """
    for v in variables:
        v.assign(broadcast(v.read_value() if hasattr(v, "read_value") else v, root_rank))


def allgather(tensor, name: str | None = None):
    """Concatenates ``tensor`` from every rank along axis 0 (dims > 0 must agree)."""
    wire, restore = _to_wire(tensor, get_compression(None))
    return restore(hvd().allgather(wire, name=name))


def wire_bytes(tensors, compression=None) -> int:
    """Bytes one rank contributes to an all-reduce of ``tensors`` (static shapes).

    This is the quantity `tfdist.comm.accounting.ByteCounter` counts: the payload after
    compression, once per reduction.
    """
    policy = get_compression(compression)
    return sum(policy.wire_bytes(t) for t in tensors)


def barrier() -> None:
    """Blocks until every rank reaches it (a tiny all-reduce)."""
    import tensorflow as tf

    allreduce([tf.zeros([1])], op="sum", name="tfdist_barrier")
