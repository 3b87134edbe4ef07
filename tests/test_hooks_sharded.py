"""Each private TF/Keras hook in tfdist/_hooks/sharded/ still exists in this TF/Keras.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect

import pytest


def test_shard_aware_gradients_join_shard_gradients():
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.distribute import parameter_server_strategy as pss

    from tfdist._hooks.sharded.gradients import shard_aware_gradients

    # What the gradient hook works around, and what allow_sharded_updates replaces.
    from keras.src.backend.tensorflow import core

    assert "self.value.handle" in inspect.getsource(core.Variable.handle.fget)
    assert "colocate_with(var)" in inspect.getsource(pss.ParameterServerStrategyExtended._update)
    for name in ("_select_single_value", "_local_results"):
        assert hasattr(pss.ParameterServerStrategyExtended, name)

    table = np.arange(12, dtype="float32").reshape(6, 2)
    sharded = tf.__internal__.distribute.ShardedVariable(
        [tf.Variable(table[:4]), tf.Variable(table[4:])])
    plain = tf.Variable(table)
    ids = tf.constant([0, 5, 5, 2])

    class Holder:  # stands for a Keras variable whose value is sharded
        value = sharded

    with shard_aware_gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(sharded), ids) ** 2)
        (grad,) = tape.gradient(loss, [Holder()])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(plain, ids) ** 2)
    (expected,) = tape.gradient(loss, [plain])
    np.testing.assert_allclose(tf.convert_to_tensor(grad), tf.convert_to_tensor(expected))
    assert tf.GradientTape.gradient.__name__ == "gradient"  # restored


def _sharded_keras_variable(value, shards):
    """A Keras variable whose value is a ShardedVariable of ``shards`` shards on axis 0,
    as a partitioner under a parameter-server strategy makes it."""
    import keras
    import numpy as np
    import tensorflow as tf

    variable = keras.Variable(np.zeros_like(value))
    variable._value = tf.__internal__.distribute.ShardedVariable(
        [tf.Variable(part) for part in np.array_split(value, shards)])
    return variable


def test_sharded_variables_save_and_restore_through_keras_and_checkpoints(tmp_path):
    import inspect

    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow.core import Variable
    from tensorflow.python.checkpoint import restore, save_util
    from tensorflow.python.training.saving import saveable_object_util

    from tfdist._hooks.sharded.saving import install_sharded_saving

    # The private pieces tfdist._hooks.sharded.saving relies on.
    assert "_value" in vars(keras.Variable(1.0))
    assert "_gather_saveables_for_checkpoint" in vars(tf.__internal__.distribute.ShardedVariable
                                                       .__mro__[1])
    for module in (save_util, restore):
        assert "saveable_object_util.trackable_has_serialize_to_tensor" in \
            inspect.getsource(module), (
                f"{module.__name__} no longer looks up trackable_has_serialize_to_tensor "
                "on its module: tfdist._hooks.sharded.saving's patch does nothing now")
    install_sharded_saving()
    install_sharded_saving()  # idempotent
    table = np.arange(40, dtype="float32").reshape(10, 4)
    two = _sharded_keras_variable(table, 2)
    assert not saveable_object_util.trackable_has_serialize_to_tensor(two)
    assert saveable_object_util.trackable_has_serialize_to_tensor(keras.Variable(table))
    assert isinstance(two, Variable)
    # Keras' saving reads with np.array / numpy() and writes with assign.
    np.testing.assert_array_equal(np.array(two), table)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(two), table)
    np.testing.assert_array_equal(two.numpy(), table)
    two.assign(table + 1)
    np.testing.assert_array_equal(two.value.variables[1].numpy(), table[5:] + 1)
    two.assign(table)
    # tf.train.Checkpoint: slices of one tensor, restorable into any number of shards.
    saved = tf.train.Checkpoint(v=two).write(str(tmp_path / "two"))
    for target in (_sharded_keras_variable(0 * table, 3), _sharded_keras_variable(0 * table, 1),
                   keras.Variable(0 * table)):
        tf.train.Checkpoint(v=target).read(saved).assert_consumed()
        np.testing.assert_array_equal(np.array(target), table)
    plain = tf.train.Checkpoint(v=keras.Variable(table)).write(str(tmp_path / "plain"))
    three = _sharded_keras_variable(0 * table, 3)
    tf.train.Checkpoint(v=three).read(plain).assert_consumed()
    np.testing.assert_array_equal(np.array(three), table)


def _keras_variable_over_shards(table, rows):
    """A Keras variable whose value is a `ShardedVariable` split after ``rows`` rows, as a
    partitioner under ParameterServerStrategy makes it."""
    import keras
    import tensorflow as tf

    parts = [tf.Variable(table[:rows]), tf.Variable(table[rows:])]

    def creator(next_creator, **kwargs):
        return tf.__internal__.distribute.ShardedVariable(parts)

    with tf.variable_creator_scope(creator):
        return keras.Variable(initializer="zeros", shape=table.shape, dtype="float32",
                              name="table")


def test_sharded_optimizer_state_keras_internals():
    """What install_sharded_optimizer_state replaces and relies on (Keras/TF private)."""
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers import base_optimizer

    from tfdist._hooks.sharded.optimizer_state import ELEMENTWISE_OPTIMIZERS

    # Keras colocates each slot with the variable's value: a ShardedVariable's is on the chief.
    add = TFOptimizer.add_variable_from_reference
    assert "colocate_vars_with" in inspect.getsource(inspect.unwrap(add))
    update = TFOptimizer._distributed_tf_update_step
    assert "distribution.extended.update(" in inspect.getsource(
        inspect.unwrap(update))
    params = list(inspect.signature(
        base_optimizer.BaseOptimizer.add_variable_from_reference).parameters)
    assert params == ["self", "reference_variable", "name", "initializer"], params
    assert "self.add_variable(" in inspect.getsource(
        base_optimizer.BaseOptimizer.add_variable_from_reference)
    # Slot lookup by the private index dict and _var_key; ShardedVariable's key.
    assert "self._trainable_variables_indices[self._var_key(variable)]" in inspect.getsource(
        base_optimizer.BaseOptimizer._get_variable_index)
    assert "_unique_id" in inspect.getsource(TFOptimizer._var_key)
    sharded = tf.__internal__.distribute.ShardedVariable([tf.Variable([1.0]), tf.Variable([2.0])])
    assert isinstance(sharded._unique_id, str) and len(sharded.variables) == 2
    # Keras' TF variable keeps its value in _value, and reads and writes through it.
    from keras.src.backend.tensorflow.core import Variable
    from keras.src.backend.common.variables import Variable as KerasVariable

    # Keras' own method under any tfdist patches (each names what it wraps).
    assert "self._value" in inspect.getsource(inspect.unwrap(Variable._initialize))
    assert "self._value" in inspect.getsource(KerasVariable.value.fget)
    assert "variable.value" in inspect.getsource(TFOptimizer.assign_add)
    for name in ELEMENTWISE_OPTIMIZERS:
        assert callable(getattr(keras.optimizers, name).update_step), name


@pytest.mark.parametrize("block_rows", [None, 2])
def test_sharded_optimizer_state_shards_slots_and_updates_shard_by_shard(
        monkeypatch, block_rows):
    """Slots sharded like their variable, one update per shard (or per block of rows of
    a shard, as for a large shard: ``block_rows``), equal to the unsharded update."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist._hooks.sharded.gradients import install_shard_aware_gradients
    from tfdist._hooks.sharded import row_blocks
    from tfdist._hooks.sharded.optimizer_state import (install_sharded_optimizer_state,
                                                       updates_shard_by_shard)
    from tfdist._hooks.sharded.parts import sharded_slots

    if block_rows:
        monkeypatch.setattr(row_blocks, "UPDATE_BLOCK_BYTES", block_rows * 3 * 4)  # 3 float32
    install_shard_aware_gradients()
    install_sharded_optimizer_state()
    table = np.random.default_rng(0).normal(size=(7, 3)).astype("float32")
    ids = tf.constant([0, 6, 6, 2, 4])
    for make in (lambda: keras.optimizers.Adam(0.1), lambda: keras.optimizers.SGD(0.1, 0.9),
                 lambda: keras.optimizers.RMSprop(0.1, centered=True)):
        sharded, plain = _keras_variable_over_shards(table, 4), keras.Variable(table)
        sharded_opt, plain_opt = make(), make()
        sharded_opt.build([sharded])
        seen = []
        update_step = sharded_opt.update_step

        def recording_update_step(gradient, variable, learning_rate, update_step=update_step):
            seen.append(tuple(variable.shape))
            return update_step(gradient, variable, learning_rate)

        sharded_opt.update_step = recording_update_step
        slots = sharded_slots(sharded_opt, sharded)
        assert slots and len(slots) == len(sharded_opt.variables) - 2  # all but iteration, lr
        for slot in slots:
            assert [tuple(p.shape) for p in slot.value.variables] == [(4, 3), (3, 3)]
            assert [p.device for p in slot.value.variables] == \
                [p.device for p in sharded.value.variables]

        @tf.function
        def sharded_step(scale):
            with tf.GradientTape() as tape:  # a sparse gradient, then a dense one
                loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(sharded), ids) ** 2)
                loss += scale * tf.reduce_sum(tf.convert_to_tensor(sharded))
            sharded_opt.apply(tape.gradient(loss, [sharded]), [sharded])

        for step in range(3):
            sharded_step(tf.constant(float(step)))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(plain), ids) ** 2)
                loss += float(step) * tf.reduce_sum(tf.convert_to_tensor(plain))
            plain_opt.apply(tape.gradient(loss, [plain]), [plain])
        # Traced once: one update per shard, or per block of rows of each shard.
        assert seen == ([(2, 3), (2, 3), (2, 3), (1, 3)] if block_rows else
                        [(4, 3), (3, 3)]), seen
        np.testing.assert_allclose(tf.convert_to_tensor(sharded.value), plain.numpy(),
                                   atol=1e-6, rtol=0)
        for got, want in zip(sharded_opt.variables, plain_opt.variables):
            np.testing.assert_allclose(tf.convert_to_tensor(got.value), want.numpy(),
                                       atol=1e-6, rtol=0, err_msg=got.path)
    assert updates_shard_by_shard(keras.optimizers.AdamW())
    assert not updates_shard_by_shard(keras.optimizers.Lamb())  # layer-wise norms


