"""`tfdist train` with ``cluster.mode = "nodes"``: two `tfdist train` processes on
loopback (node 0 and node 1, one worker each) meet at node 0's rendezvous and reach the
weights of the same training in one process (atol 1e-5). Config errors are one line,
exit 2, before anything starts.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfdist.config import ConfigError, load_config
from tfdist.launch import find_free_ports

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[strategy]
name = "multi_worker"
[cluster]
workers = 1
timeout = 240
[data]
limit = 160
[train]
epochs = 1
global_batch_size = 32
verbose = 0
"""


def _command(config, out, *options):
    return [sys.executable, "-m", "tfdist.cli", "train", str(config),
            "--set", f'train.output_dir="{out}"', *options]


def _env(token="nodes-test-token"):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TFDIST_TOKEN=token)
    return env


def _weights(out):
    import keras

    return keras.saving.load_model(out / "model.keras").get_weights()


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (["cluster.mode=\"nodes\""], "cluster.master must be 'HOST:PORT'"),
    (["cluster.mode=\"nodes\"", "cluster.master=\"h:1\"", "cluster.node_rank=2",
      "cluster.nnodes=2"], "cluster.node_rank must be < cluster.nnodes=2. Received: 2"),
    (["cluster.mode=\"nodes\"", "cluster.master=\"h:1\"", "cluster.node_rank=1",
      "cluster.nnodes=2", "cluster.chief=true"], "allowed only on node 0"),
    (["cluster.mode=\"nodes\"", "cluster.master=\"h:1\"", "strategy.name=\"mirrored\""],
     "needs strategy.name"),
    (["cluster.nnodes=2"], "cluster.nnodes applies only to cluster.mode = 'nodes'"),
    (["cluster.mode=\"nodes\"", "cluster.master=\"h:1\"", "cluster.nnodes=3",
      "cluster.workers=1", "train.global_batch_size=32"],
     "cannot be split evenly over 3 replicas"),
])
def test_config_errors(tmp_path, overrides, message):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(path, overrides)


@pytest.mark.multiprocess
def test_flags_set_nodes_mode_and_errors_exit_2(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    config = load_config(path, ['cluster.mode="nodes"', "cluster.nnodes=2",
                                "cluster.node_rank=1", "cluster.master=10.0.0.1:29400"])
    assert config["cluster"]["master"] == "10.0.0.1:29400"  # a bare string is kept
    env = _env()
    env.pop("TFDIST_TOKEN")
    run = subprocess.run(_command(path, tmp_path / "out", "--nnodes", "2", "--node-rank",
                                  "1", "--master", "127.0.0.1:1"),
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"tfdist train: error: {path}: cluster.mode = 'nodes': node 1 needs the rendezvous "
        "token of node 0 in $TFDIST_TOKEN. Received: TFDIST_TOKEN unset"]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_nodes_on_loopback_equal_one_process(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    master = f"127.0.0.1:{find_free_ports(1)[0]}"
    nodes = [subprocess.Popen(
        _command(path, tmp_path / f"node{rank}", "--nnodes", "2", "--node-rank", str(rank),
                 "--master", master),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env(),
        start_new_session=True) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(outputs)[-4000:]
    assert "node 1 joined" in outputs[0]
    assert "node 0 writes the report" in outputs[1]
    assert not (tmp_path / "node1" / "model.keras").exists()

    reference = tmp_path / "reference"
    run = subprocess.run(_command(path, reference, "--set", 'strategy.name="none"'),
                         capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for a, b in zip(_weights(tmp_path / "node0"), _weights(reference), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
