"""tfdist/_hooks/keras_callbacks.py: Keras' callbacks still choose, write and restore
their files in the private methods the hooks override, and the hooks route them to the
public methods tfdist's callbacks define."""

import inspect
import json
import os



def test_keras_checkpoint_writes_through_get_file_path_and_save_model():
    import keras

    source = inspect.getsource(keras.callbacks.ModelCheckpoint)
    assert "def _get_file_path(self, epoch, batch, logs)" in source, (
        "Keras renamed ModelCheckpoint._get_file_path: CheckpointHooks.checkpoint_path "
        "is never called and every worker writes the real path")
    assert "def _save_model(self, epoch, batch, logs)" in source
    assert "filepath = self._get_file_path(epoch, batch, logs)" in source, (
        "ModelCheckpoint._save_model no longer asks _get_file_path where to write")


def test_keras_backup_loads_saves_and_counts_through_the_private_names():
    import keras

    source = inspect.getsource(keras.callbacks.BackupAndRestore)
    for needle in ("def _load_model(self)", "def _save_model(self)", "self._load_model()",
                   "self._save_model()", "self._current_epoch = epoch + 1",
                   "self._last_batch_seen"):
        assert needle in source, (f"BackupAndRestore no longer has {needle}: "
                                  "tfdist/_hooks/keras_callbacks.BackupHooks must change")


def test_checkpoint_hooks_call_the_public_methods(tmp_path):
    import keras
    import numpy as np

    from tfdist._hooks.keras_callbacks import CheckpointHooks

    calls = []

    class Recorded(CheckpointHooks):
        def checkpoint_path(self, path):
            calls.append(("path", os.path.basename(path)))
            return path[:-len(".keras")] + ".moved.keras"

        def save_checkpoint(self, save):
            calls.append(("save",))
            save()

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.zeros((4, 2), "float32")
    model.fit(x, x[:, :1], epochs=1, verbose=0,
              callbacks=[Recorded(str(tmp_path / "m-{epoch}.keras"))])
    assert calls == [("save",), ("path", "m-1.keras")]
    assert os.listdir(tmp_path) == ["m-1.moved.keras"]


def test_backup_hooks_call_the_public_methods_with_keras_position(tmp_path):
    import keras
    import numpy as np

    from tfdist._hooks.keras_callbacks import BackupHooks

    calls = []

    class Recorded(BackupHooks):
        def restore_backup(self):
            calls.append("restore")

        def save_backup(self):
            calls.append(("save", self.backup_position()))

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.zeros((4, 2), "float32")
    model.fit(x, x[:, :1], epochs=2, batch_size=2, verbose=0,
              callbacks=[Recorded(str(tmp_path))])
    # Keras' own position at each epoch's end: the next epoch, and its last batch seen.
    assert calls == ["restore", ("save", (1, 0)), ("save", (2, 0))]


def test_backup_hooks_default_to_keras_own_save_and_load(tmp_path):
    import keras
    import numpy as np

    from tfdist._hooks.keras_callbacks import BackupHooks

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.zeros((4, 2), "float32")
    model.fit(x, x[:, :1], epochs=1, verbose=0,
              callbacks=[BackupHooks(str(tmp_path), delete_checkpoint=False)])
    assert json.loads((tmp_path / "training_metadata.json").read_text())["epoch"] == 1
    saved = model.get_weights()
    model.set_weights([w * 0 + 7 for w in saved])
    model.fit(x, x[:, :1], epochs=1, verbose=0,
              callbacks=[BackupHooks(str(tmp_path), delete_checkpoint=False)])
    for restored, expected in zip(model.get_weights(), saved):  # nothing left to train
        np.testing.assert_array_equal(restored, expected)
