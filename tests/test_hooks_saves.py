"""Each private Keras hook in tfdist/_hooks/saves.py still exists in this Keras.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect


def test_keras_backup_and_restore_private_paths(tmp_path):
    import os

    import keras

    from tfdist._hooks.saves import _BACKUP_PATHS

    callback = keras.callbacks.BackupAndRestore(str(tmp_path))
    for attribute, name in _BACKUP_PATHS.items():
        assert getattr(callback, attribute) == os.path.join(str(tmp_path), name), (
            f"keras BackupAndRestore.{attribute} changed: keras_callbacks_write_elsewhere "
            "would write the chief's backup from other workers")


def test_keras_callbacks_write_elsewhere_redirects_and_restores(tmp_path):
    import keras

    from tfdist._hooks.saves import keras_callbacks_write_elsewhere

    real = {"checkpoint": str(tmp_path / "m.keras"), "csv": str(tmp_path / "log.csv"),
            "tb": str(tmp_path / "tb"), "backup": str(tmp_path / "backup")}
    callbacks = [keras.callbacks.ModelCheckpoint(real["checkpoint"]),
                 keras.callbacks.CSVLogger(real["csv"]),
                 keras.callbacks.TensorBoard(real["tb"]),
                 keras.callbacks.BackupAndRestore(real["backup"])]
    with keras_callbacks_write_elsewhere(callbacks, "worker-1"):
        checkpoint, csv, tensorboard, backup = callbacks
        assert "tfdist-worker-1-" in checkpoint.filepath and checkpoint.filepath.endswith(
            "m.keras")
        assert "tfdist-worker-1-" in csv.filename and "tfdist-worker-1-" in tensorboard.log_dir
        assert "on_train_begin" in vars(backup)
    assert [callbacks[0].filepath, callbacks[1].filename, callbacks[2].log_dir,
            callbacks[3].backup_dir] == list(real.values())
    assert "on_train_begin" not in vars(callbacks[3])


def test_non_finite_weights_checks_each_shard():
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist._hooks.saves import non_finite_weights

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    assert non_finite_weights(model) == []
    kernel = model.layers[0].kernel
    kernel._value = tf.__internal__.distribute.ShardedVariable(
        [tf.Variable(np.zeros((1, 3), "float32")), tf.Variable(np.full((1, 3), np.nan, "float32"))])
    assert non_finite_weights(model) == [kernel.path]


def test_keras_saves_walk_an_object_s_dir():
    """`hidden_from_keras_saves` (ShardedOptimizer.__dir__) works because Keras' saves
    and loads find child objects through ``dir()``."""
    from keras.src.saving import saving_lib

    from tfdist._hooks.saves import hidden_from_keras_saves

    assert "sorted(dir(saveable)" in inspect.getsource(saving_lib._walk_saveable), (
        "Keras' saves no longer walk dir(): a sharded optimizer's save would hold an "
        "extra optimizer/inner_optimizer group again (or lose it on load)")
    for user in (saving_lib._save_state, saving_lib._load_state):
        assert "_walk_saveable(saveable)" in inspect.getsource(user)
    assert hidden_from_keras_saves(["a", "inner_optimizer", "b"], ("inner_optimizer",)) == \
        ["a", "b"]
