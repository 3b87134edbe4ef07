"""Model averaging's objects: one `Runner` serves every ``sync_delay`` (delay 0 gives
the weights it gave before the runner existed, to one ulp), and each fragment's state
is a `tfdist.strategies.state.StateComponent` (anchors and outer slots shared,
residuals own, a resize refused where the state cannot be handed over)."""

import numpy as np
import pytest

from test_model_average import fit_linear, linear_data


def _outer():
    import keras

    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


# Weights of fit_linear(period=4, fragments=2, sync_delay=0, 2 epochs) on 2 logical CPUs,
# recorded with the code before tfdist/strategies/averaging existed (with mix=1 the
# exchange ran inside the train step, with mix < 1 after it).
BEFORE = {
    (1.0, True): [[1.3193001747131348, -0.45005762577056885, 0.9516793489456177],
                  [0.4468068480491638]],
    (0.5, False): [[0.9467208385467529, -0.6479153037071228, 0.8667577505111694],
                   [0.2587113082408905]],
}


def test_one_runner_class_for_every_delay(logical_cpus):
    import tfdist
    from tfdist.strategies.averaging.runner import Runner

    made = {(delay, mix): tfdist.ModelAverageStrategy(period=4, fragments=2,
                                                      sync_delay=delay, mix=mix)
            for delay, mix in ((0, 1.0), (0, 0.5), (1, 1.0), (1, 0.5))}
    assert {type(s.runner) for s in made.values()} == {Runner}
    assert {key: s.runner.in_step for key, s in made.items()} == {
        (0, 1.0): True, (0, 0.5): False, (1, 1.0): False, (1, 0.5): False}
    assert all(s.runner.sync_delay == d and s.runner.mix == m for (d, m), s in made.items())


@pytest.mark.parametrize("mix,outer", sorted(BEFORE))
def test_delay_0_gives_the_weights_it_gave_before(logical_cpus, mix, outer):
    import tfdist

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, sync_delay=0, mix=mix,
                                           outer_optimizer=_outer if outer else None)
    _, model = fit_linear(strategy, x, y, epochs=2)
    got = [w.ravel() for w in model.get_weights()]
    # Bit for bit when this process ran nothing before; after other tests in the same
    # pytest worker, make test's runs differed from the recording by one ulp (oneDNN's
    # summation order is not fixed across a process's history).
    for value, recorded in zip(got, BEFORE[(mix, outer)]):
        np.testing.assert_allclose(value, recorded, rtol=2e-7, atol=0)
    assert strategy.bytes_communicated == 56


def test_fragments_are_state_components(logical_cpus):
    import tfdist
    from tfdist.strategies.averaging.elastic import AveragedModel
    from tfdist.strategies.averaging.fragment import Fragment
    from tfdist.strategies.state import ResizeRefused, StateComponent

    x, y = linear_data(n=80)
    strategy = tfdist.ModelAverageStrategy(period=4, fragments=2, outer_compression="int8",
                                           outer_optimizer=_outer)
    _, model = fit_linear(strategy, x, y, epochs=1)
    state = strategy.averaging_state(model.optimizer)
    assert isinstance(state, StateComponent)
    assert all(isinstance(f, Fragment) and isinstance(f, StateComponent)
               for f in state.fragments)
    first, second = state.fragments
    assert first.shared_variables() == [*first.anchors, *first.outer.variables]
    assert first.own_variables() == first.residuals and len(first.residuals) == 1
    ids = [id(v) for v in state.shared_variables()]
    assert ids == [id(v) for f in (first, second) for v in f.shared_variables()]
    assert [id(v) for v in state.own_variables()] == [id(r) for r in state.residuals]
    assert state.resize_refusal(2, 2) is None
    assert "fragments average at different steps" in state.resize_refusal(2, 1)
    assert "outer_compression" in first.resize_refusal(2, 1)
    with pytest.raises(ResizeRefused, match="model averaging cannot go from 2 to 1"):
        first.check_resize(2, 1)
    first.residuals = None
    assert first.resize_refusal(2, 1) is None  # anchors and outer slots are whole
    first.pending = object()
    assert "in flight" in first.resize_refusal(2, 3)
    first.pending = None

    component = strategy.state_components(model)[-1]  # what elastic fit asks
    assert isinstance(component, AveragedModel)
    assert [id(v) for v in component.averaging_variables()] == ids
    assert {id(v) for v in model.variables} <= component.kept_when_newest()
    shared = {id(v) for v in component.shared_variables()}
    assert set(ids) | {id(v) for v in model.variables} <= shared
    assert int(model.optimizer.iterations.numpy()) == 5
    assert not component.may_reform()  # step 6 averages fragment 1 only: never meet
