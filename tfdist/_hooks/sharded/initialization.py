"""Hook: a sharded Keras variable's initial value is drawn shard by shard, on its ps.

See `install_shard_sized_initialization` and `initial_rows` for why and how;
``tests/test_hooks_sharded.py`` fails loudly when a TF/Keras upgrade removes what they
touch.
"""

from __future__ import annotations


def install_shard_sized_initialization() -> None:
    """Under a strategy with a variable partitioner, Keras variables tell TF their shape.
    Idempotent.

    Why: Keras 3 creates ``tf.Variable(lambda: initializer(shape))`` without ``shape=``,
    so TF's parameter-server strategy computes the whole initial value on the chief,
    then ships a slice to each ps (5x the table on the chief for a 2-shard table,
    benchmarks/sharded_embedding.md). Given the shape, TF runs the initializer inside
    each shard's creation on its ps, passing the shard's ``partition_shape`` and
    ``partition_offset``; `initial_rows` then draws that shard's rows only, and other
    initializers compute the whole value, of which TF keeps the shard's rows. Either
    way the values equal the unsharded ones.
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow.core import Variable

    patch = Variable._initialize_with_initializer
    while patch is not None:  # other tfdist patches may wrap it since: each names what it wraps
        if getattr(patch, "_tfdist_shaped", False):
            return
        patch = getattr(patch, "__wrapped__", None)
    original = Variable._initialize_with_initializer

    def _initialize_with_initializer(self, initializer):
        strategy = tf.distribute.get_strategy()
        if getattr(strategy.extended, "_variable_partitioner", None) is None:
            return original(self, initializer)
        shape, dtype = self._shape, self._dtype

        def initial_value(partition_shape=None, partition_offset=None):
            # TF's protocol: called once per shard with these; a full value is sliced.
            if partition_shape is not None:
                rows = initial_rows(initializer, shape, dtype, partition_shape,
                                    partition_offset)
                if rows is not None:
                    return rows
            return initializer(shape, dtype=dtype)

        self._value = tf.Variable(
            initial_value, shape=shape, dtype=dtype, trainable=self.trainable,
            name=self.name, aggregation=self._map_aggregation(self.aggregation),
            synchronization=self._map_synchronization(self.synchronization))

    _initialize_with_initializer._tfdist_shaped = True
    _initialize_with_initializer._tfdist_original = original
    _initialize_with_initializer.__wrapped__ = original
    Variable._initialize_with_initializer = _initialize_with_initializer


# float32 values of a Philox uniform or normal draw per counter step (TF's CPU kernels).
_FLOAT32_PER_PHILOX_STEP = 4


def _draws_elementwise(initializer) -> bool:
    """Whether ``initializer`` is one stateless uniform or normal draw of its shape,
    scaled and shifted (Keras' RandomUniform, RandomNormal, and VarianceScaling with a
    uniform or untruncated normal draw: Glorot/He/LeCun uniform), with an int seed."""
    import keras

    init = keras.initializers
    kind = type(initializer)
    if not isinstance(getattr(initializer, "seed", None), int):
        return False  # a SeedGenerator draws anew on each call
    if kind in (init.RandomUniform, init.RandomNormal):
        return True
    return isinstance(initializer, init.VarianceScaling) and \
        kind.__call__ is init.VarianceScaling.__call__ and \
        initializer.distribution in ("uniform", "untruncated_normal")


def initial_rows(initializer, shape, dtype, partition_shape, partition_offset):
    """The rows of ``initializer(shape, dtype)`` that one shard holds, computed alone;
    None where that is not known to be possible (the caller computes the whole value).

    Why: drawn alone, a shard's rows are computed on its ps only, not the whole table
    on the chief (`install_shard_sized_initialization`).

    Keras' constant initializers are called at the shard's shape. A random draw of
    Keras (`_draws_elementwise`) calls ``tf.random.stateless_uniform``/``_normal`` on
    the whole shape: while it runs those draw the shard's rows only, from TF's own
    key and counter advanced past the rows before (Philox makes 4 float32 values per
    counter step), then scale and shift them as TF does. The values are the whole
    draw's rows, bit for bit (tests/test_hooks_sharded.py checks it against the whole draw).
    """
    import numpy as np
    import keras
    import tensorflow as tf

    init = keras.initializers
    rows_shape = [int(d) for d in partition_shape]
    if type(initializer) in (init.Zeros, init.Ones, init.Constant):
        return initializer(tuple(rows_shape), dtype=dtype)
    whole = tuple(int(d) for d in shape)
    skip, rest = divmod(int(partition_offset[0]) * int(np.prod(whole[1:])),
                        _FLOAT32_PER_PHILOX_STEP)
    if rest or tf.as_dtype(dtype) != tf.float32 or not _draws_elementwise(initializer):
        return None

    def rows_of(raw_op, scale_and_shift):
        def draw(shape, seed, *args, **kwargs):
            if tuple(int(d) for d in shape) != whole:
                raise ValueError(f"a draw of shape {shape}, not the variable's {whole}")
            key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
            low = counter[0] + tf.constant(skip, tf.uint64)  # a 128-bit counter: carry
            counter = tf.stack([low, counter[1] + tf.cast(low < counter[0], tf.uint64)])
            values = raw_op(shape=rows_shape, key=key, counter=counter, alg=1,  # Philox
                            dtype=tf.float32)
            return scale_and_shift(values, *args, **kwargs)
        return draw

    def uniform(values, minval=0, maxval=None, dtype=None, name=None, alg=None):
        low = tf.convert_to_tensor(minval, tf.float32)
        high = tf.convert_to_tensor(1 if maxval is None else maxval, tf.float32)
        return tf.add(values * (high - low), low)

    def normal(values, mean=0.0, stddev=1.0, dtype=None, name=None, alg=None):
        return tf.add(values * tf.convert_to_tensor(stddev, tf.float32),
                      tf.convert_to_tensor(mean, tf.float32))

    saved = tf.random.stateless_uniform, tf.random.stateless_normal
    tf.random.stateless_uniform = rows_of(tf.raw_ops.StatelessRandomUniformV2, uniform)
    tf.random.stateless_normal = rows_of(tf.raw_ops.StatelessRandomNormalV2, normal)
    try:
        value = initializer(whole, dtype=dtype)
    finally:
        tf.random.stateless_uniform, tf.random.stateless_normal = saved
    return value if list(value.shape) == rows_shape else None
