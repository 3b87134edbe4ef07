"""TF's C++ start-up banner, hidden in the ``tfdist`` process itself, as in its tasks.

TF 2.21 logs its oneDNN banner (and absl's note before it) while ``import tensorflow``
loads its libraries, before it reads TF_CPP_MIN_LOG_LEVEL. The launcher drops such
lines from its tasks' output (`tfdist.launch.output.is_hidden`); `hide_tf_banner` does
the same for this process: the first ``import tensorflow`` runs with file descriptor 2
on a pipe, and every line the level does not hide is relayed to stderr as it comes, so
errors still show.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
import threading

from tfdist.launch.output import is_hidden, relay


@contextlib.contextmanager
def _filtered_stderr(cpp_log_level: int):
    """Relays what is written to file descriptor 2 meanwhile, minus the hidden lines."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    saved = os.dup(2)

    def add(text: str, end: str) -> None:
        if not is_hidden(text, cpp_log_level):
            os.write(saved, (text + (end or "")).encode("utf-8", "replace"))

    reader = threading.Thread(target=relay, args=(os.fdopen(read_end, "rb"), add),
                              daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader reads EOF
        reader.join(10.0)
        if not reader.is_alive():  # else a child holds the pipe: the reader keeps saved
            os.close(saved)


class _Loader(importlib.abc.Loader):
    """Runs the real loader of ``tensorflow`` with stderr filtered."""

    def __init__(self, loader, cpp_log_level: int):
        self.loader, self.cpp_log_level = loader, cpp_log_level

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # as if never wrapped
        with _filtered_stderr(self.cpp_log_level):
            self.loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` once, with a loader that filters its banner."""

    def __init__(self, cpp_log_level: int):
        self.cpp_log_level = cpp_log_level

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once: the real finders answer from now on
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.cpp_log_level)
        return spec


def hide_tf_banner(cpp_log_level: int) -> None:
    """Makes this process's first ``import tensorflow`` drop the C++ log lines that
    TF_CPP_MIN_LOG_LEVEL=cpp_log_level hides (nothing at 0, or once TF is imported)."""
    if cpp_log_level <= 0 or "tensorflow" in sys.modules or \
            any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(cpp_log_level))
