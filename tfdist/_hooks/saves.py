"""Hooks for saves and file callbacks under tfdist strategies.

Saves that write atomically and refuse weights holding NaN or infinity, and Keras' own
file callbacks (``ModelCheckpoint``, ``BackupAndRestore``, ``CSVLogger``,
``TensorBoard``) writing to a private directory on workers that are not the chief, and
attributes Keras' saves do not walk.
``tests/test_hooks_saves.py`` fails loudly when a Keras upgrade removes what they touch.
"""

from __future__ import annotations

import contextlib

from tfdist._hooks.sharded.parts import sharded_parts

SAVE_METHODS = ("save", "save_weights")


def non_finite_weights(model, variables=None) -> list[str]:
    """Paths of the model's floating weights (or of ``variables``) holding NaN or infinity.

    Why: safe saves refuse such weights. Each variable, and each shard of one a
    partitioner split (a private ``ShardedVariable``, see `sharded_parts`), is checked
    where it lives (on its ps): one boolean per variable or shard comes to this process,
    not the values.
    """
    return [v.path for v in (model.weights if variables is None else variables)
            if "float" in str(v.dtype) and not _is_finite(v)]


def hidden_from_keras_saves(names, hidden) -> list:
    """``names`` (an object's ``dir()``) without ``hidden``, which Keras' saves then skip.

    Why: Keras' saving (the private ``saving_lib._walk_saveable``) writes, and loads,
    every Keras object among the names ``dir()`` gives, each in a group named after
    its attribute; it has no public way to leave one out. `tfdist.keras.ShardedOptimizer`
    leaves out its ``inner_optimizer``, whose state its own save already writes in the
    unsharded layout.
    """
    return [name for name in names if name not in hidden]


def _is_finite(variable) -> bool:
    """Whether a Keras variable (sharded or not) holds only finite values."""
    import tensorflow as tf

    for part in sharded_parts(variable) or [getattr(variable, "value", variable)]:
        with tf.device(getattr(part, "device", None) or ""):
            finite = tf.reduce_all(tf.math.is_finite(part))
        if not bool(finite):
            return False
    return True


def save_safely(original, model, args, kwargs):
    """``model.save``/``save_weights`` to a temporary sibling, fsynced, then renamed.

    Why: Keras writes in place, so a task killed mid-save would leave a torn file; this
    way the previous file stays whole. Weights with NaN or infinity are refused before
    anything is written, so no checkpoint or backup holds a state that cannot train on.
    Calls Keras as it is for file objects, ``overwrite=False`` and weight files split by
    ``max_shard_size``. Variables sharded by a partitioner (parameter servers) save like
    any other: Keras reads each whole (`tfdist._hooks.sharded.saving`), and
    `non_finite_weights` checks each shard. Keras' errors about the temporary sibling (a
    bad extension, a missing directory) name the user's path (`tfdist.files.atomic_path`).
    """
    import os

    from tfdist.files import atomic_path, check_free_space, kept_note, model_save_size

    arguments = dict(kwargs)
    path = args[0] if args else arguments.pop("filepath", None)
    if (not isinstance(path, (str, os.PathLike)) or arguments.get("overwrite") is False
            or arguments.get("max_shard_size") or str(path).startswith(("gs://", "s3://"))):
        return original(model, *args, **kwargs)
    bad = non_finite_weights(model)
    if bad:
        raise FloatingPointError(
            f"refusing to save {os.fspath(path)!r}: weights {bad[:5]} hold NaN or infinity, "
            "and a checkpoint of them could not train on."
            + (" The previous file is kept." if kept_note(path) else ""))
    check_free_space(path, model_save_size(model))
    with atomic_path(path) as temp:
        return original(model, temp, *args[1:], **arguments)


# Keras' BackupAndRestore: its private path attributes, each relative to backup_dir.
_BACKUP_PATHS = {"_weights_path": "latest.weights.h5",
                 "_training_metadata_path": "training_metadata.json",
                 "_prev_weights_path": "latest.weights.h5.bkp",
                 "_prev_training_metadata_path": "training_metadata.json.bkp"}


@contextlib.contextmanager
def keras_callbacks_write_elsewhere(callbacks, task_name: str):
    """On a worker that is not the chief, Keras' own file callbacks write to a temp dir.

    Why: Keras 3's ``ModelCheckpoint``, ``BackupAndRestore``, ``CSVLogger`` and
    ``TensorBoard`` dropped tf-keras' multi-worker logic, so every worker writes the
    chief's path (``FileExistsError``, h5 lock errors, mixed files). As tf-keras did,
    each still runs (a save may take part in collectives) but writes under a private
    temporary directory, removed when ``fit`` ends; ``BackupAndRestore`` still
    restores from the real ``backup_dir``. Paths are public attributes except
    ``BackupAndRestore``'s, which it computes in ``__init__`` (``_BACKUP_PATHS``).
    Callbacks marked ``_tfdist_chief_aware`` (tfdist's own) are left alone.

    Args:
        callbacks: The callbacks given to ``fit`` (None, a list or a CallbackList).
        task_name: This task, e.g. ``worker-1``; names the temporary directory.
    """
    import os
    import shutil

    import keras

    from tfdist.files import private_temp_dir

    callbacks = list(getattr(callbacks, "callbacks", callbacks) or [])
    directory = None
    saved = []  # (callback, attribute, value or _MISSING)

    def temp(*parts):
        nonlocal directory
        directory = directory or private_temp_dir(task_name)
        return os.path.join(directory, *parts)

    def redirect(callback, attribute, value):
        saved.append((callback, attribute, callback.__dict__.get(attribute, _MISSING)))
        setattr(callback, attribute, value)

    def restore_then_write_to_temp(callback, backup_dir):
        original = callback.on_train_begin

        def on_train_begin(logs=None):
            original(logs)
            callback.backup_dir = backup_dir
            for attribute, name in _BACKUP_PATHS.items():
                setattr(callback, attribute, os.path.join(backup_dir, name))

        return on_train_begin

    for index, callback in enumerate(callbacks):
        if getattr(callback, "_tfdist_chief_aware", False):
            continue
        if isinstance(callback, keras.callbacks.ModelCheckpoint):
            redirect(callback, "filepath", temp(f"checkpoint-{index}",
                                                os.path.basename(callback.filepath)))
        elif isinstance(callback, keras.callbacks.CSVLogger):
            redirect(callback, "filename", temp(os.path.basename(callback.filename)))
        elif isinstance(callback, keras.callbacks.TensorBoard):
            redirect(callback, "log_dir", temp(f"tensorboard-{index}"))
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            for attribute in ("backup_dir", *_BACKUP_PATHS):
                saved.append((callback, attribute, callback.__dict__[attribute]))
            redirect(callback, "on_train_begin",
                     restore_then_write_to_temp(callback, temp(f"backup-{index}")))
    try:
        yield
    finally:
        for callback, attribute, value in reversed(saved):
            if value is _MISSING:
                callback.__dict__.pop(attribute, None)
            else:
                setattr(callback, attribute, value)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


_MISSING = object()
