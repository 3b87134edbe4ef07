"""`tfdist train` resumes: a task killed after epoch 2 (the test hook
``TFDIST_TEST_KILL_AFTER_EPOCH``) restarts at epoch 3 from OUTPUT_DIR/backup, and the
final weights equal those of an uninterrupted run (atol 1e-5).

Launched modes restart through ``cluster.max_restarts``; in-process modes resume when the
same command runs again. The model-average case uses Adam, so each replica's optimizer
slots must come back from the backup too (with SGD the weights alone would do).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# 128 training samples, batch 32: 4 steps an epoch (a multiple of the averaging period).
COMMON = """
[data]
limit = 160
[train]
epochs = 4
global_batch_size = 32
verbose = 2
"""
CONFIGS = {
    "multi_worker": """
[strategy]
name = "multi_worker"
[cluster]
workers = 2
max_restarts = 1
timeout = 240
""" + COMMON,
    "model_average": """
[strategy]
name = "model_average"
options = { period = 4 }
[cluster]
workers = 2
max_restarts = 1
timeout = 240
""" + COMMON.replace("[train]", "[train]\noptimizer = \"adam\"\nlearning_rate = 0.01"),
    "none": """
[strategy]
name = "none"
""" + COMMON,
}


def _train(config, out, kill=None, sets=()):
    env = dict(os.environ)
    env.pop("TFDIST_TEST_KILL_AFTER_EPOCH", None)
    if kill:
        env["TFDIST_TEST_KILL_AFTER_EPOCH"] = kill
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [sys.executable, "-m", "tfdist.cli", "train", str(config),
               "--set", f'train.output_dir="{out}"']
    for item in sets:
        command += ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)


def _weights(out):
    import keras

    return keras.saving.load_model(out / "model.keras").get_weights()


def _assert_same_run(resumed, reference):
    for a, b in zip(_weights(resumed), _weights(reference), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    report = json.loads((resumed / "report.json").read_text())
    expected = json.loads((reference / "report.json").read_text())
    assert report["resumed_from_epoch"] == 2 and expected["resumed_from_epoch"] == 0
    assert report["epochs"] == 4  # the history of the killed attempt is kept
    np.testing.assert_allclose(report["history"]["loss"], expected["history"]["loss"],
                               atol=1e-5)
    assert not (resumed / "backup").exists()  # removed once training ended


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
# The victim is the chief, worker-0: it dies after writing its epoch-2 backup. Were it
# worker-1, the launcher's SIGTERM could reach the chief mid-write, and the job would
# resume at epoch 2 instead (same final weights; seen once under load).
@pytest.mark.parametrize("mode,victim", [("multi_worker", "worker-0"),
                                         ("model_average", "worker-0")])
def test_launched_job_killed_after_epoch_2_resumes_to_the_same_weights(tmp_path, mode,
                                                                      victim):
    config = tmp_path / f"{mode}.toml"
    config.write_text(CONFIGS[mode])
    killed = _train(config, tmp_path / "killed", kill=f"{victim}:2")
    log = killed.stdout + killed.stderr
    assert killed.returncode == 0, log[-3000:]
    assert f"restart 1/1: {victim} exited with code -9 (signal SIGKILL)" in log, log[-3000:]
    assert "resuming at epoch 3" in log and "Epoch 3/4" in log, log[-3000:]
    reference = _train(config, tmp_path / "reference")
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    _assert_same_run(tmp_path / "killed", tmp_path / "reference")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_in_process_run_killed_resumes_when_run_again(tmp_path):
    config = tmp_path / "none.toml"
    config.write_text(CONFIGS["none"])
    out = tmp_path / "killed"
    killed = _train(config, out, kill="2")
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-3000:]
    assert (out / "backup").is_dir() and not (out / "report.json").exists()
    # A copy of that output_dir, run for 2 epochs: its backup already holds them all.
    done = tmp_path / "done"
    shutil.copytree(out, done)
    complete = _train(config, done, sets=["train.epochs=2"])
    assert complete.returncode == 0, (complete.stdout + complete.stderr)[-3000:]
    assert (f"tfdist train: the backup in {done / 'backup'} already holds all 2 epochs; "
            "nothing to train") in complete.stdout, complete.stdout[-3000:]
    assert "Epoch " not in complete.stdout  # fit ran no epoch
    report = json.loads((done / "report.json").read_text())
    assert report["resumed_from_epoch"] == 2 and report["epochs"] == 2
    again = _train(config, out)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"resuming at epoch 3 from the backup in {out / 'backup'}" in again.stdout
    assert "Epoch 3/4" in again.stdout and "Epoch 1/4" not in again.stdout
    reference = _train(config, tmp_path / "reference")
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    _assert_same_run(out, tmp_path / "reference")
