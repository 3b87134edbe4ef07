"""Keras callbacks' private save and restore points, as public methods for
tfdist.keras.callbacks.

Why: Keras' `ModelCheckpoint` and `BackupAndRestore` pick the file and write it in
private methods (``_get_file_path``, ``_save_model``, ``_load_model``) and keep the
position to resume from in ``_current_epoch``/``_last_batch_seen``; there is no public
way to make only the chief write the real path. These bases override them once and
call public methods that tfdist's callbacks define. tests/test_hooks_callbacks.py fails
if Keras renames them.
"""

from __future__ import annotations

import keras


class CheckpointHooks(keras.callbacks.ModelCheckpoint):
    """`ModelCheckpoint` whose path choice and save go through ``checkpoint_path`` and
    ``save_checkpoint``."""

    def _get_file_path(self, epoch, batch, logs):
        return self.checkpoint_path(super()._get_file_path(epoch, batch, logs))

    def _save_model(self, epoch, batch, logs):
        self.save_checkpoint(lambda: super(CheckpointHooks, self)._save_model(epoch, batch, logs))

    def checkpoint_path(self, path: str) -> str:
        """Where to write the checkpoint Keras would write at ``path``."""
        return path

    def save_checkpoint(self, save) -> None:
        """Saves a checkpoint by calling ``save()`` (Keras' own save)."""
        save()


class BackupHooks(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` whose load and save are ``restore_backup``/``save_backup``."""

    def _load_model(self):
        self.restore_backup()

    def _save_model(self):
        self.save_backup()

    def backup_position(self) -> tuple[int, int | None]:
        """``(epoch, batch)``: where fit resumes from the backup being saved."""
        return self._current_epoch, self._last_batch_seen

    def restore_backup(self) -> None:
        """Restores the newest backup (Keras' own by default)."""
        super()._load_model()

    def save_backup(self) -> None:
        """Saves a backup (Keras' own by default)."""
        super()._save_model()
