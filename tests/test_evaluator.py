"""The evaluator task: `tfdist launch --evaluator` and `tfdist.keras.SidecarEvaluator`."""

import csv
import json
import os

import numpy as np
import pytest

from helpers import run_cluster

EPOCHS = 3


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")
    return x, y


def _model():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _evaluator_job(out_dir):
    """Chief/workers train with MWMS and checkpoint per epoch; the evaluator evaluates."""
    import tfdist

    cluster = tfdist.ClusterSpec.from_env()
    checkpoint_dir = os.path.join(out_dir, "ckpt")
    if cluster.task.type == "evaluator":
        evaluator = tfdist.keras.SidecarEvaluator(
            _model(), _data(seed=7), checkpoint_dir, poll_seconds=0.2, idle_timeout=240,
            batch_size=16)
        rows = evaluator.start()
        return {"task": cluster.task.name, "rows": rows, "csv": evaluator.csv_path,
                "log_dir": evaluator.log_dir}
    if cluster.ps:  # parameter servers: only the chief runs fit
        if cluster.task.type != "chief":
            tfdist.ParameterServerStrategy(mode="sync")  # serves until the chief is done
        strategy = tfdist.ParameterServerStrategy(mode="sync")
    else:
        strategy = tfdist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model()
    checkpoint = tfdist.keras.callbacks.ModelCheckpoint(
        os.path.join(checkpoint_dir, "epoch-{epoch:03d}.weights.h5"), save_weights_only=True)
    x, y = _data(seed=0)
    model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[checkpoint])
    return {"task": cluster.task.name, "replicas": strategy.num_replicas_in_sync,
            "cluster": cluster.jobs()}


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_evaluator_sees_every_checkpoint_and_ends_with_training(tmp_path):
    worker0, worker1, evaluator = run_cluster(_evaluator_job, str(tmp_path), workers=2,
                                              evaluator=True, timeout=400, stream=None)
    # The evaluator is in every task's cluster, but no strategy counts it as a worker.
    assert worker0["task"] == "worker-0" and worker1["task"] == "worker-1"
    assert worker0["replicas"] == worker1["replicas"] == 2
    assert len(worker0["cluster"]["evaluator"]) == 1
    # It returned by itself (a task stopped by the launcher returns None).
    assert evaluator is not None and evaluator["task"] == "evaluator-0"
    checkpoint_dir = tmp_path / "ckpt"
    assert json.loads((checkpoint_dir / "tfdist_training_done.json").read_text()) == {
        "epochs": EPOCHS}
    with open(evaluator["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(1, EPOCHS + 1))
    assert [r["checkpoint"] for r in rows] == [
        f"epoch-{e:03d}.weights.h5" for e in range(1, EPOCHS + 1)]
    assert os.listdir(os.path.join(evaluator["log_dir"], "evaluation")), "no TensorBoard events"
    # Each row equals model.evaluate of that checkpoint, computed here.
    model = _model()
    x, y = _data(seed=7)
    losses = []
    for row in rows:
        model.load_weights(checkpoint_dir / row["checkpoint"])
        expected = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        np.testing.assert_allclose(float(row["loss"]), expected["loss"], atol=1e-5)
        np.testing.assert_allclose(float(row["mae"]), expected["mae"], atol=1e-5)
        losses.append(expected["loss"])
    assert len(set(losses)) == EPOCHS, "every checkpoint should hold different weights"


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_evaluator_beside_parameter_servers(tmp_path):
    """chief + worker + ps + evaluator: TF's servers do not wait for the evaluator."""
    chief, evaluator = [r for r in run_cluster(
        _evaluator_job, str(tmp_path), workers=1, chief=True, ps=1, evaluator=True,
        timeout=400, stream=None) if r is not None and "task" in r and r["task"] in (
            "chief-0", "evaluator-0")]
    assert chief["task"] == "chief-0" and evaluator["task"] == "evaluator-0"
    with open(evaluator["csv"], newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(1, EPOCHS + 1))


# ---- in-process: the evaluator's directory rules, and the launcher's arguments ----------


def test_sidecar_evaluator_skips_hidden_and_stale_files_and_times_out(tmp_path):
    import tfdist

    model = _model()
    model.save_weights(tmp_path / "epoch-002.weights.h5")
    model.save_weights(tmp_path / ".tmp-1-epoch-003.weights.h5")  # still being written
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    stale = tmp_path / "tfdist_training_done.json"
    stale.write_text('{"epochs": 9}')
    os.utime(stale, (1, 1))  # from an earlier run: ignored
    evaluator = tfdist.keras.SidecarEvaluator(model, _data(seed=7), tmp_path,
                                              poll_seconds=0.05, idle_timeout=0.5,
                                              log_dir=tmp_path / "logs")
    with pytest.raises(TimeoutError, match="no new checkpoint"):
        evaluator.start()
    assert [r["checkpoint"] for r in evaluator.results] == ["epoch-002.weights.h5"]
    os.replace(tmp_path / ".tmp-1-epoch-003.weights.h5", tmp_path / "epoch-003.weights.h5")
    stale.write_text('{"epochs": 3}')  # this run's marker: the evaluator ends
    assert [r["epoch"] for r in evaluator.start()] == [3]  # epoch 2 was done already


def test_sidecar_evaluator_stops_after_max_evaluations(tmp_path):
    import tfdist

    model = _model()
    for epoch in (1, 2, 3):
        model.save_weights(tmp_path / f"epoch-{epoch}.weights.h5")
    rows = tfdist.keras.SidecarEvaluator(model, _data(seed=7), tmp_path, max_evaluations=2,
                                         poll_seconds=0.05, idle_timeout=30).start()
    assert [r["epoch"] for r in rows] == [1, 2]


@pytest.mark.unit
def test_evaluator_is_single_node_only():
    import tfdist

    with pytest.raises(ValueError, match="evaluator=True, nnodes=2"):
        tfdist.launch(print, evaluator=True, nnodes=2, master="127.0.0.1:1")


@pytest.mark.unit
def test_local_cluster_has_one_evaluator():
    from tfdist.launch import make_local_cluster

    cluster = make_local_cluster(2, evaluator=True)
    assert len(cluster.evaluator) == 1 and cluster.num_workers == 2
    assert [t.name for t in cluster.tasks()] == ["worker-0", "worker-1", "evaluator-0"]
