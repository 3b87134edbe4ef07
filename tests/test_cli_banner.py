"""``tfdist train`` shows the user's job, not TF's C++ start-up banner, unless asked.

TF 2.21 prints its banner (absl's note, oneDNN, cpu_feature_guard) while ``import
tensorflow`` loads, before it reads TF_CPP_MIN_LOG_LEVEL; the CLI drops those lines with
the launcher's own filter (`tfdist.launch.banner`). A level the user set wins.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist.launch.banner import _filtered_stderr

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[strategy]
name = "mirrored"
[data]
limit = 160
[train]
epochs = 1
global_batch_size = 32
verbose = 0
"""
ABSL_NOTE = "WARNING: All log messages before absl::InitializeLog() is called"
ONEDNN = "port.cc:153] oneDNN custom operations are on"


@pytest.mark.unit
def test_filter_drops_hidden_lines_and_relays_the_rest(capfd):
    lines = [
        f"{ABSL_NOTE} are written to STDERR\n",
        f"I0000 00:00:1795763972.099844   25559 {ONEDNN}. You may see ...\n",
        "W0000 00:00:1795763972.1   25559 cpu_feature_guard.cc:227] optimized\n",
        "E0000 00:00:1795763972.2   25559 loader.cc:12] could not load libfoo.so\n",
        "Traceback (most recent call last):\n",
        "a line without its end",
    ]
    with _filtered_stderr(2):
        for line in lines:
            os.write(2, line.encode())
    err = capfd.readouterr().err
    assert err == "".join(lines[3:]) + "\n"
    print("after", file=sys.stderr)  # stderr is back
    assert capfd.readouterr().err == "after\n"


def _train(tmp_path, level):
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    out = tmp_path / f"out-{level}"
    run = subprocess.run([sys.executable, "-m", "tfdist.cli", "train", str(config),
                          "--set", f'train.output_dir="{out}"'],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tfdist train: wrote" in run.stdout
    return run.stdout + run.stderr


@pytest.mark.multiprocess
def test_train_hides_the_banner_unless_the_user_asks(tmp_path):
    quiet = _train(tmp_path, None)
    assert ABSL_NOTE not in quiet and ONEDNN not in quiet, quiet
    assert "cpu_feature_guard" not in quiet, quiet
    loud = _train(tmp_path, "0")  # the user's level wins
    assert ABSL_NOTE in loud and ONEDNN in loud, loud
