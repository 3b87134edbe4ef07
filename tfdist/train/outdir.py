"""The main job's output directory: its lock, the backup directory and its preparation,
and atomic writes."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Callable

from tfdist import env
from tfdist.config import ConfigError, is_multi_process
from tfdist.strategies import registry
from tfdist.train.checks import HOROVOD_RANK_VARIABLES

LOCK_FILE = ".tfdist.lock"
# In OUTPUT_DIR/backup: the config a backup belongs to, and the per-epoch history.
BACKUP_CONFIG_FILE = "tfdist_config.json"
BACKUP_HISTORY_FILE = "tfdist_history.json"
# Every file a tfdist backup is made of: the two above, `BackupAndRestore`'s state
# (tfdist/keras/callbacks.py: ``tfdist_backup.json``, its ``.prev`` and the weights it
# names), each possibly set aside as ``*.corrupt`` or left as an atomic write's
# temporary (`tfdist.files.temp_path_for`).
BACKUP_FILES = re.compile(r"(\.tmp-\d+-)?(tfdist_config\.json|tfdist_history\.json"
                          r"|tfdist_backup(\.prev)?\.json|backup-\d+\.weights\.h5)"
                          r"(\.corrupt)?")
# The sections of a config key (`_backup_key`): a marker without them is not tfdist's.
_SECTIONS = {"strategy", "cluster", "model", "data", "train"}


def create_output_dir(out: Path, source: str) -> None:
    """Creates ``out`` (and its parents) if missing.

    Raises:
        ConfigError: it cannot be created; names ``source`` and the path.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as error:  # ValueError: a name not encodable
        raise ConfigError(f"{source}: train.output_dir cannot be created: {error}. "
                          f"Received: {str(out)!r}") from None


def lock_output_dir(out: Path) -> int:
    """Takes this job's lock on ``out``; returns the file descriptor that holds it.

    The lock is an ``flock`` on ``out/.tfdist.lock``, which names the holder (PID and
    host). The kernel drops it when the holder exits, however it dies, so a lock left by
    a dead job is never in the way. Close the descriptor to release it.

    Raises:
        ConfigError: another live job holds the lock; names it.
    """
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"train.output_dir {str(out)!r} is in use by another tfdist train "
                          f"job ({holder}); wait for it to end or choose another "
                          "train.output_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


def holds_lock(config: dict[str, Any]) -> bool:
    """Whether this process locks the output directory: the launcher of a local job,
    or the chief of a job the environment describes (the other tasks write nothing)."""
    if config["cluster"]["mode"] in ("local", "spark", "ray") or not is_multi_process(config):
        return True
    if config["cluster"]["mode"] == "nodes":  # node 0's launcher: its host has the chief
        return config["cluster"]["node_rank"] == 0
    if registry.get(config["strategy"]["name"]).horovodrun:
        return next((os.environ[v] for v in HOROVOD_RANK_VARIABLES if v in os.environ),
                    "0") == "0"
    if os.environ.get(env.TF_CONFIG):
        from tfdist.cluster import ClusterSpec

        return ClusterSpec.from_env().is_chief()
    return os.environ.get("SLURM_PROCID", "0") == "0"


def backup_dir(config: dict[str, Any]) -> Path:
    """Where a task backs up and resumes: ``$TFDIST_BACKUP_DIR`` or ``OUTPUT_DIR/backup``."""
    from_launcher = os.environ.get(env.BACKUP_DIR)
    return Path(from_launcher) if from_launcher else Path(config["train"]["output_dir"]) / "backup"


