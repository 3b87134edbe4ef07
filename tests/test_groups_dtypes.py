"""Collectives within the groups of a mesh (engine "tf") take every dtype a Keras
mixed-precision policy computes in, bfloat16 included, against numpy (2 logical CPUs)."""

import numpy as np
import pytest

DTYPES = ("float32", "float16", "bfloat16", "int32")


def _values(replica, dtype):
    """Replica ``replica``'s (3, 2) value: distinct per replica, exact in every dtype."""
    return (np.arange(6).reshape(3, 2) % 5 + 4 * replica).astype(
        "float32" if dtype == "bfloat16" else dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["all_gather", "all_reduce"])
def test_group_collectives_take_every_dtype(logical_cpus, dtype, kind):
    import tensorflow as tf

    import tfdist
    from tfdist.comm.groups import ReplicaGroups

    strategy = tfdist.MirroredStrategy()
    groups = ReplicaGroups(2, 2, "model", strategy.extended.worker_devices,
                           timeout_seconds=60)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: tf.cast(_values(context.replica_id_in_sync_group, dtype), dtype))

    @tf.function
    def collective(v):
        return getattr(groups, kind)(strategy, v)

    out = strategy.experimental_local_results(collective(per_replica))
    parts = [_values(r, dtype).astype("float64") for r in (0, 1)]
    want = np.concatenate(parts) if kind == "all_gather" else parts[0] + parts[1]
    for got in out:
        assert got.dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(tf.cast(got, "float64").numpy(), want)
