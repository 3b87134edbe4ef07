"""Each private TF/Keras hook in tfdist/_hooks/zero.py still exists in this TF/Keras."""

import inspect


def test_plain_variables_leave_the_strategy_scope(logical_cpus):
    import tensorflow as tf

    import tfdist
    from tfdist._hooks.zero import plain_variables

    strategy = tfdist.MirroredStrategy()
    with strategy.scope():
        mirrored = tf.Variable(1.0)
        with plain_variables():
            plain = tf.Variable(1.0)
            assert not tf.distribute.has_strategy()
        assert tf.distribute.get_strategy() is strategy
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    assert not isinstance(plain, tf.distribute.DistributedValues)


def test_weight_decay_rule():
    import keras

    from tfdist._hooks.zero import uses_weight_decay

    kernel, bias = keras.Variable([[1.0]], name="kernel"), keras.Variable([1.0], name="bias")
    opt = keras.optimizers.AdamW(weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    assert uses_weight_decay(opt, kernel) and not uses_weight_decay(opt, bias)
    assert "_use_weight_decay" in inspect.getsource(type(opt)._apply_weight_decay)


def test_nadam_is_known_to_update_outside_update_step():
    import keras

    from tfdist._hooks.zero import backend_update_step_overridden

    assert backend_update_step_overridden(keras.optimizers.Nadam())
    assert not backend_update_step_overridden(keras.optimizers.Adam())


def test_collective_reduce_scatter_members_exist():
    from tensorflow.python.distribute import cross_device_ops, cross_device_utils
    from tensorflow.python.ops import gen_collective_ops

    assert hasattr(gen_collective_ops, "collective_reduce_scatter_v2")
    source = inspect.getsource(cross_device_ops.CollectiveAllReduce.__init__)
    assert "self._launchers" in source
    launcher = cross_device_utils.CollectiveReplicaLauncher
    for name in ("_next_instance_key", "_get_ordering_token"):
        assert hasattr(launcher, name)
    init = inspect.getsource(launcher.__init__)
    for name in ("_group_key", "_group_size", "_device", "_options"):
        assert f"self.{name} =" in init


def test_all_to_all_runs_on_cpu():
    """`collective_all_to_all` relies on TF's CPU ``AllToAll`` collective (only the
    reduce-scatter is NCCL only)."""
    import tensorflow as tf

    with tf.device("/cpu:0"):
        out = tf.raw_ops.CollectiveAllToAllV2(
            input=tf.constant([[1.0, 2.0]]), group_size=1, group_key=(1 << 30) - 7,
            instance_key=(1 << 30) - 7, ordering_token=[], timeout_seconds=30.0)
    assert out.numpy().tolist() == [[1.0, 2.0]]
