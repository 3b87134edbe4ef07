"""On a mesh of this process's 2 logical CPUs: a last batch that cannot split evenly
over the replicas is refused before the first step; a one-host strategy refuses a mesh
larger than its replicas; and layouts that do nothing are warned about. (The 2 x 2 runs
of gathered columns' consumers and of partial last batches need 4 logical CPUs: they
are in tests/test_tensor_parallel_mesh.py, whose one 4-CPU script runs them.)"""

import warnings

import numpy as np
import pytest

from helpers import assert_weights_close, layout_map

from tp_jobs import BATCH, PAIR, data, pair


def _compiled(strategy):
    import keras

    with strategy.scope():
        model = pair()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_last_batch_that_cannot_split_evenly_is_refused_before_the_first_step(
        logical_cpus):
    import tfdist

    model = _compiled(tfdist.ModelParallelStrategy(layout_map=PAIR))
    x, y = data(37)  # a last batch of 5 rows over 2 replicas
    before = [np.asarray(w) for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"last batch of x \(5 rows\) must split evenly "
                                         r"over the 2 replicas.*drop_remainder=True\. "
                                         r"Received: 37 rows, batch_size=8"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match=r"last batch of validation_data \(3 rows\)"):
        model.fit(x[:32], y[:32], batch_size=BATCH, validation_data=(x[:3], y[:3]),
                  verbose=0)
    with pytest.raises(ValueError, match=r"last batch of x \(1 rows\)"):
        model.predict(x[:33], batch_size=BATCH, verbose=0)
    assert_weights_close([np.asarray(w) for w in model.get_weights()], before, atol=0)


def test_one_host_strategy_refuses_a_mesh_larger_than_its_replicas(logical_cpus,
                                                                   monkeypatch):
    """As on each of 2 launched workers with one CPU each: a LayoutMap over
    DeviceMesh((1, 2)) of every worker's device, a strategy of this process's one."""
    import keras

    import tfdist
    from tfdist.keras import distribution

    # Keras' distribution API reads TF_CONFIG once per process: this test's job view is
    # its own, so later tests in this process see none.
    monkeypatch.setattr(distribution, "_job", distribution._Job())
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1", '
                                     '"localhost:2"]}, "task": {"type": "worker", "index": 0}}')
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["up/kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"^ModelParallelStrategy splits over this "
                                         r"process's 1 replica\(s\), but the layout map's "
                                         r"mesh has 2 devices: across workers use "
                                         r"MultiWorkerModelParallelStrategy\. Received: "
                                         r"DeviceMesh\(\(1, 2\)\), 1 replica\(s\)$"):
        tfdist.ModelParallelStrategy(layout_map=layouts, devices=["/cpu:0"])
    tfdist.ModelParallelStrategy(layout_map=layout_map(PAIR.items(), shape=(1, 2)))  # fits


def test_layouts_that_do_nothing_are_warned_about(logical_cpus):
    import keras

    import tfdist

    with pytest.warns(UserWarning, match=r"layout_map\['up/kernel'\] names the axis "
                                         r"'modle', which is neither 'model' nor 'batch': "
                                         r"nothing is split on it \(nearest: 'model'\)"):
        strategy = tfdist.ModelParallelStrategy(layout_map={"up/kernel": (None, "modle")})
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, name="up"),
                                  keras.layers.Dense(4, name="down")],
                                 name="pair")
    x, _ = data(BATCH)
    with pytest.warns(UserWarning) as caught:
        model.predict(x, batch_size=BATCH, verbose=0)
    messages = [str(w.message) for w in caught if "layout_map key" in str(w.message)]
    assert messages == ["layout_map key 'up/kernel' matches no variable of model "
                        "'pair': nothing is laid out by it (nearest variable path: "
                        "'pair/up/kernel'). Received: key='up/kernel'"]
    with warnings.catch_warnings():  # once per key
        warnings.simplefilter("error")
        model.predict(x, batch_size=BATCH, verbose=0)
