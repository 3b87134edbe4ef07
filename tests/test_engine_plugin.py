"""A new engine is one file plus one registration: `tests/engine_plugin.py` ("ring").

- The registry: names, errors, ``available()``, ``TFDIST_ENGINE`` naming a plug-in, and
  ``import tfdist.engines`` without TensorFlow.
- 2 workers through ``tfdist.launch``: ``fit`` under
  ``MultiWorkerMirroredStrategy(engine="ring")`` equals the single-process reference, and
  ``ModelAverageStrategy(period=4, engine="ring")`` equals local SGD done in numpy; the
  gradients and averages went through the plug-in's communicator.
"""

import subprocess
import sys

import pytest

from helpers import ROOT, TESTS_DIR, assert_weights_close, run_cluster
from test_engines import _fit_mlp
from test_model_average import fit_linear, linear_data, numpy_local_sgd


@pytest.fixture
def registry(monkeypatch):
    """`tfdist.engines.registry` with its table restored after the test."""
    from tfdist.engines import registry

    monkeypatch.setattr(registry, "_engines", dict(registry._engines))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    return registry


@pytest.mark.unit
def test_register_engine_adds_a_name(registry, monkeypatch):
    import tfdist
    from engine_plugin import RingEngine

    assert tfdist.engines.available() == ("tf", "horovod")
    tfdist.engines.register_engine("ring", RingEngine)
    assert tfdist.engines.available() == ("tf", "horovod", "ring")
    assert tfdist.engines.engine_class("ring") is RingEngine and RingEngine.name == "ring"
    assert tfdist.engines.select_engine("ring", 2, on_gpus=False) == "ring"
    monkeypatch.setenv(registry.ENV_VAR, "ring")
    assert tfdist.engines.select_engine("auto", 2, on_gpus=False) == "ring"
    monkeypatch.delenv(registry.ENV_VAR)
    with pytest.raises(ValueError, match="already registered. Received: name='ring'"):
        tfdist.engines.register_engine("ring", RingEngine)
    with pytest.raises(ValueError, match="Received: name='auto'"):
        tfdist.engines.register_engine("auto", RingEngine)
    with pytest.raises(ValueError, match="Received: name='Ring Engine'"):
        tfdist.engines.register_engine("Ring Engine", RingEngine)
    with pytest.raises(ValueError, match="subclass of tfdist.engines.Engine"):
        tfdist.engines.register_engine("other", object)
    with pytest.raises(ValueError, match=r"engine must be one of \['tf', 'horovod', 'ring', "
                                         r"'auto'\]. Received: engine='gloo'"):
        tfdist.engines.select_engine("gloo", 2, on_gpus=False)


@pytest.mark.unit
def test_engines_import_without_tensorflow():
    code = ("import sys, tfdist; e = tfdist.engines; e.Engine; e.register_engine; "
            "assert e.available() == ('tf', 'horovod'); "
            "assert 'tensorflow' not in sys.modules and 'horovod' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})


def plugin_task(mode):
    """One worker of 2: trains through the "ring" test engine."""
    import engine_plugin

    import tfdist

    engine_plugin.register()
    if mode == "sync":
        strategy = tfdist.MultiWorkerMirroredStrategy(engine="ring")
        out = {"weights": _fit_mlp(strategy)}
    else:
        strategy = tfdist.ModelAverageStrategy(period=4, engine="ring")
        x, y = linear_data(n=80)
        initial, model = fit_linear(strategy, x, y, epochs=2)
        out = {"initial": initial, "weights": model.get_weights()}
    out.update(engine=strategy.engine, chief=strategy.is_chief, rank=strategy.rank,
               replicas=strategy.num_replicas_in_sync,
               reductions=engine_plugin.RingCommunicator.reductions)
    return out


def _check_common(results):
    assert [r["engine"] for r in results] == ["ring", "ring"]
    assert [(r["chief"], r["rank"]) for r in results] == [(True, 0), (False, 1)]
    assert all(r["replicas"] == 2 and r["reductions"] > 0 for r in results), results


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_plugin_engine_trains_fit_like_the_reference():
    results = run_cluster(plugin_task, "sync", workers=2, timeout=240)
    _check_common(results)
    reference = _fit_mlp(None)
    assert_weights_close(results[0]["weights"], results[1]["weights"], atol=0)
    assert_weights_close(results[0]["weights"], reference, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_plugin_engine_averages_models_like_numpy():
    results = run_cluster(plugin_task, "average", workers=2, timeout=240)
    _check_common(results)
    x, y = linear_data(n=80)
    initial = results[0]["initial"]
    expected = numpy_local_sgd(x, y, initial[0], initial[1], steps=10, period=4, replicas=2)
    for result in results:
        assert_weights_close(result["weights"], expected, atol=1e-5)
