"""A task's output: relayed as it comes, filtered by its TF log level, prefixed, kept.

Each line and progress-bar update a task prints is written with the task's name
(``[worker-0] ...``) by one shared `Console`, and its last lines are kept for errors.
"""

from __future__ import annotations

import codecs
import collections
import os
import re
import select
import threading
from typing import Callable

TAIL_LINES = 40
IDLE_SECONDS = 0.5  # an unfinished line is shown after this long without output
MAX_SEGMENT_CHARS = 65536  # a longer line without an end is cut there
_LINE_END = re.compile(r"(\r|\n)")
# A C++ log line in absl's format: "I0000 00:00:1795367414.655962    5257 port.cc:153] ..."
_CPP_LOG_LINE = re.compile(r"[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_ABSL_EARLY_LOG_NOTE = "WARNING: All log messages before absl::InitializeLog() is called"
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def relay(pipe, add: Callable[[str, str], None], idle: float = IDLE_SECONDS) -> None:
    """Hands ``pipe``'s output to ``add(text, end)`` as it comes, until EOF, then closes it.

    Reads whatever is there (not whole lines) and cuts it at every ``\\n`` and ``\\r``:
    ``end`` is the character that ended ``text``, or "" for an unfinished segment shown
    because the process printed nothing for ``idle`` seconds (it comes again, finished).
    """
    fd = pipe.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending, shown = "", True
    try:
        while True:
            if not shown and not select.select([fd], [], [], idle)[0]:
                add(pending, "")
                shown = True
                continue
            chunk = os.read(fd, 65536)
            parts = _LINE_END.split(pending + decoder.decode(chunk, final=not chunk))
            pending = parts.pop()
            for text, end in zip(parts[::2], parts[1::2]):
                add(text, end)
            if len(pending) > MAX_SEGMENT_CHARS:
                add(pending, "\n")
                pending = ""
            shown = not pending
            if not chunk:
                break
        if pending:
            add(pending, "\n")
    finally:
        pipe.close()


def cpp_log_level(env: dict[str, str]) -> int:
    """The TF_CPP_MIN_LOG_LEVEL of an environment (0 when unset or not a number)."""
    try:
        return int(env.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def is_hidden(text: str, cpp_log_level: int) -> bool:
    """Whether TF_CPP_MIN_LOG_LEVEL=cpp_log_level hides this C++ log line.

    TF 2.21 logs its oneDNN banner before it reads its log level, so it shows at every
    level (checked); the launcher drops such lines as TF would have.
    """
    if text.startswith(_ABSL_EARLY_LOG_NOTE):
        return cpp_log_level >= 2
    return bool(_CPP_LOG_LINE.match(text)) and "IWEF".index(text[0]) < cpp_log_level


def _visible_len(text: str) -> int:
    """Columns ``text`` takes on a terminal (colour codes take none)."""
    return len(_ANSI_CODE.sub("", text))


def _write(stream, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (ValueError, OSError):  # closed, or the terminal hung up
        pass


class Console:
    """Writes the tasks' output segments to their streams, whole and prefixed.

    A ``\\r`` segment is a live update (a progress bar) and is written as one, so a
    terminal redraws ``[worker-0] 3/10 ━━━...`` in place. Tasks share that bottom line:
    whatever is written next (a line, or another task's update) covers the update.
    """

    def __init__(self):
        # id(stream) -> (task, line, width on screen) of the update the cursor is on
        self._open: dict[int, tuple[str | None, str, int]] = {}
        self._lock = threading.Lock()

    def write(self, stream, name: str | None, text: str, end: str) -> None:
        """Writes ``text`` of task ``name`` (None: no prefix), ended by ``end``."""
        line = text if name is None else f"[{name}] {text}"
        with self._lock:
            update = self._open.pop(id(stream), None)
            out = line
            if update is not None:
                if end == "\r" and update[:2] == (name, line):
                    self._open[id(stream)] = update  # unchanged
                    return
                if end == "\n" and not text and update[0] == name:
                    out = ""  # "\r\n": the update stays as the line
                else:  # cover all of the update (of this task or another)
                    out += " " * (update[2] - _visible_len(line))
            if end == "\r":
                self._open[id(stream)] = (name, line, _visible_len(out))
            _write(stream, out + end)

    def close(self, stream, name: str | None) -> None:
        """Ends an update of task ``name`` still open on ``stream``."""
        with self._lock:
            update = self._open.get(id(stream))
            if update is not None and update[0] == name:
                del self._open[id(stream)]
                _write(stream, "\n")


_CONSOLE = Console()


class TaskOutput:
    """One task's output: drops what its TF log level hides, keeps a tail, writes it."""

    def __init__(self, name: str | None, stream, cpp_log_level: int, tail=None):
        self.name, self.stream, self.cpp_log_level = name, stream, cpp_log_level
        self.tail = collections.deque(maxlen=TAIL_LINES) if tail is None else tail
        self._update = ""  # the last "\r" update, until a line ends it

    def add(self, text: str, end: str) -> None:
        """Takes one segment from `relay`."""
        text = text.rstrip("\b")  # Keras backspaces over its bar before each "\r"
        if is_hidden(text, self.cpp_log_level):
            return
        if end == "\n":
            self.tail.append(text or self._update)
            self._update = ""
        elif not text:
            return
        elif end == "\r":
            self._update = text
        if self.stream is not None:
            _CONSOLE.write(self.stream, self.name, text, end or "\r")

    def close(self) -> None:
        """At the end of the output: keeps the last update if no line ended it."""
        if self._update:
            self.tail.append(self._update)
            self._update = ""
        if self.stream is not None:
            _CONSOLE.close(self.stream, self.name)