def _backup_key(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config a backup depends on (not how long, how loud, or where)."""
    key = json.loads(json.dumps(config))
    for section, name in (("train", "epochs"), ("train", "verbose"), ("train", "output_dir"),
                          ("cluster", "timeout"), ("cluster", "max_restarts"),
                          ("cluster", "mode"), ("cluster", "node_rank"),
                          ("cluster", "master")):
        key[section].pop(name, None)
    return key


def prepare_backup(config: dict[str, Any], directory: Path, log=None, *,
                   fresh: bool = False, setting: str = "train.output_dir") -> None:
    """Marks ``directory`` as this config's backup, resuming one of the same config.

    A backup left by an interrupted job of the same config is resumed. One of another
    config is never removed unless ``fresh`` (``tfdist train --fresh``), which discards
    it, saying so. Only a directory tfdist can tell is its own backup (`own_backup`) is
    ever used or removed; one that holds anything else is refused, naming what it holds.

    Args:
        setting: What chose ``directory``, for the advice of a refusal
            (``TFDIST_BACKUP_DIR`` or ``train.output_dir``).

    Raises:
        ConfigError: ``directory`` holds a backup of another config (names it, what
            differs, and ``--fresh``), or is not a tfdist backup (names what it holds).
    """
    log = log or sys.stdout
    marker = directory / BACKUP_CONFIG_FILE
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir():
            raise ConfigError(f"{directory} is not a directory, so it cannot hold the "
                              f"backup; it is kept. Point {setting} at a new or empty "
                              "directory")
        try:
            saved, foreign = own_backup(directory)
        except OSError as error:
            raise ConfigError(f"{directory} cannot be read, so tfdist cannot tell whether it "
                              f"holds a backup: {error}. Point {setting} at a new or empty "
                              "directory") from None
        if foreign:
            kept = " (--fresh removes only a backup tfdist wrote)" if fresh else ""
            raise ConfigError(f"{directory} holds {_counted(foreign)} that tfdist did not "
                              f"write ({_shown(foreign)}); it is not a tfdist backup, so it "
                              "is neither used nor "
                              f"removed{kept}. Point {setting} at a new or empty directory")
        held = any(p.name != BACKUP_CONFIG_FILE for p in directory.iterdir())
        if fresh and (held or saved is not None):
            _remove_contents(directory)
            print(f"tfdist train: removed {directory} (--fresh): the job starts at epoch 1",
                  file=log, flush=True)
        elif saved == _backup_key(config):
            if held:
                print(f"tfdist train: {directory} holds a backup of this config; the job "
                      "resumes from it", file=log, flush=True)
            return
        elif held and saved is None:
            raise ConfigError(
                f"{directory} holds a tfdist backup that names no tfdist train config "
                f"({_shown(sorted(p.name for p in directory.iterdir()))})"
                "; it is kept. Discard it on purpose with `tfdist train --fresh` (or delete "
                "the directory yourself)")
        elif held:
            raise ConfigError(
                f"{directory} holds a backup of another config ({_differences(saved, config)})"
                "; it is kept. Run the config it belongs to, to resume it, or discard it on "
                "purpose with `tfdist train --fresh` (or delete the directory yourself)")
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, lambda tmp: tmp.write_text(json.dumps(_backup_key(config))))


def own_backup(directory: Path) -> tuple[dict | None, list[str]]:
    """What makes ``directory`` tfdist's backup, and what does not.

    A directory is tfdist's when it holds the marker `prepare_backup` writes (a
    ``tfdist_config.json`` naming a tfdist train config: tfdist marks only a directory
    it created or found empty), or else only the files a backup is made of
    (`BACKUP_FILES`).

    Returns:
        ``(the marker's config key or None, the entries tfdist did not write)``: the
        second is empty when the directory is tfdist's (directories end in ``/``).
    """
    try:
        saved = json.loads((directory / BACKUP_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        saved = None
    if not (isinstance(saved, dict) and _SECTIONS <= set(saved)):
        saved = None
    if saved is not None:
        return saved, []
    return None, [p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
                  for p in sorted(directory.iterdir()) if not BACKUP_FILES.fullmatch(p.name)]


def _shown(names: list[str]) -> str:
    """``a, b/, c, d, ...``: at most 4 names."""
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _counted(names: list[str]) -> str:
    """``3 files and 1 directory`` (the names of directories end in ``/``)."""
    dirs = sum(name.endswith("/") for name in names)
    files = len(names) - dirs
    said = [f"{files} file{'s' * (files != 1)}" if files else "",
            f"{dirs} director{'ies' if dirs != 1 else 'y'}" if dirs else ""]
    return " and ".join(filter(None, said))


def _remove_contents(directory: Path) -> None:
    """Removes what ``directory`` holds (the directory stays: it may be a symlink)."""
    for path in directory.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _differences(saved, config: dict[str, Any]) -> str:
    """What tells a saved backup key from this config's: a few dotted keys."""
    if not isinstance(saved, dict):
        return "it names no tfdist train config"
    key = _backup_key(config)

    def table(keys, section):
        found = keys.get(section)
        return found if isinstance(found, dict) else {}

    names = sorted(f"{section}.{name}" for section in set(saved) | set(key)
                   for name in set(table(saved, section)) | set(table(key, section))
                   if table(saved, section).get(name) != table(key, section).get(name))
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"it differs in {shown}" if names else "it differs"


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Writes ``path`` so that a reader sees the old file or the whole new one.

    ``write(tmp)`` writes a temporary file in the same directory (same suffix, so Keras
    and matplotlib recognise the format); it is fsynced and renamed over ``path``
    (`tfdist.files.atomic_path`). A kill at any point leaves the previous file intact.
    """
    from tfdist.files import atomic_path

    with atomic_path(path) as tmp:
        write(Path(tmp))
