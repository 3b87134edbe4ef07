"""What an elastic ``fit``'s commit reads and restores (`tfdist.strategies.elastic.fit`):
the state and metric variables as one flat buffer per dtype."""

from __future__ import annotations

import tensorflow as tf


class Snapshot:
    """The variables a commit reads, and how: one flat buffer per dtype (the reads
    reshaped and concatenated), so that a traced read returns a few tensors however many
    variables there are; split back into one value per variable only to restore.

    Args:
        state: The state variables (`ElasticFit.state_variables`).
        metrics: The metric variables (`ElasticFit.metric_variables`).
        optimizer_count: How many variables the optimizer had (when to list anew).
    """

    def __init__(self, state: list, metrics: list, optimizer_count: int):
        self.state_count = len(state)
        self.optimizer_count = optimizer_count
        self._reads = [_tf_variable(v) for v in (*state, *metrics)]
        self._shapes = [tf.TensorShape(v.shape) for v in self._reads]
        groups: dict = {}
        for index, read in enumerate(self._reads):
            groups.setdefault(tf.as_dtype(read.dtype), []).append(index)
        self._groups = list(groups.values())  # indices of each flat buffer's variables
        self.read = tf.function(self.pack, autograph=False)  # a commit's own call

    def pack(self) -> list:
        """The flat buffers (traced: inside a train step, after it, or alone)."""
        reads = [v.read_for_commit() if hasattr(v, "read_for_commit") else v
                 for v in self._reads]
        return [tf.concat([tf.reshape(reads[i], [-1]) for i in group], axis=0)
                for group in self._groups]

    def unpack(self, flat: list) -> list:
        """One value per variable, in order, from `pack`'s buffers."""
        values = [None] * len(self._reads)
        for group, buffer in zip(self._groups, flat):
            sizes = [self._shapes[i].num_elements() for i in group]
            for i, piece in zip(group, tf.split(buffer, sizes)):
                values[i] = tf.reshape(piece, self._shapes[i])
        return values


def _tf_variable(variable):
    """The TF variable behind a Keras variable (its public ``value``), or ``variable``
    (a TF variable, or a component's entry read by ``read_for_commit``)."""
    if isinstance(variable, tf.Variable) or hasattr(variable, "read_for_commit"):
        return variable
    return variable.value
