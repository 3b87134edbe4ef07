"""The collectives of tensor parallelism, in a replica function, each with its gradient.

On a data x model mesh (`tfdist.comm.groups`) ``communicator`` is the model axis'
(`tfdist.strategies.tensor_parallel.splits.ModelAxis`): each collective runs within the m
replicas of one data index, and "the replicas" below are those m.

The batch reaches the replicas split (tf.distribute gives replica r rows
``[r*b, (r+1)*b)`` of the global batch). A split layer's region works on every row:

- `gather_rows` (entering it): forward all-gather of the rows, backward
  reduce-scatter (each replica gets its rows' gradient summed over the model shards);
- `scatter_rows` (leaving a row-parallel layer): forward reduce-scatter of the partial
  sums (each replica keeps its rows, summed over the model shards), backward
  all-gather of the rows' gradients;
- `gather_features` (leaving a column-parallel layer whose consumer needs every
  feature): forward all-gather of the feature slices, then each replica keeps its rows;
  backward all-gather of the rows' gradients, each replica keeps its features.

An all-reduce is a reduce-scatter plus an all-gather: entering and leaving a
column/row pair sends, per replica and direction, what Megatron-LM's ``f`` and ``g``
all-reduces send (docs/tensor_parallel.md). Everything goes through the strategy's
accounted communicator (``bytes_communicated``).
"""

from __future__ import annotations


def merge(fn, *args):
    """``fn(strategy, *args)`` in cross-replica context, from a replica function."""
    import tensorflow as tf

    return tf.distribute.get_replica_context().merge_call(fn, args=args)


def replica_id():
    """This replica's id in sync (a scalar int32 tensor)."""
    import tensorflow as tf

    return tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32)


def model_index(replicas):
    """This replica's index on the "model" axis of size ``replicas`` (a scalar int32
    tensor): replica r of a data x model mesh is model index ``r % m``."""
    return replica_id() % replicas


def _all_gather(communicator, x):
    return merge(lambda d, v: communicator.all_gather(d, v), x)


def _reduce_scatter(communicator, x, replicas):
    """Rows summed over the replicas; replica r keeps row block r."""
    import tensorflow as tf

    flat = tf.reshape(x, [-1])
    out = merge(lambda d, v: communicator.reduce_scatter(d, [v], op="sum")[0], flat)
    rows = tf.shape(x)[0] // replicas
    return tf.reshape(out, tf.concat([[rows], tf.shape(x)[1:]], 0))


def own_block(x, axis, replicas):
    """This replica's block ``r`` of ``replicas`` equal blocks of ``x`` along ``axis``."""
    import tensorflow as tf

    size = x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]
    block = size // replicas
    begin = [0] * len(x.shape)
    begin[axis] = model_index(replicas) * block
    sizes = [-1] * len(x.shape)
    sizes[axis] = block
    out = tf.slice(x, tf.stack(begin), sizes)
    shape = list(x.shape)  # the other axes as they are (a dynamic begin hides them)
    shape[axis] = block if isinstance(block, int) else None
    return tf.ensure_shape(out, shape)


def gather_rows(communicator, x, replicas):
    """Every replica's rows of ``x``; gradient: reduce-scattered rows."""
    import tensorflow as tf

    @tf.custom_gradient
    def op(x):
        def grad(dy):
            return _reduce_scatter(communicator, tf.convert_to_tensor(dy), replicas)

        return _all_gather(communicator, x), grad

    return op(x)


def scatter_rows(communicator, x, replicas):
    """This replica's rows of ``x`` summed over the replicas; gradient: gathered rows."""
    import tensorflow as tf

    @tf.custom_gradient
    def op(x):
        def grad(dy):
            return _all_gather(communicator, tf.convert_to_tensor(dy))

        return _reduce_scatter(communicator, x, replicas), grad

    return op(x)


def move_to_front(x, axis):
    """``x`` with ``axis`` moved first (the axis a group gather concatenates on)."""
    import tensorflow as tf

    rank = len(x.shape)
    axis %= rank
    return tf.transpose(x, [axis] + [i for i in range(rank) if i != axis])


def move_from_front(x, axis):
    """The inverse of `move_to_front`."""
    import tensorflow as tf

    rank = len(x.shape)
    axis %= rank
    order = list(range(1, rank))
    order.insert(axis, 0)
    return tf.transpose(x, order)


def gather_features(communicator, x, replicas, axis=-1):
    """Every row's whole ``axis`` from its slices over the replicas, then this
    replica's rows; gradient: the rows gathered, this replica's slice of ``axis`` kept."""
    import tensorflow as tf

    axis %= len(x.shape)

    @tf.custom_gradient
    def op(x):
        whole = move_from_front(_all_gather(communicator, move_to_front(x, axis)), axis)

        def grad(dy):
            rows = _all_gather(communicator, tf.convert_to_tensor(dy))
            return own_block(rows, axis, replicas)

        return own_block(whole, 0, replicas), grad

    return op(x)
