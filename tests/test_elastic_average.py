"""Elastic model averaging (docs/elastic.md): ``tfdist.ModelAverageStrategy`` under
``tfdist launch --min-workers``, against local SGD written by hand in numpy that applies
the same membership schedule."""

import numpy as np
import pytest

import elastic_job
from helpers import assert_weights_close
from test_elastic import EPOCHS, JOINER_HEARTBEAT, STEPS, _launch, told

PERIOD = 5  # averages after steps 5, 10, ...: the epoch's end (10 steps) is one
LR, MOMENTUM = 0.05, 0.9  # elastic_job.model()'s SGD


@pytest.fixture(scope="module")
def initial_weights():
    return elastic_job.model().get_weights()


def np_local_sgd(initial, members_at, period=PERIOD):
    """Local SGD of elastic_job's model (Dense(4, tanh), Dense(1), MSE, SGD with
    momentum) in numpy: at step ``t`` (1-based) ``members_at(t)`` (names, in rank
    order) each take their share of the global batch, and every ``period`` steps the
    members' weights become their mean. A member's momentum stays its own. A member
    that joins after the start takes the last average and rank 0's momentum.

    Returns:
        ``(weights, averaged)``: the members' weights after the last step, and the
        averaged weights after each averaging step.
    """
    x, y = elastic_job.data()
    x, y = x.astype(np.float64), y.astype(np.float64)
    steps_per_epoch = len(x) // elastic_job.BATCH
    start = [w.astype(np.float64) for w in initial]
    weights, momenta, averaged = {}, {}, {}
    for t in range(1, STEPS + 1):
        members = members_at(t)
        first = (t - 1) % steps_per_epoch * elastic_job.BATCH
        for name in members:
            if name not in weights and t > 1:  # a joiner
                weights[name] = [v.copy() for v in averaged[max(averaged)]]
                momenta[name] = [v.copy() for v in momenta[members[0]]]
        for rank, name in enumerate(members):
            w = weights.setdefault(name, [v.copy() for v in start])
            m = momenta.setdefault(name, [np.zeros_like(v) for v in start])
            lo = first + rank * elastic_job.BATCH // len(members)
            hi = first + (rank + 1) * elastic_job.BATCH // len(members)
            for v, velocity, g in zip(w, m, _gradients(w, x[lo:hi], y[lo:hi])):
                velocity *= MOMENTUM
                velocity -= LR * g
                v += velocity
        if t % period == 0:
            mean = [np.mean([weights[n][i] for n in members], axis=0)
                    for i in range(len(start))]
            for name in members:
                weights[name] = [v.copy() for v in mean]
            averaged[t] = mean
    return weights, averaged


def _gradients(w, x, y):
    """Gradients of the mean squared error of ``x @ W1 + b1 -> tanh -> @ W2 + b2``."""
    w1, b1, w2, b2 = w
    hidden = np.tanh(x @ w1 + b1)
    error = 2 * (hidden @ w2 + b2 - y) / len(x)
    back = (error @ w2.T) * (1 - hidden ** 2)
    return [x.T @ back, back.sum(0), hidden.T @ error, error.sum(0)]


def test_the_numpy_reference_is_keras_local_sgd_on_one_worker(initial_weights):
    """One member: the numpy reference is plain Keras training (averaging one model
    changes nothing)."""
    net = elastic_job.model()
    elastic_job.fit(net, EPOCHS)
    weights, _ = np_local_sgd(initial_weights, lambda t: ["worker-0"])
    assert_weights_close(net.get_weights(), weights["worker-0"])


def _assert_members_follow(results, initial_weights, changed_at, before, after,
                           period=PERIOD):
    """Each member's end and every average equal numpy's with ``before`` as the members
    up to step ``changed_at`` and ``after`` from it (averaging every ``period`` steps)."""
    assert sorted(results) == sorted(after)
    weights, averaged = np_local_sgd(initial_weights,
                                     lambda t: before if t < changed_at else after, period)
    if STEPS % period:  # fit's end averages the members once more
        weights = dict.fromkeys(after, [np.mean([weights[n][i] for n in after], axis=0)
                                        for i in range(len(initial_weights))])
    for name, result in results.items():
        assert result["size"] == len(after) and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], weights[name])
        for step, mean in averaged.items():  # after every average: the members agree
            if name not in before and step < changed_at:
                continue  # before it joined
            epoch, batch = divmod(step - 1, STEPS // EPOCHS)
            flat = np.concatenate([np.ravel(w) for w in mean])
            np.testing.assert_allclose(result["steps"][f"{epoch}:{batch}"], flat,
                                       atol=1e-5, err_msg=f"{name} after step {step}")


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("event", [
    "worker-2:1:2",  # killed after step 13: the survivors train on to the average
    "worker-2:1:4:BEGIN",  # killed as step 15 begins: the others fail in its average
], ids=["between-averages", "during-an-average"])
def test_a_worker_lost_is_dropped_from_the_next_average(tmp_path, initial_weights, event):
    """Either way the survivors take in the loss at the average of step 15: they train
    steps 11-14 on a third of each global batch and, from step 15 (run again after a
    failed average), on half."""
    done, results, starts = _launch(tmp_path, kill=event, JOB_PERIOD=str(PERIOD))
    assert done.returncode == 0, told(done)
    assert "worker-2 exited with code -9 (signal SIGKILL); the elastic job carries on " \
           "with 2 worker(s)" in done.stderr
    for name in ("worker-0", "worker-1"):
        assert [pid for task, pid in starts if task == name] == [str(results[name]["pid"])]
    _assert_members_follow(results, initial_weights, 15,
                           ["worker-0", "worker-1", "worker-2"], ["worker-0", "worker-1"])


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_joiner_starts_from_the_last_average(tmp_path, initial_weights):
    """worker-2 is added during step 13: the members take it in before the average of
    step 15, and it starts from the average of step 10."""
    done, results, _ = _launch(tmp_path, "--max-workers", "3", kill="worker-0:1:2:GROW",
                               workers=(2, 2), heartbeat=JOINER_HEARTBEAT,
                               JOB_PERIOD=str(PERIOD))
    assert done.returncode == 0, told(done)
    assert "adding worker-2, which joins the running elastic job (3 workers)" in done.stderr
    _assert_members_follow(results, initial_weights, 15, ["worker-0", "worker-1"],
                           ["worker-0", "worker-1", "worker-2"])
