"""Model averaging: the schedule, and the average through a communicator.

`PeriodicAverager` is the whole algorithm of local SGD's synchronisation, after
PyTorch's ``PeriodicModelAverager``: when to average (`should_average`), and the mean
over every replica of every worker (`average`). Weight *deltas* against an anchor go
through a communicator that may compress them (a cast, or with ``outer_compression``
a quantised all-gather with error feedback, `tfdist.comm.quantize`); exact values
(optimizer slots, BatchNorm statistics) through one that does not, and both count their
bytes in one counter.
"""

from __future__ import annotations

from tfdist.comm.accounting import ByteCounter
from tfdist.comm.communicator import Accounted, StrategyCommunicator
from tfdist.comm.fragments import fragment_offset
from tfdist.comm.quantize import check_outer_compression, get_quantizer, quantized_mean


def is_average_step(step, period: int, warmup_steps: int, offset: int = 0):
    """Whether the weights are averaged after local step number ``step`` (1-based).

    Post-local SGD: every step while ``step <= warmup_steps``, then every ``period``
    steps counted from the end of the warm-up (as PyTorch's `PeriodicModelAverager`),
    ``offset`` steps into each period (a fragment's step, Streaming DiLoCo).
    Works on Python ints and on integer tensors.
    """
    if isinstance(step, int):
        return step <= warmup_steps or (step - warmup_steps) % period == offset
    import tensorflow as tf

    step = tf.cast(step, tf.int64)
    return tf.logical_or(step <= warmup_steps,
                         tf.equal(tf.math.floormod(step - warmup_steps, period), offset))


class PeriodicAverager:
    """Averages every ``period`` steps, every step during ``warmup_steps``.

    Args:
        period: Steps between averages (>= 1).
        warmup_steps: Steps averaged every time first.
        compression: Wire dtype of the weight deltas (None, ``"fp16"``, ``"bf16"``).
        make_communicator: ``f(compression, counter, name)`` returning an `Accounted`
            communicator (an engine's `tfdist.engines.Engine.make_communicator`); by
            default one over the strategy's own cross-device ops.
        fragments: Fragment ``f`` averages ``f * period / fragments`` steps into each
            period (Streaming DiLoCo); ``period`` must be a multiple of it.
        outer_compression: None, ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"int4"``: the
            deltas are quantised with error feedback and all-gathered
            (`tfdist.comm.quantize`); not with ``compression``.

    Raises:
        ValueError: an unknown ``outer_compression``, or both compressions.
    """

    def __init__(self, period: int, warmup_steps: int = 0, compression=None,
                 make_communicator=None, fragments: int = 1, outer_compression=None):
        self.period = period
        self.warmup_steps = warmup_steps
        self.fragments = fragments
        self.quantizer = get_quantizer(check_outer_compression(outer_compression,
                                                               compression))
        make = make_communicator or _strategy_communicator
        counter = ByteCounter("tfdist_model_average_bytes")
        self.deltas = make(compression, counter, "tfdist_model_average")
        self.exact = make(None, counter, "tfdist_model_average_exact")

    @property
    def bytes_communicated(self) -> int:
        """Bytes one replica contributed to averages, after compression."""
        return self.deltas.bytes

    def should_average(self, step, fragment=None):
        """`is_average_step` with this averager's schedule (int or tensor ``step``).

        ``fragment``: whether that fragment averages; None: whether every fragment does.
        """
        if fragment is not None:
            return is_average_step(step, self.period, self.warmup_steps,
                                   fragment_offset(fragment, self.period, self.fragments))
        if self.fragments == 1:
            return is_average_step(step, self.period, self.warmup_steps)
        return step <= self.warmup_steps  # in the warm-up only

    def average(self, distribution, deltas, anchors, values, variables, residuals=None,
                flush=False):
        """Means of per-replica ``deltas`` (to ``anchors``) and exact ``values``.

        Call in cross-replica context. With ``outer_compression``, ``residuals`` are
        the deltas' error-feedback variables (per replica): the deltas go quantised
        (`tfdist.comm.quantize.quantized_mean`), or with ``flush`` (a forced average)
        ``delta + residual`` goes exactly and the residuals become zero.

        Returns:
            ``(mean_deltas, mean_values)``.
        """
        if self.quantizer is not None and residuals is not None:
            mean_deltas = (self._flush(distribution, deltas, anchors, residuals) if flush
                           else quantized_mean(self.deltas, distribution, self.quantizer,
                                               list(deltas), list(residuals)))
        else:
            mean_deltas = self.deltas.all_reduce(distribution, list(deltas), list(anchors))
        mean_values = self.exact.all_reduce(distribution, list(values), list(variables))
        return mean_deltas, mean_values

    def _flush(self, distribution, deltas, anchors, residuals):
        """Cross-replica: the exact mean of ``delta + residual``; zeroes the residuals."""
        import tensorflow as tf

        from tfdist._hooks import tf as tf_hooks

        regroup = tf_hooks.tf_distribute_internals().regroup
        local = distribution.experimental_local_results
        totals = []
        for delta, residual in zip(deltas, residuals):
            parts = []
            for part, copy in zip(local(delta), local(residual)):
                with tf.device(part.device):
                    parts.append(part + tf.cast(copy.read_value(), part.dtype))
            totals.append(regroup(parts) if len(parts) > 1 else parts[0])
        means = self.deltas.all_reduce(distribution, totals, list(anchors))
        for residual in residuals:
            distribution.extended.update(residual, lambda r: r.assign(tf.zeros_like(r)),
                                         group=False)
        return means


def _strategy_communicator(compression, counter, name) -> Accounted:
    del name
    return Accounted(StrategyCommunicator(), compression, counter)
