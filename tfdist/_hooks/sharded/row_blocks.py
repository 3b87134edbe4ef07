"""A large shard's optimizer update, run on blocks of rows one after the other.

Keras' dense updates (Adam's moments decay on every row) make several shard-sized
temporaries on the ps; `update_in_row_blocks` bounds them by ``update_block_bytes``.
Relies on Keras' private optimizer index and variable ``_value`` (tested in
``tests/test_hooks_sharded.py``).
"""

from __future__ import annotations

import itertools

from tfdist._hooks.sharded.parts import shard_gradient, sharded_slots


# A shard's update runs on blocks of at most this many bytes of rows, one block after
# the other: Keras' dense updates (Adam's moments decay on every row) would otherwise
# make several shard-sized temporaries on the ps.
UPDATE_BLOCK_BYTES = 16 << 20
_row_block_ids = itertools.count()


class _RowBlock:
    """Rows ``start:start + rows`` of a variable, as a Keras optimizer uses a variable:
    read with a gather and written with scatters, so no op touches the other rows."""

    def __init__(self, source, start, rows):
        import tensorflow as tf

        self.source, self.start, self.rows = source, start, rows
        self.shape = tf.TensorShape([rows]).concatenate(source.shape[1:])
        self.dtype, self.device = source.dtype, source.device
        self.name = f"{source.name}/rows_{start}"
        self.writes = []  # the scatter ops that updated these rows
        self._unique_id = f"tfdist_rows_{next(_row_block_ids)}"  # Keras' _var_key

    def _indices(self):
        import tensorflow as tf

        return tf.range(self.start, self.start + self.rows, dtype=tf.int64)

    def __tf_tensor__(self, dtype=None, name=None):
        import tensorflow as tf

        value = self.source.sparse_read(self._indices())
        return value if dtype is None else tf.cast(value, dtype)

    def _slices(self, value):
        import tensorflow as tf

        if isinstance(value, tf.IndexedSlices):
            return tf.cast(value.indices, tf.int64) + self.start, value.values
        return self._indices(), tf.convert_to_tensor(value, self.dtype)

    def _scatter(self, op, value):
        indices, updates = self._slices(value)
        write = op(resource=self.source.handle, indices=indices, updates=updates)
        self.writes.append(write)
        return write

    def assign(self, value):
        import tensorflow as tf

        return self._scatter(tf.raw_ops.ResourceScatterUpdate, value)

    def assign_add(self, value):
        import tensorflow as tf

        return self._scatter(tf.raw_ops.ResourceScatterAdd, value)

    def assign_sub(self, value):
        import tensorflow as tf

        return self._scatter(tf.raw_ops.ResourceScatterSub, value)

    scatter_update, scatter_add, scatter_sub = assign, assign_add, assign_sub


def update_in_row_blocks(optimizer, variable, shard, grad, learning_rate):
    """``optimizer.update_step(grad, shard)`` (inside `optimizer_state._shard_view`), on
    blocks of rows when the shard is larger than the strategy's ``update_block_bytes``
    (default `UPDATE_BLOCK_BYTES`; None: never).

    Why: Keras' dense updates make several shard-sized temporaries on the ps.
    Elementwise, so each row's result is the one the whole shard's update gives, bit
    for bit. Each block starts after the one before has finished (control
    dependencies: without them TF runs them all at once, and their temporaries add up
    to the shard's), so one block's temporaries are freed before the next.
    """
    import numpy as np
    import tensorflow as tf

    block_bytes = getattr(tf.distribute.get_strategy(), "update_block_bytes",
                          UPDATE_BLOCK_BYTES)
    row_bytes = shard.dtype.size * int(np.prod(shard.shape[1:]))
    rows = int(shard.shape[0])
    per_block = rows if block_bytes is None else max(1, block_bytes // max(1, row_bytes))
    if rows <= per_block:
        return optimizer.update_step(grad, shard, learning_rate)

    slots = sharded_slots(optimizer, variable)
    shard_slots = [slot._value for slot in slots]
    indices = optimizer._trainable_variables_indices
    previous = []  # the writes of the block before: the next one starts after them
    for start in range(0, rows, per_block):
        block = _RowBlock(shard, start, min(per_block, rows - start))
        views = [block] + [_RowBlock(value, start, block.rows) for value in shard_slots]
        indices[block._unique_id] = optimizer._get_variable_index(variable)
        for slot, view in zip(slots, views[1:]):
            slot._value = view
        try:
            with tf.control_dependencies(previous):
                optimizer.update_step(shard_gradient(grad, start, block), block,
                                      learning_rate)
        finally:
            for slot, value in zip(slots, shard_slots):
                slot._value = value
            del indices[block._unique_id]
        previous = [write for view in views for write in view.writes]
