"""Hook: saving and restoring Keras variables that a partitioner split into shards.

Under ``tfdist.ParameterServerStrategy(variable_partitioner=...)`` the value of a Keras
variable (a weight, or an optimizer variable) is a TF ``ShardedVariable``: one
variable per ps task, split along axis 0. Keras 3 does not know that type, and TF's
checkpointing does not expect it inside a Keras variable:

- Keras' own saving (``model.save`` to ``.keras``, ``save_weights``, ``ModelCheckpoint``,
  ``BackupAndRestore``) reads each variable with ``np.array(variable)``, which calls
  ``value.__array__``: a ``ShardedVariable`` has ``numpy()`` but no ``__array__``
  ("'ShardedVariable' object has no attribute '__array__'"). Writing is
  ``variable.assign(array)``, which ``ShardedVariable.assign`` already splits.
- ``tf.train.Checkpoint`` asks the Keras variable for its tensors
  (``_serialize_to_tensors``); Keras hands over the ``ShardedVariable`` as if it were
  one tensor, and TF's saver fails on its missing ``device``.

`install_sharded_saving` fixes both, for every ``ShardedVariable`` whichever object owns it:

- ``ShardedVariable.__array__`` concatenates the shards (as its ``numpy()`` does), so
  Keras reads one full array and writes full arrays to its files. A saved ``.keras``
  model or weights file then loads anywhere as an ordinary model, and a backup made
  with N ps tasks restores with any other number.
- A Keras variable whose value is sharded is checkpointed the way TF checkpoints a
  bare ``ShardedVariable``: each shard is saved, from its own ps, as a slice of one
  full tensor under the key an unsharded variable would use
  (``ShardedVariable._gather_saveables_for_checkpoint``, TF's legacy saveable path).
  TF's reader assembles any slice from the slices saved, so a checkpoint restores
  into another number of shards, or into an unsharded variable (no strategy), and
  the other way round. (The newer ``_serialize_to_tensors`` path can save slices, but
  its restore, ``TrackableSaveable.restore``, keeps only the first slice of a name.)

Everything touched here is private TF/Keras behaviour; ``tests/test_hooks_sharded.py`` fails
loudly if an upgrade removes it.
"""

from __future__ import annotations


def sharded_value(variable):
    """The ``ShardedVariable`` behind a Keras variable (or itself), else None.

    Why: a Keras variable keeps its TF value in the private ``_value``.
    """
    import tensorflow as tf

    value = getattr(variable, "_value", variable)  # a Keras variable holds it in _value
    return value if isinstance(value, tf.__internal__.distribute.ShardedVariable) else None


def install_sharded_saving() -> None:
    """Makes Keras' saving and ``tf.train.Checkpoint`` handle sharded variables.

    Why: Keras reads a variable with ``np.array`` (a ``ShardedVariable`` has no
    ``__array__``) and TF's saver fails on one inside a Keras variable; the module
    docstring says how each is fixed. Idempotent; nothing changes for variables that
    are not sharded.
    """
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow.core import Variable
    from tensorflow.python.training.saving import saveable_object_util

    sharded_class = tf.__internal__.distribute.ShardedVariable
    if getattr(sharded_class, "_tfdist_sharded_io", False):
        return

    if "__array__" not in vars(sharded_class):  # a TF that has its own keeps it
        def __array__(self, dtype=None, copy=None):
            """The full value: the shards concatenated along axis 0."""
            del copy  # always a new array
            return np.asarray(self.numpy(), dtype=dtype)

        sharded_class.__array__ = __array__

    has_serialize = saveable_object_util.trackable_has_serialize_to_tensor
    gather = Variable._gather_saveables_for_checkpoint

    def trackable_has_serialize_to_tensor(obj):
        if isinstance(obj, Variable) and sharded_value(obj) is not None:
            return False  # saved by its shards' slice saveables (TF's legacy path)
        return has_serialize(obj)

    def _gather_saveables_for_checkpoint(self):
        sharded = sharded_value(self)
        if sharded is None:
            return gather(self)
        return sharded._gather_saveables_for_checkpoint()

    trackable_has_serialize_to_tensor.__doc__ = has_serialize.__doc__
    _gather_saveables_for_checkpoint.__doc__ = gather.__doc__
    saveable_object_util.trackable_has_serialize_to_tensor = trackable_has_serialize_to_tensor
    Variable._gather_saveables_for_checkpoint = _gather_saveables_for_checkpoint
    sharded_class._tfdist_sharded_io = True
