"""Run a module-level function on every rank of a ``horovodrun --gloo`` job.

Shared by the benchmarks and the tests (``tests/helpers.py`` re-exports it). It does not
import tfdist, and imports Horovod only in the ranks.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_TASK = """
import importlib, os, pickle, sys
module, name, args_path, out_dir = sys.argv[1:5]
with open(args_path, "rb") as f:
    args, kwargs = pickle.load(f)
result = getattr(importlib.import_module(module), name)(*args, **kwargs)
import horovod.tensorflow as hvd
if not hvd.is_initialized():  # a rank whose function never started Horovod joins here
    hvd.init()
with open(os.path.join(out_dir, f"rank{hvd.rank()}.pkl"), "wb") as f:
    pickle.dump(result, f)
"""


class HorovodrunError(AssertionError):
    """horovodrun failed or timed out; the message ends with its output.

    An `AssertionError`, so a test that runs a job fails with horovodrun's output.
    """


def run_horovod(fn, *args, np: int = 2, timeout: float = 600, env: dict | None = None,
                **kwargs) -> list:
    """Runs module-level ``fn(*args, **kwargs)`` under ``horovodrun --gloo`` on localhost.

    The checkout and the directory ``fn``'s module was imported from are put on the
    ranks' PYTHONPATH. The whole horovodrun process group is killed after ``timeout``.

    Args:
        fn: A function defined at module level (``__main__`` too, when run with -m).
        np: Number of ranks.
        timeout: Seconds before every process of the job is killed.
        env: Extra environment variables for the ranks.

    Returns:
        The picklable values ``fn`` returned, by rank.

    Raises:
        HorovodrunError: horovodrun exited non-zero or timed out.
    """
    module = _module_name(fn)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory(prefix="tfdist-hvd-") as tmp:
        args_path = os.path.join(tmp, "args.pkl")
        with open(args_path, "wb") as f:
            pickle.dump((args, kwargs), f)
        cmd = [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
               "--start-timeout", "120", sys.executable, "-c", _TASK,
               module, fn.__name__, args_path, tmp]
        paths = [_import_root(module), str(ROOT), os.environ.get("PYTHONPATH", "")]
        task_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                        PYTHONPATH=os.pathsep.join(p for p in paths if p))
        task_env.update(env or {})
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=task_env, start_new_session=True, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise HorovodrunError(f"horovodrun timed out after {timeout:g}s: {fn.__name__}\n"
                                  + output[-4000:]) from None
        if proc.returncode != 0:
            raise HorovodrunError(f"horovodrun exited with {proc.returncode}: {fn.__name__}: "
                                  f"{_rank_error(output)}\n{_exits(output)}"
                                  + output[-4000:])
        values = []
        for rank in range(np):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                values.append(pickle.load(f))
        return values


def _module_name(fn) -> str:
    """The importable name of ``fn``'s module (a section run with -m is ``__main__``)."""
    module = fn.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(f"run_horovod needs a function of an importable module. "
                             f"Received: {fn.__qualname__} of a script")
        module = spec.name
    return module


def _import_root(module: str) -> str:
    """The sys.path entry ``module`` was imported from ("" if unknown)."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path:
        return ""
    return str(Path(path).resolve().parents[module.count(".")])


def _exits(output: str) -> str:
    """horovodrun's lines on each rank's exit (``Process N exit with status code C.``),
    which a long traceback after them would push out of the output's tail."""
    return "".join(line.strip() + "\n" for line in output.splitlines()
                   if line.startswith("Process ") and " exit with status code " in line)


def _rank_error(output: str) -> str:
    """The last error line a rank printed (horovodrun's own traceback comes last)."""
    errors = [line.strip() for line in output.splitlines()
              if "<stderr>" in line and ("Error" in line or "error" in line)]
    return errors[-1] if errors else "see the output below"
