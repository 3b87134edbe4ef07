"""`tfdist train` with ``cluster.mode = "spark"`` and ``"ray"``: the main job's 2 workers
run on a local Spark (``local[2]``) or a local Ray instance and reach the weights of the
same training in one process (atol 1e-5). Config errors are caught before anything
starts.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spark_ray_jobs import import_engine
from tfdist.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[strategy]
name = "multi_worker"
[cluster]
workers = 2
timeout = 240
[data]
limit = 160
[train]
epochs = 1
global_batch_size = 32
verbose = 0
"""


def _train(config, out, *overrides):
    """Runs ``tfdist train`` in a subprocess (loopback only); returns it, finished."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    # A local Ray node otherwise advertises the host's external address.
    env.update(TF_CPP_MIN_LOG_LEVEL="2", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    command = [sys.executable, "-m", "tfdist.cli", "train", str(config),
               "--set", f'train.output_dir="{out}"', *(f"--set={o}" for o in overrides)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=360)


def _weights(out):
    import keras

    return keras.saving.load_model(out / "model.keras").get_weights()


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (['cluster.mode="spark"', 'strategy.name="mirrored"'],
     "cluster.mode = 'spark' needs strategy.name 'multi_worker', 'model_average' or "
     "'multi_worker_model_parallel'. Received: 'mirrored'"),
    (['cluster.mode="ray"', "cluster.chief=true"],
     "cluster.chief is not supported with cluster.mode = 'ray'"),
    (['cluster.mode="ray"', "cluster.max_restarts=1"],
     "cluster.max_restarts is not supported with cluster.mode = 'ray'"),
    (['cluster.mode="spark"', "cluster.nnodes=2"],
     "cluster.nnodes applies only to cluster.mode = 'nodes'"),
    (['cluster.mode="spark"', "cluster.workers=3"], "cannot be split evenly over 3 replicas"),
])
def test_config_errors(tmp_path, overrides, message):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(path, overrides)


@pytest.mark.unit
def test_master_is_the_engines_address(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    for mode, master in (("spark", "spark://head:7077"), ("ray", "ray://head:10001")):
        config = load_config(path, [f'cluster.mode="{mode}"', f'cluster.master="{master}"'])
        assert config["cluster"]["master"] == master


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job in one process (strategy "none")."""
    out = tmp_path_factory.mktemp("reference")
    path = out / "c.toml"
    path.write_text(CONFIG)
    run = _train(path, out / "run", 'strategy.name="none"')
    assert run.returncode == 0, run.stderr[-3000:]
    return _weights(out / "run")


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize("mode, engine", [("spark", "pyspark"), ("ray", "ray")])
def test_main_job_on_the_engine_equals_one_process(tmp_path, reference, mode, engine):
    import_engine(engine)
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    run = _train(path, tmp_path / "out", f'cluster.mode="{mode}"')
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "tfdist train: wrote" in run.stdout
    for a, b in zip(_weights(tmp_path / "out"), reference, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_elastic_main_job_with_the_default_engine_equals_one_process(tmp_path, reference):
    """``cluster.min_workers`` without ``options.engine``: "auto" picks Horovod in an
    elastic launch, as under ``tfdist launch --min-workers``."""
    from helpers import require_horovod

    require_horovod()
    path = tmp_path / "c.toml"
    path.write_text(CONFIG)
    run = _train(path, tmp_path / "out", "cluster.min_workers=1")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "joins Horovod: membership 1, rank 1 of 2" in run.stdout + run.stderr
    for a, b in zip(_weights(tmp_path / "out"), reference, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
