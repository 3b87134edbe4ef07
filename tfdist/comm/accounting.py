"""Counting the bytes a strategy all-reduces.

Convention: the payload one worker contributes to an all-reduce, after compression, is
counted once per reduction (not once per local replica, not times the ring factor).
"""

from __future__ import annotations


class ByteCounter:
    """An int64 counter that graph code can increment; read it with `total`.

    Create it outside any strategy scope (e.g. in a strategy's constructor), so the
    variable is a plain host variable, not a distributed one.
    """

    def __init__(self, name: str = "tfdist_bytes_allreduced"):
        import tensorflow as tf

        with tf.init_scope(), tf.device("/cpu:0"):
            self._variable = tf.Variable(0, dtype=tf.int64, trainable=False, name=name,
                                         synchronization=tf.VariableSynchronization.NONE,
                                         aggregation=tf.VariableAggregation.NONE)

    def add(self, nbytes):
        """Adds ``nbytes`` (a Python int or scalar tensor). Call once per reduction."""
        import tensorflow as tf

        return self._variable.assign_add(tf.cast(nbytes, tf.int64))

    @property
    def total(self) -> int:
        return int(self._variable.numpy())
