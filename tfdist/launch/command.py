"""One command run as the launcher runs a task, for launchers of their own (``horovodrun``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Sequence

from tfdist.launch.options import DEFAULT_GRACE_SECONDS
from tfdist.launch.output import TaskOutput, cpp_log_level, relay
from tfdist.launch.process import command_env, start_process
from tfdist.launch.results import LaunchError

_HOROVOD_PREFIX = re.compile(r"\[(\d+)\]<(?:stdout|stderr)>:")


def split_horovod_prefix(text: str) -> tuple[str | None, str]:
    """``[1]<stdout>:text`` (horovodrun's prefix) -> ``("worker-1", "text")``.

    For `run_command`'s ``route``: output without that prefix (horovodrun's own) gives
    ``(None, text)``.
    """
    match = _HOROVOD_PREFIX.match(text)
    return (f"worker-{match[1]}", text[match.end():]) if match else (None, text)


def run_command(argv: Sequence[str], *, timeout: float | None = None, env: dict | None = None,
                grace_period: float = DEFAULT_GRACE_SECONDS, stream=sys.stdout,
                route: Callable[[str], tuple[str | None, str]] | None = None) -> int:
    """Runs one command as `tfdist.launch.run` runs a task.

    The command gets its own process group, dies with this process, and runs with the
    tasks' environment (unbuffered Python, TF's start-up banners hidden). Its output is
    relayed as it comes; ``route`` maps each line to ``(task name, text)`` so it gets
    the same ``[worker-0]`` prefix as a task's (None: the line as it is).

    Returns:
        The command's exit code. Its process group is stopped when it ends.

    Raises:
        LaunchError: the timeout passed (the process group was stopped).
    """
    env = command_env(env)
    process = start_process(list(argv), env)
    outputs: dict[str | None, TaskOutput] = {}

    def add(text, end):
        name, text = route(text) if route is not None else (None, text)
        if name not in outputs:
            outputs[name] = TaskOutput(name, stream, cpp_log_level(env))
        outputs[name].add(text, end)

    reader = threading.Thread(target=relay, args=(process.stdout, add), daemon=True)
    reader.start()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{Path(argv[0]).name} timed out after {timeout:g}s; its process "
                          f"group was stopped") from None
    finally:
        for signum, wait in ((signal.SIGTERM, grace_period), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait)
        reader.join(2.0)
        for output in list(outputs.values()):
            output.close()
    return process.returncode
