"""Horovod's collective ops, the only tfdist code that imports ``horovod``.

Horovod is imported lazily, on the first call that needs it, so ``import tfdist`` and
every other mode work without it. Only Horovod's raw collective ops are used
(``allreduce``, ``broadcast``, ``allgather``, ``alltoall``); its Keras layer is broken under Keras 3.

Processes are started by ``horovodrun -np 2 -H localhost:2 --gloo python train.py``, or
by `tfdist.engines.horovod.rendezvous.init_from_cluster` for a TF_CONFIG job; Gloo
carries the tensors on CPU (NCCL on GPU builds). Outside both a process is a world of
size 1, so the same code runs alone.
"""

from __future__ import annotations

import itertools
import os

INSTALL_HINT = (
    "Horovod is not installed in this environment. tfdist builds it from source for "
    "TensorFlow 2.21 (pip install horovod fails): run `make horovod` in the tfdist "
    "checkout, or `bash scripts/install_horovod.sh /path/to/python` (about 4 minutes "
    "on 2 cores). See docs/horovod.md.")

_OPS = {"average": "Average", "sum": "Sum"}
# dtypes Horovod's Gloo ops accept; others travel as a wider type (bit-exact for ints).
_WIRE_FOR = {"uint32": "int64", "uint16": "int32", "int16": "int32", "bfloat16": "float32"}

_hvd = None
_op_count = itertools.count()


class ProcessSets:
    """The process sets of a data x model mesh in this process: the rank tuples `hvd`
    declares when it starts Horovod (`declare_process_sets`), and the ProcessSet of each
    once started (what Horovod's ops take).

    Kept here because Horovod lists its process sets only through private members
    (``HorovodBasics._get_process_set_ids_and_ranks``: ids and ranks, not the ProcessSet
    objects); publicly it has only ``global_process_set`` and the sets given to
    ``hvd.init()``.
    """

    def __init__(self):
        self.declared: list[tuple[int, ...]] = []
        self.started: dict[tuple[int, ...], object] = {}

    def init(self, module) -> None:
        """``module.init()`` with a ProcessSet of each declared rank tuple, kept."""
        made = [module.ProcessSet(list(ranks)) for ranks in self.declared]
        module.init(process_sets=made or None)
        self.started.update({tuple(ps.ranks): ps for ps in made})


_sets = ProcessSets()


def _op_name(name: str | None, kind: str) -> str:
    """``name``, or the next name in call order: Horovod pairs ops across ranks by name.

    Its own default names come from the tensors, which follow Keras' layer names, so a
    rank that built one more model (a reference, say) would wait for names that never
    come. Call order is what every rank shares, as with TF's collective instance keys.
    """
    return name if name is not None else f"tfdist.{kind}.{next(_op_count)}"


def hvd():
    """Returns ``horovod.tensorflow``, imported and initialized on first use.

    Raises:
        ImportError: Horovod is missing; the message says how to install it.
    """
    global _hvd
    if _hvd is None:
        module = import_horovod()
        if not module.is_initialized():
            _sets.init(module)
        _hvd = module
    return _hvd


def declare_process_sets(groups) -> None:
    """Makes `hvd` start Horovod with a process set per group of ranks (each of 2 ranks
    or more, not every rank), as Horovod wants them: declared at ``hvd.init()``, the
    same list on every rank.

    Args:
        groups: Lists of ranks.

    Raises:
        ValueError: Horovod is already running in this process without one of them.
    """
    wanted = list(dict.fromkeys(tuple(sorted(g)) for g in groups if len(g) > 1))
    if _hvd is None:
        _sets.declared[:] = wanted
        return
    missing = [list(g) for g in wanted if g not in _sets.started and len(g) != _hvd.size()]
    if missing:
        raise ValueError(
            "Horovod is already running in this process without the process sets a data x "
            "model mesh needs (they are declared when Horovod starts): make the mesh's "
            f"strategy first in the process. Received: process sets={missing}")


def process_sets() -> list[tuple[int, ...]]:
    """The ranks of each process set Horovod was started with (`declare_process_sets`)."""
    return sorted(_sets.started)


def process_set(ranks):
    """Horovod's process set of ``ranks`` (declared with `declare_process_sets`; every
    rank: the global one).

    Raises:
        ValueError: it was not declared.
    """
    h = hvd()
    ranks = tuple(sorted(ranks))
    if len(ranks) == h.size():
        return h.global_process_set
    if ranks not in _sets.started:
        raise ValueError("Horovod has no process set of these ranks: declare it before "
                         f"Horovod starts (declare_process_sets). Received: ranks={list(ranks)}")
    return _sets.started[ranks]


def import_horovod():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import horovod.tensorflow as module
    except ImportError as e:  # missing, or built against another TF
        raise ImportError(f"{INSTALL_HINT} (import error: {e})") from e
    return module

def is_initialized() -> bool:
    """Whether this process has initialized Horovod through `hvd`."""
    return _hvd is not None


def shutdown() -> None:
    """Shuts Horovod down in this process (elastic re-forming); `reinit` starts it again."""
    if _hvd is not None:
        _hvd.shutdown()