def test_sharded_embedding_lookup_gathers_shard_by_shard():
    """Keras' Embedding.call is still ops.take on the whole table (what the hook replaces
    for sharded tables); the shard-by-shard lookup and its gradient equal Keras' own."""
    import inspect

    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.layers.core.embedding import Embedding

    from tfdist._hooks.sharded.embedding import div_partitioned, install_sharded_embedding_lookup
    from tfdist._hooks.sharded.gradients import install_shard_aware_gradients
    from tfdist._hooks.sharded.parts import sharded_parts

    install_sharded_embedding_lookup()
    install_shard_aware_gradients()
    original = Embedding.call._tfdist_original
    assert "ops.take(self.embeddings, inputs, axis=0)" in inspect.getsource(original), (
        "Keras' Embedding.call changed: review "
        "tfdist._hooks.sharded.embedding.install_sharded_embedding_lookup")
    table = np.arange(40, dtype="float32").reshape(10, 4) / 7
    ids = np.array([[0, 9, 3], [4, 4, 7]], dtype="int64")
    for sizes, shard_by_shard in (([4, 3, 3], True), ([2, 8], False)):
        layer = Embedding(10, 4)
        layer.build((None, 3))
        parts = np.split(table, np.cumsum(sizes)[:-1])
        layer._embeddings._value = tf.__internal__.distribute.ShardedVariable(
            [tf.Variable(p) for p in parts])
        assert div_partitioned(sharded_parts(layer._embeddings)) == shard_by_shard
        with tf.GradientTape() as tape:
            out = layer(ids)
            loss = tf.reduce_sum(out * out)
        grad = tape.gradient(loss, layer._embeddings)
        np.testing.assert_array_equal(out.numpy(), table[ids])
        expected = np.zeros_like(table)
        np.add.at(expected, ids.ravel(), 2 * table[ids].reshape(-1, 4))
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), expected, rtol=1e-6)
        np.testing.assert_array_equal(tf.function(layer)(ids).numpy(), table[ids])
    plain = Embedding(10, 4)
    plain.build((None, 3))
    plain._embeddings.assign(table)
    np.testing.assert_array_equal(plain(ids).numpy(), table[ids])
    assert isinstance(keras.layers.Embedding(2, 2), Embedding)


