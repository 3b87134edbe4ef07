"""Files that survive crashes: atomic writes, and temporary directories that a killed
process does not leave behind for long. No TensorFlow import here."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from tfdist._hooks.tf import rewrite_op_error_message

_PRIVATE_DIR = re.compile(r"^tfdist-(?P<task>.+)-pid(?P<pid>\d+)-")


def is_process_alive(pid: int) -> bool:
    """True if a process with this PID exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def private_temp_dir(task_name: str) -> str:
    """A new temporary directory for this process, e.g. ``/tmp/tfdist-worker-1-pid42-x``.

    Directories that earlier processes left there (named the same way, their PID no
    longer alive: a SIGKILL gives no chance to clean up) are removed first.
    """
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            match = _PRIVATE_DIR.match(name)
            if match and not is_process_alive(int(match.group("pid"))):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"tfdist-{task_name}-pid{os.getpid()}-")


def temp_path_for(path: str | os.PathLike) -> Path:
    """A hidden sibling of ``path`` that keeps its suffixes (Keras checks them)."""
    path = Path(path)
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def commit(temp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Flushes ``temp`` to disk and renames it to ``path`` in one step."""
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    with contextlib.suppress(OSError):  # the rename itself, on filesystems that allow it
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def disk_full(path: str | os.PathLike, detail: str) -> OSError:
    """The error of a write that found its disk full: ``OSError(ENOSPC)`` naming ``path``
    (and saying that the previous file is kept, when there is one)."""
    return OSError(errno.ENOSPC, f"disk full: cannot write {os.fspath(path)}: {detail}"
                                 f"{kept_note(path, '; ')}", os.fspath(path))


def kept_note(path: str | os.PathLike, before: str = " ") -> str:
    """``before + "the previous file is kept"`` when ``path`` exists (a failed write
    leaves it whole), else "" (there was none)."""
    return f"{before}the previous file is kept" if os.path.exists(path) else ""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` says a disk (or quota) is full."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def describe_disk_full(error: OSError) -> str:
    """One line for a full disk: ``disk full: ...`` naming the path."""
    text = error.strerror or str(error)
    return text if text.startswith("disk full") else \
        f"disk full: {text}" + (f": {error.filename}" if error.filename else "")


def check_free_space(path: str | os.PathLike, needed: int) -> None:
    """Refuses a write of about ``needed`` bytes to ``path`` that its disk cannot hold.

    Some writers cannot fail cleanly on a full disk: h5py (Keras' ``.h5`` and ``.keras``
    saves) crashes the process with SIGSEGV after ``ENOSPC``. Checked before they start.

    Raises:
        OSError: ``ENOSPC`` (`disk_full`), naming ``path``, the bytes needed and free.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        stat = os.statvfs(directory)
    except OSError:  # a missing directory: the writer's own error names it
        return
    free = stat.f_bavail * stat.f_frsize
    if free < needed:
        raise disk_full(path, f"it needs about {needed:,} bytes and {directory} has "
                              f"{free:,} free")


# Bytes Keras 3 writes besides the values: per file, per group (a layer's, or the
# optimizer's: variables whose paths share a prefix) and per variable. Measured on 17
# models (scripts/save_overhead.py: Dense stacks of 1 to 129 layers, BatchNormalization,
# Embedding; Adam, SGD and none), a least-squares fit of the bookkeeping is 8.8 KB + 2.2
# KB per group + 0.35 KB per variable for .weights.h5, and 8.5 KB + 3.2 KB per group
# (its config) + 0.35 KB per variable for .keras; these margins are 1.3 to 1.8 times
# what each model wrote (checked: tests/test_checkpoint_safety.py).
_SAVE_BYTES_PER_FILE = 16 << 10
_SAVE_BYTES_PER_GROUP = 4 << 10
_SAVE_BYTES_PER_VARIABLE = 512


def model_save_size(model) -> int:
    """About how many bytes ``model.save``/``save_weights`` writes: the values of its
    weights and of its optimizer's variables (Keras 3 writes both in either format)
    plus the HDF5 and zip bookkeeping, in proportion to its groups and variables: a
    little more than Keras writes (see the margins above)."""
    import numpy as np

    optimizer = getattr(model, "optimizer", None)
    variables = [*model.weights, *(getattr(optimizer, "variables", None) or [])]
    values = sum(int(np.prod(v.shape)) * _itemsize(v) for v in variables)
    groups = {str(getattr(v, "path", "")).rpartition("/")[0] for v in variables}
    return (values + _SAVE_BYTES_PER_FILE + _SAVE_BYTES_PER_GROUP * len(groups)
            + _SAVE_BYTES_PER_VARIABLE * len(variables))


def _itemsize(variable) -> int:
    import numpy as np

    name = str(getattr(variable, "dtype", "float32")).replace("tf.", "")
    try:
        return np.dtype("float16" if name == "bfloat16" else name).itemsize
    except TypeError:
        return 8


def name_user_path(error: BaseException, temp, path) -> None:
    """Rewrites ``error``'s message in place so it names ``path`` where it named ``temp``.

    An error raised while writing the temporary sibling (Keras' check of the extension,
    a missing directory) must name the path the user gave, not ``.tmp-PID-name``. The
    error keeps its type, arguments' shape and traceback.
    """
    temp, path = os.fspath(temp), os.fspath(path)
    temp_name, name = os.path.basename(temp), os.path.basename(path)

    def fix(value):
        if not isinstance(value, str) or temp_name not in value:
            return value
        return value.replace(temp, path).replace(temp_name, name)

    if isinstance(error, OSError):
        # Only set what changes: any filename set, even None, changes how it prints.
        for attr in ("filename", "filename2"):
            value = getattr(error, attr)
            if fix(value) is not value:
                setattr(error, attr, fix(value))
    args = tuple(fix(arg) for arg in error.args)
    if args != error.args:
        error.args = args
    rewrite_op_error_message(error, fix)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a temporary path to write; on success it replaces ``path`` atomically.

    A crash mid-write leaves the previous ``path`` intact (and at most a hidden
    ``.tmp-PID-name`` file, removed here on errors). An error raised meanwhile names
    ``path``, not the temporary (`name_user_path`); a full disk is `disk_full`.
    """
    temp = temp_path_for(path)
    try:
        yield temp
        commit(temp, path)
    except Exception as error:
        if is_disk_full(error) and "disk full" not in str(error):
            raise disk_full(path, os.strerror(error.errno)) from error
        name_user_path(error, temp, path)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path`` atomically (temp file, fsync, rename)."""
    with atomic_path(path) as temp:
        Path(temp).write_text(text)
