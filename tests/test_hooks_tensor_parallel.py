"""Each private Keras/TF point tfdist/_hooks/tensor_parallel.py uses still exists."""

import inspect


def test_variable_points_the_split_hooks_patch():
    from keras.src.backend.common import KerasVariable
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    cls = core.Variable
    for name in ("_initialize", "__tf_tensor__", "numpy", "__array__", "assign"):
        assert callable(getattr(cls, name)), name
    # The shape Keras reports is the private _shape, set before _initialize runs.
    source = inspect.getsource(KerasVariable.__init__)
    assert source.index("self._shape = self._validate_shape(shape)") < source.index(
        "self._initialize_with_initializer(initializer)")
    assert "return self._shape" in inspect.getsource(KerasVariable.shape.fget)
    # assign checks the whole shape, then writes through _direct_assign.
    assert "_direct_assign" in inspect.getsource(KerasVariable.assign)
    assert "add_variable_from_reference" in TFOptimizer.__dict__
    # A split slot is made at its stored shape: the initializer reads _shape when called.
    made = []
    variable = cls.__new__(cls)
    variable._shape, variable._dtype = (4,), "float32"
    variable._initialize = lambda value: made.append((variable._shape, value))
    cls._initialize_with_initializer(variable, lambda shape, dtype: shape)
    variable._shape = (2,)
    assert made[0][1]() == (2,)


def test_model_graph_points(logical_cpus):
    import keras

    from tfdist._hooks.tensor_parallel import all_layers, consumers, output_layers

    inputs = keras.Input((3,))
    first = keras.layers.Dense(4, name="first")
    second = keras.layers.Dense(2, name="second")
    model = keras.Model(inputs, second(first(inputs)))
    assert [layer.name for layer in all_layers(model)][-2:] == ["first", "second"]
    assert consumers(first) == [second]
    assert output_layers(model) == [second]


def test_attention_parts_and_masks(logical_cpus):
    import keras

    from tfdist._hooks.tensor_parallel import attention_parts, keras_mask_of

    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)
    x = keras.ops.ones((1, 3, 4))
    layer(x, x)
    assert sorted(attention_parts(layer)) == ["key", "output", "query", "value"]
    assert all(isinstance(p, keras.layers.EinsumDense) for p in attention_parts(layer).values())
    assert keras_mask_of(x) is None
    masked = keras.layers.Masking()(keras.ops.ones((1, 3, 4)))
    assert keras_mask_of(masked) is not None


def test_keras_mask_is_set_and_cleared(logical_cpus):
    """set_keras_mask wraps Keras' private backend.set_keras_mask (the attention split
    by heads puts its rows' mask on the query and output)."""
    import keras
    from keras.src import backend

    from tfdist._hooks.tensor_parallel import keras_mask_of, set_keras_mask

    assert callable(getattr(backend, "set_keras_mask", None)), (
        "Keras no longer has backend.set_keras_mask: tfdist._hooks.tensor_parallel."
        "set_keras_mask must be rewritten")
    x = keras.ops.ones((1, 3, 4))
    mask = keras.ops.convert_to_tensor([[True, False, True]])
    set_keras_mask(x, mask)
    assert keras_mask_of(x) is mask
    set_keras_mask(x, None)
    assert keras_mask_of(x) is None


def test_symbolic_scope_and_update_replica_id():
    from keras.src.backend.common.symbolic_scope import SymbolicScope

    from tfdist._hooks.tensor_parallel import in_shape_inference
    from tfdist._hooks.tf import in_update as _in_update

    assert not in_shape_inference()
    with SymbolicScope():
        assert in_shape_inference()
    assert _in_update() is False


def test_creating_layer_is_the_layer_whose_add_weight_runs(logical_cpus):
    """creating_layer reads the ``caller`` of Keras' private name-scope stack, which
    ``Layer.add_weight`` opens with ``caller=self`` (a split EinsumDense kernel's kind
    comes from its layer's equation)."""
    import keras

    from tfdist._hooks.tensor_parallel import creating_layer

    seen = []

    class Probe(keras.layers.Layer):
        def build(self, input_shape):
            self.add_weight(shape=(2,), initializer=lambda *a, **k: seen.append(
                creating_layer()) or keras.ops.zeros((2,)))

    probe = Probe(name="probe")
    probe.build((None, 2))
    assert seen == [probe]
    assert creating_layer() is None