def test_initial_rows_of_a_shard_are_the_whole_draws_rows():
    """A shard's initial value drawn alone equals the same rows of the whole draw, bit
    for bit (TF's Philox counter, 4 float32 per step); other initializers say None."""
    import inspect

    import keras
    import numpy as np
    from tensorflow.python.distribute import parameter_server_strategy_v2 as ps_v2

    from tfdist._hooks.sharded.initialization import initial_rows

    assert "partition_shape=partition_shape, partition_offset=partition_offset" in \
        inspect.getsource(ps_v2.ParameterServerStrategyV2Extended._create_variable), \
        "TF no longer passes each shard's rows to the initial value: review initial_rows"
    shape = (1001, 6)
    init = keras.initializers
    for initializer in (init.RandomUniform(-0.05, 0.05), init.get("uniform"),
                        init.GlorotUniform(), init.HeUniform(seed=3), init.RandomNormal(0.1, 2.),
                        init.VarianceScaling(2.0, "fan_avg", "untruncated_normal"),
                        init.Zeros(), init.Constant(3.0)):
        whole = np.asarray(initializer(shape, dtype="float32"))
        for start, rows in ((0, 334), (334, 334), (668, 333), (2, 5)):
            part = initial_rows(initializer, shape, "float32", (rows, 6), (start, 0))
            np.testing.assert_array_equal(np.asarray(part), whole[start:start + rows],
                                          err_msg=type(initializer).__name__)
    for initializer in (init.TruncatedNormal(), init.Orthogonal(), init.GlorotNormal(),
                        init.RandomUniform(seed=keras.random.SeedGenerator(1))):
        assert initial_rows(initializer, shape, "float32", (5, 6), (4, 0)) is None
    assert initial_rows(init.RandomUniform(), (9, 1), "float32", (4, 1), (5, 0)) \
        is None  # row 5 starts inside a counter step
    assert initial_rows(init.RandomUniform(), shape, "float64", (5, 6), (4, 0)) is None


