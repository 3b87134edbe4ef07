"""Issue 31's smaller faults: a full disk during a save, names the docs write, list
values of compression arguments, TensorFlow's start-up log, the README's notebooks.

The full disk is real: a tiny tmpfs this test mounts (root) and unmounts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 640 KiB tmpfs: two backups of the test's model fit, a third does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["none", pytest.param("horovod", marks=pytest.mark.horovod)])
def test_full_disk_during_a_backup_is_one_line_and_keeps_the_earlier_backup(tiny_disk,
                                                                          strategy):
    """One process, and 2 workers under engine "horovod" (issue 39: the launcher named the
    other worker, told "Horovod has been shut down", and said the previous file was
    kept, though backup-3 had none)."""
    out = tiny_disk / "out"
    sets = [f'train.output_dir="{out}"', 'strategy.name="none"', "train.epochs=3",
            "data.limit=320", "model.hidden=[256]", "train.verbose=0"]
    if strategy == "horovod":
        from helpers import require_horovod

        require_horovod()
        sets[1:2] = ['strategy.name="multi_worker"', 'strategy.options.engine="horovod"',
                     "cluster.workers=2"]
    argv = [sys.executable, "-m", "tfdist.cli", "train", *(f"--set={s}" for s in sets)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 1, result.stderr[-3000:]  # not -11 (SIGSEGV)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tfdist train: FAILED: disk full: cannot write {out / 'backup'}"
                           "/backup-3.weights.h5: it needs about "), last
    assert "previous file is kept" not in last, last  # there was no backup-3 before
    if strategy == "horovod":  # the launcher names the chief and its full disk
        assert (f"tfdist train: FAILED: worker-0 exited with code 1: disk full: cannot "
                f"write {out / 'backup'}/backup-3.weights.h5: it needs about ") in \
            result.stderr, result.stderr[-3000:]
        assert "worker-0 did not answer" not in result.stdout + result.stderr  # not frozen
    names = sorted(os.listdir(out / "backup"))
    assert not [n for n in names if n.startswith(".tmp-")], names
    from tfdist.keras.callbacks import BackupAndRestore

    state = json.loads((out / "backup" / BackupAndRestore._STATE).read_text())
    assert state["weights"] == "backup-2.weights.h5" and state["epoch"] == 2, state
    import h5py

    with h5py.File(out / "backup" / "backup-2.weights.h5", "r") as f:  # whole
        assert len(f.keys()) > 0


@pytest.mark.multiprocess
def test_keras_guards_as_the_docs_write_it():
    code = ("import tfdist\nprint(tfdist.keras.guards.StopOnNaN.__name__, "
            "'guards' in dir(tfdist.keras))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.stdout.split() == ["StopOnNaN", "True"], result.stderr[-2000:]
    for doc in ("docs/model_average.md", "docs/faults.md"):
        assert "tfdist.keras.guards.StopOnNaN" in (ROOT / doc).read_text()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(outer_compression=["int4"]), "Received: outer_compression=['int4']"),
    (dict(compression=["fp16"]), "Received: compression=['fp16']"),
])
def test_list_compression_is_named(kwargs, needle):
    import tfdist

    with pytest.raises(ValueError, match=r"^(outer_)?compression must be .*" +
                       needle.replace("[", r"\[").replace("]", r"\]")):
        tfdist.ModelAverageStrategy(**kwargs)


@pytest.mark.multiprocess
@pytest.mark.parametrize("environment,expected", [({}, "2"),
                                                  ({"TF_CPP_MIN_LOG_LEVEL": "0"}, "0")])
def test_cli_hides_tensorflows_start_up_log_unless_asked(tmp_path, environment, expected):
    """``tfdist launch`` gives its tasks TF_CPP_MIN_LOG_LEVEL=2 unless the user set it."""
    script = tmp_path / "level.py"
    script.write_text("import os\nprint('LEVEL', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "launch", "--workers", "1",
                             str(script)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**env, **environment})
    assert result.returncode == 0, result.stderr
    assert f"LEVEL {expected}" in result.stdout, result.stdout


@pytest.mark.unit
def test_readme_lists_every_notebook():
    readme = (ROOT / "README.md").read_text()
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert notebook.stem in readme, notebook.name
