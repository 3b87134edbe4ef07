"""Executes notebooks and stores them with their outputs (``make notebooks``).

Each notebook runs in a fresh kernel in a temporary directory, so the files it writes
do not land in the repository. Usage: ``python scripts/run_notebooks.py [NOTEBOOK...]``
(default: every notebook in notebooks/).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
TIMEOUT_SECONDS = 540


def execute(path: Path, workdir: str) -> nbformat.NotebookNode:
    """Runs ``path`` in a new kernel with ``workdir`` as its working directory."""
    notebook = nbformat.read(path, as_version=4)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    NotebookClient(notebook, timeout=TIMEOUT_SECONDS, kernel_name="python3",
                   resources={"metadata": {"path": workdir}}).execute()
    return notebook


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    for index, path in enumerate(paths, start=1):
        started = time.monotonic()
        print(f"[{index}/{len(paths)}] {path.name} ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="tfdist-notebook-") as workdir:
            notebook = execute(path, workdir)
        nbformat.write(notebook, path)
        print(f"[{index}/{len(paths)}] {path.name}: {time.monotonic() - started:.0f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