def test_keras_variable_initialization_is_what_the_shaped_version_replays():
    """tfdist passes shape= to the tf.Variable Keras creates (under a partitioner):
    Keras' own creation must still be these calls."""
    import inspect

    from keras.src.backend.tensorflow.core import Variable

    from tfdist._hooks.sharded.initialization import install_shard_sized_initialization

    install_shard_sized_initialization()
    original = inspect.unwrap(Variable._initialize_with_initializer)  # Keras' own
    assert "self._initialize(lambda: initializer(self._shape, dtype=self._dtype))" in (
        inspect.getsource(original)), \
        "review tfdist._hooks.sharded.initialization.install_shard_sized_initialization"
    source = inspect.getsource(inspect.unwrap(Variable._initialize))
    for piece in ("tf.Variable(", "dtype=self._dtype", "trainable=self.trainable",
                  "name=self.name", "aggregation=self._map_aggregation(self.aggregation)",
                  "synchronization=self._map_synchronization(self.synchronization)"):
        assert piece in source, f"Keras' Variable._initialize no longer has {piece}"


def test_sharded_variable_is_read_back_as_its_shards():
    import numpy as np
    import tensorflow as tf

    from tfdist._hooks.sharded.parts import sharded_parts, sharded_variable

    shards = [tf.Variable(np.zeros((2, 3), "float32")), tf.Variable(np.ones((1, 3), "float32"))]
    variable = sharded_variable(shards)
    assert isinstance(variable, tf.__internal__.distribute.ShardedVariable)
    assert [id(p) for p in sharded_parts(variable)] == [id(s) for s in shards]
    np.testing.assert_array_equal(tf.convert_to_tensor(variable).numpy(),
                                  [[0, 0, 0], [0, 0, 0], [1, 1, 1]])
