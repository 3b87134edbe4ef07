"""tfdist.ray.run and Ray Train on a real local Ray instance (``ray.init(num_cpus=2)``).

One Ray instance serves the module, on loopback. tfdist.ray.run is held to the same
references as ``tfdist launch`` (MultiWorkerMirroredStrategy twice, ModelAverageStrategy
at period 4, and engine="horovod"); Ray Train's TensorflowTrainer reaches the same
references with both strategies. A task that raises, is SIGKILLed, or whose actor is
SIGKILLed fails the run naming it, and leaves no process or actor behind.
"""

import os
import re
import time

import numpy as np
import pytest

from helpers import TESTS_DIR
from spark_ray_jobs import (MARK, check_model_average, check_mwms, fault_job, import_engine,
                            mwms_job, mwms_reference, wait_gone)
from test_model_average import _worker_fit

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ray():
    """One local Ray instance (2 CPUs) for the module, shut down at its end."""
    # Ray's nodes otherwise advertise the host's external address; keep to loopback.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = import_engine("ray")
    # Ray Train pickles the test's loop by reference: its workers import this module.
    paths = [TESTS_DIR, os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
    import tfdist

    with tfdist.ray.connect(None, num_cpus=2, include_dashboard=False,
                            runtime_env=runtime_env):
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray


@pytest.fixture(scope="module")
def reference(logical_cpus):
    return mwms_reference()


def _assert_no_tfdist_actors(ray, seconds=60.0):
    """Every actor `tfdist.ray.run` started is gone (ray.kill is asynchronous)."""
    deadline = time.monotonic() + seconds
    while True:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("tfdist-")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"actors left behind: {left}"


@pytest.mark.timeout(600)
def test_multi_worker_mirrored_equals_reference_twice(ray, reference):
    import tfdist

    first = tfdist.ray.run(mwms_job, workers=2, timeout=240)
    check_mwms(first, reference)
    second = tfdist.ray.run(mwms_job, workers=2, timeout=240)
    check_mwms(second, reference)
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}
    _assert_no_tfdist_actors(ray)


@pytest.mark.timeout(400)
def test_model_average_period_4_matches_numpy(ray):
    import tfdist

    check_model_average(tfdist.ray.run(_worker_fit, 4, "linear", workers=2, timeout=240))


@pytest.mark.timeout(400)
def test_horovod_engine(ray):
    """MultiWorkerMirroredStrategy(engine="horovod") brings Gloo up from TF_CONFIG."""
    import tfdist
    from helpers import require_horovod

    require_horovod()
    from test_engines import _check, engine_task

    _check(tfdist.ray.run(engine_task, 0, False, workers=2, timeout=280), full=False)


def tf_log_job():
    """Makes a MultiWorkerMirroredStrategy(engine="horovod"); returns TF's log lines."""
    import logging

    import tfdist

    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    tfdist.MultiWorkerMirroredStrategy(engine="horovod")
    return lines


@pytest.mark.timeout(400)
def test_horovod_engine_does_not_say_tf_config_is_ignored(ray):
    """TF's MirroredExtended logs "TF_CONFIG will be ignored"; tfdist reads TF_CONFIG."""
    import tfdist
    from helpers import require_horovod

    require_horovod()
    for lines in tfdist.ray.run(tf_log_job, workers=2, timeout=280):
        assert not [line for line in lines if "TF_CONFIG will be ignored" in line], lines


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, expected", [
    ("raise", "worker-1 exited with code 1"),
    ("kill", "worker-1 exited with code -9 (signal SIGKILL)"),
    ("kill-engine", "worker-1 failed: its Ray actor tfdist-"),
])
def test_failed_task_is_named_and_nothing_is_left(ray, tmp_path, mode, expected):
    import tfdist

    with pytest.raises(tfdist.LaunchError, match="^" + re.escape(expected)) as caught:
        tfdist.ray.run(fault_job, str(tmp_path), mode, "worker-1", workers=2, timeout=240,
                       env={MARK: str(tmp_path)})
    assert caught.value.task == "worker-1"
    if mode == "raise":
        assert "RuntimeError: injected failure in worker-1" in caught.value.output_tail
    if mode == "kill-engine":
        assert "died" in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["worker-0.pid", "worker-1.pid"]
    wait_gone(tmp_path)
    _assert_no_tfdist_actors(ray)


def test_argument_errors(ray):
    import tfdist

    with pytest.raises(ValueError, match="workers must be an integer >= 1. Received: workers=0"):
        tfdist.ray.run(print, workers=0)
    with pytest.raises(ValueError, match="num_gpus must be a number >= 0. Received: num_gpus=-1"):
        tfdist.ray.run(print, workers=1, num_gpus=-1)


@pytest.mark.timeout(300)
def test_unplaceable_actors_are_named_and_removed(ray):
    import tfdist

    # 3 CPUs per actor on a 2-CPU Ray: none can be placed, whatever the start-up speed.
    with pytest.raises(tfdist.LaunchError, match=r"worker-0, worker-1, worker-2 did not start "
                                                 r"within 3s: Ray could not place 3 actors "
                                                 r"\(3 CPU and 0 GPU each\)"):
        tfdist.ray.run(print, workers=3, num_cpus=3, startup_timeout=3)
    _assert_no_tfdist_actors(ray)


# ---- Ray Train ------------------------------------------------------------------------------

def _train_loop(config):
    """Ray Train's loop on each worker (TF_CONFIG is set by TensorflowTrainer): the MLP
    under tfdist.MultiWorkerMirroredStrategy, or local SGD under ModelAverageStrategy."""
    import keras

    import tfdist
    from helpers import classification_data, mlp
    from test_model_average import fit_linear, linear_data

    if config["strategy"] == "model_average":
        x, y = linear_data(n=80)
        initial, linear = fit_linear(tfdist.ModelAverageStrategy(period=4), x, y, epochs=2)
        return {"initial": initial, "weights": linear.get_weights(),
                "replicas": [v.numpy() for v in linear.trainable_weights]}
    strategy = tfdist.MultiWorkerMirroredStrategy()
    x, y = classification_data(n=64)
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return {"loss": history.history["loss"], "weights": model.get_weights(),
            "replicas": strategy.num_replicas_in_sync}


def _fit_with_ray_train(strategy, storage):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        _train_loop, train_loop_config={"strategy": strategy},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=strategy, storage_path=str(storage)))
    # Ray 2.60: worker 0's return value (Result.metrics stays empty without a checkpoint)
    return trainer.fit().return_value


@pytest.mark.timeout(400)
def test_ray_train_multi_worker_mirrored_reaches_the_reference_loss(ray, logical_cpus,
                                                                    tmp_path):
    import keras

    from helpers import assert_weights_close, classification_data, mlp

    result = _fit_with_ray_train("multi_worker", tmp_path)
    x, y = classification_data(n=64)
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert result["replicas"] == 2
    np.testing.assert_allclose(result["loss"], reference.history["loss"], atol=1e-5)
    assert_weights_close(result["weights"], model.get_weights(), atol=1e-5)


@pytest.mark.timeout(400)
def test_ray_train_model_average_matches_numpy(ray, tmp_path):
    result = _fit_with_ray_train("model_average", tmp_path)
    check_model_average([result])  # worker 0's: Ray Train returns its value only
