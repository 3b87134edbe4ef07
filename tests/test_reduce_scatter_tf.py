"""Reduce-scatter under engine "tf" on CPU: an all-to-all of the blocks and a local sum
(``CollectiveAllToAllV2``), never an all-reduce; against a numpy reference, within the
groups of a mesh (in process, 2 logical CPUs) and across 2 launched workers."""

import numpy as np
import pytest

DTYPES = ("float32", "int32", "float16", "bfloat16")


def _values(replica, length, dtype):
    """Replica ``replica``'s flat value: distinct per replica, exact in every dtype."""
    return (np.arange(length) % 13 + 3 * replica).astype("float32" if dtype == "bfloat16"
                                                           else dtype)


def _reference(length, dtype, op, members):
    """Per replica of ``members``: its block of the group's sum (or mean)."""
    total = sum(_values(r, length, dtype).astype("int64") for r in members)
    if op == "mean":
        total = total / len(members) if dtype != "int32" else total // len(members)
    block = length // len(members)
    return [total[p * block:(p + 1) * block] for p in range(len(members))]


def _group_scatter(strategy, groups, length, dtype, op):
    """``groups.reduce_scatter`` of `_values` in a tf.function: (per-replica numpy
    results, the traced graph's op types)."""
    import tensorflow as tf

    def value(context):
        v = _values(context.replica_id_in_sync_group, length, dtype)
        return tf.cast(tf.constant(v), dtype)

    per_replica = strategy.experimental_distribute_values_from_function(value)

    @tf.function
    def scatter(v):
        return groups.reduce_scatter(strategy, v, op)

    out = scatter(per_replica)
    ops = {node.op for node in
           scatter.get_concrete_function(per_replica).graph.as_graph_def().node}
    results = [tf.cast(part, "float64").numpy() for part in
               strategy.experimental_local_results(out)]
    return results, ops


CASES = [(dtype, "sum") for dtype in DTYPES] + [("float32", "mean"), ("int32", "mean")]
# Across workers an integer mean is a true division (the communicator's, unchanged).
WORKER_CASES = CASES[:-1]


@pytest.mark.parametrize("dtype,op", CASES)
@pytest.mark.parametrize("axis,model_parallel", [("model", 2), ("batch", 1)])
def test_group_reduce_scatter_matches_numpy(logical_cpus, dtype, op, axis, model_parallel):
    import tfdist
    from tfdist.comm.groups import ReplicaGroups

    strategy = tfdist.MirroredStrategy()
    groups = ReplicaGroups(2, model_parallel, axis, strategy.extended.worker_devices,
                           timeout_seconds=60)
    length = 2 * 7  # an odd block: 7 elements each
    results, ops = _group_scatter(strategy, groups, length, dtype, op)
    for replica, got in enumerate(results):  # the layout: position p keeps block p
        want = _reference(length, dtype, op, groups.members(replica))
        np.testing.assert_allclose(got, want[groups.position(replica)], rtol=1e-6)
    assert "CollectiveAllToAllV2" in ops
    assert not ops & {"CollectiveReduceV2", "CollectiveReduceScatterV2"}


def scatter_across_workers():
    """One of 2 launched workers (engine "tf", one CPU replica each): the strategy's
    reduce-scatter of `_values` per dtype and op, the traced op types, the bytes counted."""
    import tensorflow as tf

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(engine="tf")
    communicator = strategy.communicator
    out = {"rank": strategy.rank, "replicas": strategy.num_replicas_in_sync}
    length = 2 * 5
    for dtype, op in WORKER_CASES:
        x = tf.cast(tf.constant(_values(strategy.rank, length, dtype)), dtype)

        @tf.function
        def scatter(v):
            return communicator.reduce_scatter(strategy, [v], op)[0]

        before = communicator.bytes
        got = tf.cast(scatter(x), "float64").numpy()
        ops = {n.op for n in scatter.get_concrete_function(x).graph.as_graph_def().node}
        out[f"{dtype}-{op}"] = (got, sorted(ops), communicator.bytes - before)
    # An uneven length (7) padded with zeros to a multiple of the replicas, as ZeRO's
    # buckets are: rank r's block holds elements [4r, 4r + 4) of the sum.
    uneven = tf.pad(tf.constant(_values(strategy.rank, 7, "float32")), [[0, 1]])
    out["padded"] = tf.function(
        lambda v: communicator.reduce_scatter(strategy, [v], "sum")[0])(uneven).numpy()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_reduce_scatter_is_an_all_to_all():
    from helpers import run_cluster

    results = run_cluster(scatter_across_workers, timeout=280)
    for result in results:
        rank = result["rank"]
        assert result["replicas"] == 2
        for dtype, op in WORKER_CASES:
            got, ops, nbytes = result[f"{dtype}-{op}"]
            want = _reference(10, dtype, op, [0, 1])[rank]
            np.testing.assert_allclose(got, want, rtol=1e-6)
            assert "CollectiveAllToAllV2" in ops, (dtype, op, ops)
            assert not set(ops) & {"CollectiveReduceV2", "CollectiveReduceScatterV2"}
            # One replica's whole payload, the counter's unit (as before the change).
            assert nbytes == 10 * np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize
        want = np.append(_values(0, 7, "float32") + _values(1, 7, "float32"), 0)
        np.testing.assert_array_equal(result["padded"], want[4 * rank:4 * rank + 4])
