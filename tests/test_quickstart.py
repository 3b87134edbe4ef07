"""The README's quickstart (its first ```python block) runs as printed, with only its
epochs cut to 1, in a fresh Python process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def quickstart_code():
    """The first ```python block of README.md, with every ``epochs=N`` made ``epochs=1``.

    Raises:
        AssertionError: the README has no python block, or the block sets no epochs.
    """
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert block, "README.md has no ```python block"
    code, count = re.subn(r"\bepochs=\d+", "epochs=1", block[1])
    assert count, f"the README's quickstart sets no epochs=N:\n{block[1]}"
    return code


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_readme_quickstart_runs(tmp_path):
    # Then say how many epochs fit ran (Keras prints no "Epoch 1/1" line for one epoch).
    code = quickstart_code() + "\nprint('quickstart epochs:', len(model.history.epoch))\n"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=280, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "quickstart epochs: 1\n" in result.stdout, result.stdout[-3000:]