def reinit() -> None:
    """Initializes Horovod again after `shutdown`, from this process's ``HOROVOD_*``
    variables, and restarts the call-order op names (`reset_op_names`)."""
    reset_op_names()
    hvd().init()


def reset_op_names() -> None:
    """Restarts the call-order op names, so members of a new Horovod job count alike."""
    global _op_count
    _op_count = itertools.count()


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


def _to_wire(tensor):
    """Returns ``(wire, restore)``: the tensor as sent, and a function undoing that.

    Widens dtypes Horovod's ops lack (bit-exact).
    """
    import tensorflow as tf

    wire = tf.convert_to_tensor(tensor)
    dtype = wire.dtype
    if dtype == tf.bool:
        wire = tf.cast(wire, tf.uint8)
    elif dtype.name in _WIRE_FOR:
        wire = tf.cast(wire, _WIRE_FOR[dtype.name])

    def restore(result):
        return result if result.dtype == dtype else tf.cast(result, dtype)

    return wire, restore


def allreduce(tensors: list, op: str = "average", name: str | None = None,
              process_set=None) -> list:
    """All-reduces each tensor across all Horovod processes.

    Works eagerly and inside ``tf.function``. Every rank must call it with tensors of
    the same shapes and dtypes in the same order.

    Args:
        tensors: A list of dense tensors (IndexedSlices are densified).
        op: ``"average"`` (divide by `size()`) or ``"sum"``.
        name: Optional name prefix for the Horovod ops (default: one from call order,
            the same on every rank).
        process_set: Reduce within this Horovod process set (`process_set`) only;
            default: every rank.

    Returns:
        A list of reduced tensors, same dtypes and order as ``tensors``.
    """
    import tensorflow as tf

    _check_op(op)
    h = hvd()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    wires, restores = zip(*(_to_wire(t) for t in tensors))
    # Integers are summed and divided here: Horovod's Average on ints truncates.
    name = _op_name(name, "allreduce")
    within = _within(process_set)
    count = process_set.size() if process_set is not None else h.size()
    results = []
    hop = h.Sum if op == "sum" or not all(w.dtype.is_floating for w in wires) else h.Average
    for i, wire in enumerate(wires):
        results.append(h.allreduce(wire, op=hop, name=f"{name}_{i}", **within))
    out = []
    for wire, restore, tensor in zip(results, restores, tensors):
        value = restore(wire)
        dtype = tensor.dtype
        if op == "average" and hop == h.Sum:
            if dtype.is_floating:
                value = value / tf.cast(count, dtype)
            else:
                value = tf.cast(tf.math.floordiv(tf.cast(value, tf.int64), count), dtype)
        out.append(value)
    return out


def broadcast(tensor, root_rank: int = 0, name: str | None = None):
    """Returns ``root_rank``'s value of ``tensor`` on every rank (eager or graph)."""
    wire, restore = _to_wire(tensor)
    return restore(hvd().broadcast(wire, root_rank=root_rank,
                                   name=_op_name(name, "broadcast")))


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    Args:
        variables: An iterable of variables (plain or distributed: every local copy
            of a mirrored variable gets the value).
        root_rank: The rank whose values win.
    """
    for v in variables:
        v.assign(broadcast(v.read_value() if hasattr(v, "read_value") else v, root_rank))


def allgather(tensor, name: str | None = None, process_set=None):
    """Concatenates ``tensor`` from every rank (of ``process_set``, in rank order) along
    axis 0 (dims > 0 must agree)."""
    wire, restore = _to_wire(tensor)
    return restore(hvd().allgather(wire, name=_op_name(name, "allgather"),
                                   **_within(process_set)))


def reducescatter(tensor, name: str | None = None, process_set=None):
    """Sums ``tensor`` over every rank (of ``process_set``) and returns this rank's
    1/size of it along axis 0 (its length must be a multiple of the size), blocks in
    rank order.

    Runs as an alltoall of the blocks and a local sum, which sends the bytes of a ring
    reduce-scatter. Horovod's own ``reducescatter`` is not used: on Gloo
    (``gloo::ReduceScatterHalvingDoubling``) every rank but 0 overwrites its send buffer
    before its sends have completed, so rank 0's block intermittently ends in wrong
    values when rank 0 reads slowly (jax-ml/jax#40830; `scripts/gloo_reducescatter.py`
    reproduces it with Horovod).
    """
    import tensorflow as tf

    h = hvd()
    size = process_set.size() if process_set is not None else h.size()
    wire, restore = _to_wire(tensor)
    blocks = tf.reshape(wire, tf.concat([[size, -1], tf.shape(wire)[1:]], 0))
    received = h.alltoall(blocks, name=_op_name(name, "reducescatter"),
                          **_within(process_set))
    return restore(tf.reduce_sum(tf.reshape(received, tf.shape(blocks)), axis=0))


def _within(process_set) -> dict:
    """Horovod's keyword for an op within ``process_set`` (none: every rank)."""
    return {} if process_set is None else {"process_set": process_set}
