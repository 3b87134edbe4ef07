"""Each private Keras/TF piece tfdist/_hooks/fsdp.py patches or reads still exists and
behaves as the hooks assume in this TF/Keras."""

import inspect


def test_keras_tf_variable_keeps_what_the_hooks_patch():
    """Read from Keras' source file (the class itself may be patched already)."""
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow import optimizer

    source = inspect.getsource(core)  # the module's file, unpatched
    for text in ("def _initialize(self, value)", "def __tf_tensor__(self, dtype=None, name=None)",
                 "def _direct_assign(self, value)", "def numpy(self)",
                 "def _initialize_with_initializer(self, initializer)",
                 "self._initialize(lambda: initializer(self._shape, dtype=self._dtype))",
                 "self._value = tf.Variable(", "return self.value.handle",
                 "_map_aggregation", "_map_synchronization"):
        assert text in source, text
    assert ("def add_variable_from_reference(\n        self, reference_variable, name=None, "
            'initializer="zeros"\n    )') in inspect.getsource(optimizer)
    layer_source = inspect.getsource(__import__("keras").src.layers.layer)
    assert "def rematerialized_call(self, layer_call, *args, **kwargs)" in layer_source
    assert "self._remat_mode" in layer_source


def test_tf_update_context_and_keras_symbolic_scope():
    from keras.src.backend.common.symbolic_scope import SymbolicScope, in_symbolic_scope
    from tensorflow.python.distribute import distribute_lib

    from tfdist._hooks.tf import in_update as _in_update

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


def test_constant_initializers_make_only_slices(logical_cpus, monkeypatch):
    """Zeros/Ones/Constant (optimizer slots, biases): the initializer is never called
    for the whole shape; each replica's slice is filled (its padding is 0)."""
    import numpy as np

    import keras
    import tfdist
    from tfdist._hooks.fsdp import shard_of, tf_value

    called = []
    original = keras.initializers.Ones.__call__
    monkeypatch.setattr(keras.initializers.Ones, "__call__",
                        lambda self, *a, **k: called.append(a) or original(self, *a, **k))
    strategy = tfdist.MirroredStrategy(shard_parameters=True, min_shard_elements=4)
    with strategy.scope():
        ones = keras.Variable(keras.initializers.Ones(), shape=(3, 5), dtype="float32")
        twos = keras.Variable(keras.initializers.Constant(2.0), shape=(5,), dtype="float32")
    assert not called and shard_of(ones) is not None and shard_of(twos) is not None
    np.testing.assert_array_equal(np.asarray(tf_value(ones).values[1]), [1] * 7 + [0])
    np.testing.assert_array_equal(np.asarray(ones), np.ones((3, 5)))
    np.testing.assert_array_equal(np.asarray(twos), np.full(5, 2.0))
