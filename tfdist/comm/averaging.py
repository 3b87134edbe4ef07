"""Model averaging math: the sync schedule and the all-reduce of weight deltas.

Kept free of strategy logic so it can be tested and reused: `is_average_step` is the
schedule of `tfdist.ModelAverageStrategy`, `allreduce_mean` reduces a list of
per-replica tensors to their mean with TF's cross-device ops or with Horovod.
"""

from __future__ import annotations

BACKENDS = ("tf", "horovod")


def is_average_step(step, period: int, warmup_steps: int):
    """Whether the weights are averaged after local step number ``step`` (1-based).

    Post-local SGD: every step while ``step <= warmup_steps``, then every ``period``
    steps counted from the end of the warm-up (as PyTorch's `PeriodicModelAverager`).
    Works on Python ints and on integer tensors.
    """
    if isinstance(step, int):
        return step <= warmup_steps or (step - warmup_steps) % period == 0
    import tensorflow as tf

    step = tf.cast(step, tf.int64)
    return tf.logical_or(step <= warmup_steps,
                         tf.equal(tf.math.floormod(step - warmup_steps, period), 0))


def allreduce_mean(distribution, values, destinations, backend: str = "tf",
                   name: str = "tfdist_model_average"):
    """Means of per-replica ``values`` across every replica of every worker.

    Call in cross-replica context (inside a ``merge_call``).

    Args:
        distribution: The strategy.
        values: List of per-replica tensors (one `tf.distribute.DistributedValues`
            each, as ``merge_call`` hands them over).
        destinations: Variables whose devices receive the result (one per value).
        backend: ``"tf"`` (the strategy's own cross-device / collective ops) or
            ``"horovod"`` (`tfdist.comm.horovod.allreduce`; one replica per rank).
        name: Name prefix of the Horovod ops (ranks match tensors by name).

    Returns:
        One reduced value per input: mirrored on ``destinations`` (tf), or a plain
        tensor (horovod).
    """
    import tensorflow as tf

    if not values:
        return []
    if backend == "tf":
        return distribution.extended.batch_reduce_to(
            tf.distribute.ReduceOp.MEAN, list(zip(values, destinations)))
    if backend == "horovod":
        from tfdist.comm import horovod as hvd_comm  # lazy: only with backend="horovod"

        local = []
        for value in values:
            parts = distribution.experimental_local_results(value)
            if len(parts) != 1:
                raise ValueError("backend='horovod' runs one replica per process (rank). "
                                 f"Received: {len(parts)} local replicas")
            local.append(parts[0])
        return hvd_comm.allreduce(local, op="average", compression=None, name=name)
    raise ValueError(f"backend must be one of {BACKENDS}. Received: backend={backend!r}")
