"""One communication option object for every tfdist strategy.

In the style of `tf.distribute.experimental.CommunicationOptions`, with the features
Horovod users rely on. The meaning is the same in every strategy that accepts it.
"""

from __future__ import annotations

import dataclasses

from tfdist.checks import check_int, check_seconds
from tfdist.comm.compression import Compression, get_compression

IMPLEMENTATIONS = ("auto", "ring", "nccl")


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How a strategy all-reduces.

    Attributes:
        compression: None, ``"fp16"`` or ``"bf16"``: floating gradients (averaged
            weights, for model averaging) are cast for the all-reduce and cast back.
        accumulate_steps: Gradients of this many micro-batches are summed locally, then
            all-reduced and applied once (Horovod's ``backward_passes_per_step``).
            ``optimizer.iterations`` counts applied updates.
        timeout_seconds: Seconds a collective may wait for its peers (multi-worker).
        implementation: ``"auto"``, ``"ring"`` or ``"nccl"`` (multi-worker collectives).
        bytes_per_pack: Pack gradients into chunks of this many bytes (0: TF decides).
    """

    compression: str | None = None
    accumulate_steps: int = 1
    timeout_seconds: float | None = None
    implementation: str = "auto"
    bytes_per_pack: int = 0

    def __post_init__(self):
        get_compression(self.compression)
        check_int("accumulate_steps", self.accumulate_steps, 1)
        check_seconds("timeout_seconds", self.timeout_seconds, allow_none=True)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {list(IMPLEMENTATIONS)}. "
                             f"Received: implementation={self.implementation!r}")
        check_int("bytes_per_pack", self.bytes_per_pack, 0)

    @property
    def compression_policy(self) -> Compression:
        return get_compression(self.compression)

    def to_tf(self):
        """The equivalent `tf.distribute.experimental.CommunicationOptions`."""
        import tensorflow as tf

        implementation = {
            "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
        }[self.implementation]
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.bytes_per_pack, timeout_seconds=self.timeout_seconds,
            implementation=implementation)


def merge_options(options=None, *, compression=None, accumulate_steps=None
                  ) -> CommunicationOptions:
    """Combines a strategy's ``communication_options`` with its shortcut arguments.

    Args:
        options: None, a `CommunicationOptions`, or TF's CommunicationOptions (its
            timeout, implementation and packing are kept).
        compression: Shortcut; conflicts with a different value in ``options``.
        accumulate_steps: Shortcut; likewise.

    Raises:
        ValueError: a shortcut contradicts ``options``, or a value is invalid.
    """
    if options is None:
        options = CommunicationOptions()
    elif not isinstance(options, CommunicationOptions):
        if not hasattr(options, "timeout_seconds"):
            raise ValueError("communication_options must be a tfdist.CommunicationOptions or "
                             "a tf.distribute.experimental.CommunicationOptions. "
                             f"Received: {options!r}")
        options = CommunicationOptions(
            timeout_seconds=options.timeout_seconds, bytes_per_pack=options.bytes_per_pack,
            implementation=options.implementation.name.lower())
    changes = {}
    for name, value in (("compression", compression), ("accumulate_steps", accumulate_steps)):
        if value is None:
            continue
        current = getattr(options, name)
        default = getattr(CommunicationOptions(), name)
        if current != default and current != value:
            raise ValueError(f"{name} is given twice with different values: "
                             f"{name}={value!r} and communication_options.{name}={current!r}")
        changes[name] = value
    return dataclasses.replace(options, **changes) if changes else options
