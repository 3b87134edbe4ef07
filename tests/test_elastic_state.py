"""State components (`tfdist.strategies.state`) in elastic jobs: sharded optimizer state
and gradient accumulation, alone and together, keep their state through a lost
worker, a lost rank 0 and an added worker, and end at the single-process reference
with the same global batch (issue 32, item 2).

Each case is one launch of tests/elastic_job.py (3 workers, ``--min-workers 2``,
engine ``"horovod"``); the unit tests at the end check the protocol without TensorFlow.
"""

import os

import numpy as np
import pytest

from helpers import assert_weights_close
from test_elastic import EPOCHS, JOINER_HEARTBEAT, _launch, told

FEATURES = {
    "shard": {"JOB_SHARD": "1"},
    "accumulate": {"JOB_ACCUMULATE": "2"},
    "both": {"JOB_SHARD": "1", "JOB_ACCUMULATE": "2"},
}


def _reference(feature):
    """Single-process weights with the job's optimizer and global batch (48 per
    micro-step, ``accumulate_steps`` micro-steps per update)."""
    import elastic_job

    env = FEATURES[feature]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        net = elastic_job.model()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    x, y = elastic_job.data()
    accumulate = int(env.get("JOB_ACCUMULATE", 1))
    net.fit(x, y, batch_size=elastic_job.BATCH * accumulate, epochs=EPOCHS,
            shuffle=False, verbose=0)
    return net.get_weights(), EPOCHS * 10 // accumulate


def _check(done, results, starts, feature, size):
    assert done.returncode == 0, told(done)
    weights, updates = _reference(feature)
    for name, result in results.items():
        assert [pid for task, pid in starts if task == name] == [str(result["pid"])]
        assert result["size"] == size and result["iterations"] == updates, result
        assert_weights_close([np.array(w) for w in result["weights"]], weights)


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_lost_worker_keeps_the_state_of_every_feature(tmp_path, feature):
    # epoch 1, micro-step 5: in the middle of an accumulation of 2
    done, results, starts = _launch(tmp_path, kill="worker-1:1:4", **FEATURES[feature])
    assert sorted(results) == ["worker-0", "worker-2"], done.stderr[-4000:]
    assert all(r["recoveries"] == 1 for r in results.values())
    _check(done, results, starts, feature, size=2)


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_lost_rank_0_keeps_the_state_of_every_feature(tmp_path, feature):
    done, results, starts = _launch(tmp_path, kill="worker-0:1:4", **FEATURES[feature])
    assert sorted(results) == ["worker-1", "worker-2"], done.stderr[-4000:]
    _check(done, results, starts, feature, size=2)


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_an_added_worker_keeps_the_state_of_every_feature(tmp_path, feature):
    done, results, starts = _launch(
        tmp_path, "--max-workers", "3", kill="worker-0:1:2:GROW", workers=(2, 2),
        heartbeat=JOINER_HEARTBEAT, **FEATURES[feature])
    assert "adding worker-2, which joins the running elastic job (3 workers)" in \
        done.stderr, done.stderr[-4000:]
    assert sorted(results) == ["worker-0", "worker-1", "worker-2"]
    _check(done, results, starts, feature, size=3)


# ---- unit: the protocol (tfdist.strategies.state), without TensorFlow -------------

class _Part:
    """A fake state component: ``shared``/``own`` lists, an optional refusal, and the
    resizes it was asked for."""

    def __new__(cls, *args, **kwargs):
        from tfdist.strategies.state import StateComponent

        class Part(StateComponent):
            def __init__(self, feature, shared=(), own=(), refuse=None, at=1):
                self.feature, self.shared, self.own = feature, list(shared), list(own)
                self.refuse, self.at, self.resized, self.events = refuse, at, [], []

            def shared_variables(self):
                return self.shared

            def own_variables(self):
                return self.own

            def resize_refusal(self, old, new):
                return self.refuse

            def resize(self, old, new):
                self.resized.append((old, new))

            def commit_point(self, steps_ahead):
                return steps_ahead % self.at == 0

            def save_refusal(self):
                return self.refuse

            def committed(self):
                self.events.append("committed")

            def rolled_back(self):
                self.events.append("rolled back")

        return Part(*args, **kwargs)


@pytest.mark.unit
def test_components_list_each_variable_once_in_their_order():
    from tfdist.strategies import state

    a, b, c = object(), object(), object()
    parts = [_Part("x", shared=[a, b], own=[c]), _Part("y", shared=[b, c], own=[c])]
    assert state.shared_variables(parts) == [a, b, c]
    assert state.own_variables(parts) == [c]


@pytest.mark.unit
def test_a_resize_checks_every_component_before_it_recuts_any():
    from tfdist.strategies import state

    free, refusing = _Part("free"), _Part("fragments", refuse="anchors are cut by rank")
    with pytest.raises(state.ResizeRefused) as refused:
        state.resize([free, refusing], 3, 2)
    assert str(refused.value) == ("fragments cannot go from 3 to 2 replicas: anchors are "
                                  "cut by rank. Received: fragments in an elastic job")
    assert free.resized == []  # all or none
    state.resize([free], 3, 2)
    state.resize([free], 2, 2)  # the same count: nothing to re-cut
    assert free.resized == [(3, 2)]


@pytest.mark.unit
def test_a_commit_lands_only_where_every_component_lets_it():
    from tfdist.strategies import state

    parts = [_Part("model"), _Part("accumulate_steps", at=2)]
    assert [state.commit_point(parts, k) for k in range(4)] == [True, False, True, False]
    assert state.may_reform(parts)
    assert state.StateComponent().shared_variables() == []
    assert state.kept_when_newest(parts) == set()


@pytest.mark.unit
def test_a_save_is_refused_naming_each_component_that_would_lose_state():
    from tfdist.strategies import state

    free = _Part("free")
    state.check_save([free])
    with pytest.raises(ValueError) as refused:
        state.check_save([free, _Part("one", refuse="sums. Received: x=1"),
                          _Part("two", refuse="slots. Received: y=2")])
    assert str(refused.value) == ("a save here would lose training state: one: sums. "
                                  "Received: x=1; two: slots. Received: y=2")


@pytest.mark.unit
def test_commits_and_rollbacks_are_told_to_every_component():
    from tfdist.strategies import state

    parts = [_Part("a"), _Part("b")]
    state.committed(parts)
    state.rolled_back(parts)
    assert [p.events for p in parts] == [["committed", "rolled back"]] * 2
