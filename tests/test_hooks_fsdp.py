"""Each private Keras/TF piece tfdist/_hooks/fsdp.py patches or reads still exists and
behaves as the hooks assume in this TF/Keras."""

import inspect


def test_keras_tf_variable_keeps_what_the_hooks_patch():
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    source = inspect.getsource(core.Variable)
    for name in ("def _initialize(self, value)", "def __tf_tensor__(self, dtype=None, name=None)",
                 "def _direct_assign(self, value)", "def numpy(self)",
                 "self._value = tf.Variable(", "_map_aggregation", "_map_synchronization"):
        assert name in source, name
    # The value Keras makes is passed to _initialize, and reads go through __tf_tensor__.
    assert "self._initialize(" in inspect.getsource(core.Variable._initialize_with_initializer)
    assert "self.value.handle" in inspect.getsource(core.Variable.handle.fget)  # unpatched
    params = inspect.signature(TFOptimizer.add_variable_from_reference).parameters
    assert list(params) == ["self", "reference_variable", "name", "initializer"]


def test_tf_update_context_and_keras_symbolic_scope():
    from keras.src.backend.common.symbolic_scope import SymbolicScope, in_symbolic_scope
    from tensorflow.python.distribute import distribute_lib

    from tfdist._hooks.fsdp import _in_update

    assert distribute_lib.get_update_replica_id() is None and not _in_update()
    with distribute_lib.UpdateContext(1):
        assert _in_update()
    with SymbolicScope():
        assert in_symbolic_scope()


def test_a_sharded_variable_reads_and_writes_whole_outside_replica_functions(logical_cpus):
    import numpy as np

    import keras
    import tfdist
    from tfdist._hooks.fsdp import shard_of, tf_value

    strategy = tfdist.MirroredStrategy(shard_parameters=True, min_shard_elements=4)
    with strategy.scope():
        variable = keras.Variable(lambda shape, dtype: np.arange(15.0).reshape(shape),
                                  shape=(3, 5), dtype="float32")
        small = keras.Variable(keras.initializers.Zeros(), shape=(3,), dtype="float32")
        given = keras.Variable(np.zeros((3, 5)), dtype="float32")  # a value: kept whole
    assert shard_of(variable) is not None and shard_of(small) is None
    assert shard_of(given) is None
    assert [tuple(v.shape) for v in tf_value(variable).values] == [(8,), (8,)]
    np.testing.assert_array_equal(np.asarray(variable), np.arange(15.0).reshape(3, 5))
    variable.assign(np.ones((3, 5)))
    np.testing.assert_array_equal(variable.numpy(), np.ones((3, 5)))
    np.testing.assert_array_equal(np.asarray(tf_value(variable).values[1]),
                                  [1, 1, 1, 1, 1, 1, 1, 0])  # the padding stays 0
