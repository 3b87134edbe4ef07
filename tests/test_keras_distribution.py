"""keras.distribution on the TensorFlow backend, through tfdist (docs/keras_distribution.md).

The script under test (tests/kdist_jobs.py) is backend-agnostic Keras 3 with no tfdist
line; ``import tfdist`` is what makes it distributed.
"""

import numpy as np
import pytest

from helpers import assert_weights_close, layout_map
from kdist_jobs import GLOBAL_BATCH, dataset, keras_script, launched_task


@pytest.fixture
def no_distribution():
    """Leaves Keras with no distribution and TF with its default strategy."""
    import keras
    import tensorflow as tf

    yield
    keras.distribution.set_distribution(None)
    assert not tf.distribute.has_strategy()


def _mirrored_reference():
    """The same training under tfdist.MirroredStrategy (no keras.distribution)."""
    import keras

    import tfdist
    from helpers import mlp

    with tfdist.MirroredStrategy().scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(dataset(), epochs=2, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def test_list_devices_on_one_host(logical_cpus):
    import keras

    assert keras.distribution.list_devices() == ["cpu:0", "cpu:1"]
    assert keras.distribution.list_devices("cpu") == ["cpu:0", "cpu:1"]
    assert keras.distribution.get_device_count() == 2


@pytest.mark.parametrize("how", ["set", "scope"])
def test_data_parallel_equals_mirrored_and_one_device(logical_cpus, no_distribution, how):
    import tensorflow as tf

    got = keras_script(how)
    assert got["replicas"] == 2 and got["processes"] == 1
    assert not tf.distribute.has_strategy()  # unset after set_distribution(None) / scope
    reference = keras_script("none")
    assert reference["replicas"] == 1
    assert_weights_close(got["weights"], reference["weights"])
    assert_weights_close(got["weights"], _mirrored_reference())
    assert got["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    np.testing.assert_allclose(got["predictions"], reference["predictions"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_data_parallel_equals_one_device(logical_cpus):
    from helpers import run_cluster

    tasks = run_cluster(launched_task, timeout=280)
    reference = keras_script("none")
    # "global": every worker passes the global dataset (Keras shards it); "parts": each
    # passes its own slice of every global batch (auto_shard_dataset=False).
    for case in ("global", "parts"):
        runs = [task[case] for task in tasks]
        assert [r["process"] for r in runs] == [0, 1]
        for run in runs:
            # One CPU replica per worker, as tfdist.MultiWorkerMirroredStrategy makes them.
            assert run["devices"] == ["cpu:0", "cpu:1"] and run["count"] == 2
            assert run["processes"] == 2 and run["replicas"] == 2
            assert_weights_close(run["weights"], reference["weights"])
            assert run["loss"] == pytest.approx(reference["loss"], abs=1e-5)
            # Every worker gets the predictions of the whole dataset, in its order.
            np.testing.assert_allclose(run["predictions"], reference["predictions"],
                                       atol=1e-5)
        assert_weights_close(runs[0]["weights"], runs[1]["weights"], atol=0)


def _two_dense():
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3, name="second")(keras.layers.Dense(4, name="first")(inputs))
    return keras.Model(inputs, outputs)


def test_model_axis_layout_is_refused_naming_the_variable(logical_cpus, no_distribution):
    import keras

    # The exact key wins over the regex for first/kernel (replicated, allowed); the
    # regex lays second/kernel on the "model" axis, which tfdist refuses, once, at build.
    layouts = layout_map([("first/kernel", (None, None)), (".*kernel", (None, "model"))])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts))
    with pytest.raises(ValueError) as raised:
        _two_dense()
    message = str(raised.value)
    assert "Received: variable.path='second/kernel', layout=(None, 'model')" in message
    assert "first/kernel" not in message and "mesh axis 'model'" in message


def test_a_data_x_model_mesh_with_the_batch_axis_second_is_refused(logical_cpus,
                                                                   no_distribution):
    """A (2, 2) mesh runs as ModelParallelStrategy(model_parallel=2)
    (tests/test_tensor_parallel_mesh.py); laid out (model, batch) it is refused."""
    import keras

    mesh = keras.distribution.DeviceMesh((2, 2), ["model", "batch"],
                                         [f"cpu:{i}" for i in range(4)])
    layout_map = keras.distribution.LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"the batch axis first\. Received: device_mesh="):
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    assert keras.distribution.distribution() is None


def test_a_model_axis_runs_as_model_parallel_strategy(logical_cpus, no_distribution):
    import keras

    import tfdist
    from tfdist.keras.distribution import strategy_plan

    layouts = layout_map([("first/kernel", (None, "model")), (".*kernel", ("model", None))],
                             shape=(1, 2))
    name, kwargs = strategy_plan(keras.distribution.ModelParallel(layout_map=layouts))
    assert name == "ModelParallelStrategy"
    assert kwargs["layout_map"] == {"first/kernel": (None, "model"),
                                    ".*kernel": ("model", None)}
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts))
    model = _two_dense()
    assert isinstance(model.distribute_strategy, tfdist.ModelParallelStrategy)


def test_layout_map_matching_exact_key_before_regex(logical_cpus):
    import keras

    from tfdist.keras.distribution import strategy_plan

    layouts = layout_map([("first/kernel", ("batch", None)), (".*kernel", (None, None)),
                              (".*bias", ("batch",))])
    name, kwargs = strategy_plan(keras.distribution.ModelParallel(layout_map=layouts))
    # The contract with fully sharded parameters (the FSDP helper's strategy options).
    assert name == "MirroredStrategy" and kwargs["shard_parameters"] is True
    assert kwargs["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    shard = kwargs["shard_filter"]
    assert shard("first/kernel") is True  # exact key, though ".*kernel" matches too
    assert shard("second/kernel") is False  # regex: replicated
    assert shard("second/bias") is True  # regex on the batch axis
    assert shard("normalization/gamma") is False  # no layout: replicated, as in Keras


def test_replicated_layouts_run_as_data_parallel(logical_cpus, no_distribution):
    import keras

    import tfdist

    layouts = layout_map([(".*kernel", (None, None))])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts))
    model = _two_dense()
    assert isinstance(model.distribute_strategy, tfdist.MirroredStrategy)
    assert model.distribute_strategy.num_replicas_in_sync == 2


def test_distribute_tensor_keeps_batch_layouts_and_refuses_others(logical_cpus,
                                                                   no_distribution):
    import keras

    layouts = layout_map([])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts))
    mesh = layouts.device_mesh
    x = keras.ops.ones((4, 3))
    same = keras.distribution.distribute_tensor(
        x, keras.distribution.TensorLayout(("batch", None), mesh))
    assert same is x
    with pytest.raises(ValueError, match=r"Received: tensor='a layer output or value', "
                                         r"layout=\(None, 'model'\)"):
        keras.distribution.distribute_tensor(
            x, keras.distribution.TensorLayout((None, "model"), mesh))


def test_batch_axis_layouts_train_fully_sharded(logical_cpus, no_distribution):
    got = keras_script("set", kind="model")
    # Both kernels (the ".*kernel" layouts), no bias; layer names vary within a process.
    assert [path.rsplit("/", 1)[-1] for path in got["sharded"]] == ["kernel", "kernel"]
    reference = keras_script("none")
    assert_weights_close(got["weights"], reference["weights"])
    np.testing.assert_allclose(got["predictions"], reference["predictions"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_batch_axis_layouts_train_fully_sharded(logical_cpus):
    from helpers import run_cluster

    from kdist_jobs import launched_model_parallel_task

    tasks = run_cluster(launched_model_parallel_task, timeout=280)
    reference = keras_script("none")
    for task in tasks:
        assert task["devices"] == ["cpu:0", "cpu:1"] and task["replicas"] == 2
        assert task["sharded"] == ["sequential/dense/kernel", "sequential/dense_1/kernel"]
        assert_weights_close(task["weights"], reference["weights"])
        assert task["loss"] == pytest.approx(reference["loss"], abs=1e-5)


@pytest.fixture
def fresh_job():
    """Restores the job tfdist.keras.distribution resolved (initialize changes it)."""
    from tfdist.keras import distribution

    saved = distribution._job
    distribution._job = distribution._Job()
    yield distribution
    distribution._job = saved


def test_initialize_from_job_addresses(logical_cpus, fresh_job):
    import keras

    keras.distribution.initialize("127.0.0.1:2222,127.0.0.1:2223", 2, 1)
    assert (fresh_job.num_processes(), fresh_job.process_id()) == (2, 1)
    assert keras.distribution.list_devices() == ["cpu:0", "cpu:1"]
    with pytest.raises(ValueError, match="every process's host:port .* Received: "
                                         "job_addresses='127.0.0.1:2222', num_processes=2"):
        keras.distribution.initialize("127.0.0.1:2222", 2, 0)
    with pytest.raises(ValueError, match="process_id must be .* process_id=None"):
        keras.distribution.initialize("127.0.0.1:2222,127.0.0.1:2223")
    assert GLOBAL_BATCH % 2 == 0  # the launched test's batch splits over 2 workers


def test_multi_worker_plans(logical_cpus, fresh_job):
    import keras

    keras.distribution.initialize("127.0.0.1:2222,127.0.0.1:2223", 2, 0)
    name, kwargs = fresh_job.strategy_plan(keras.distribution.DataParallel())
    assert name == "MultiWorkerMirroredStrategy" and set(kwargs) == {"cluster_resolver"}
    assert kwargs["cluster_resolver"].worker == ("127.0.0.1:2222", "127.0.0.1:2223")
    layouts = layout_map([(".*kernel", ("batch", None))])
    name, kwargs = fresh_job.strategy_plan(
        keras.distribution.ModelParallel(layout_map=layouts))
    assert name == "MultiWorkerMirroredStrategy" and kwargs["shard_parameters"] is True
    assert kwargs["shard_filter"]("first/kernel") is True
    with pytest.raises(ValueError, match=r"must hold every device .* Received: "
                                         r"devices=\['cpu:0'\], list_devices\(\)="):
        fresh_job.strategy_plan(keras.distribution.DataParallel(devices=["cpu:0"]))


# ---- replacing a distribution; models built before one (issue 39 item 9) ----------------

def _column_row_pair(compiled=True):
    """Input(8) -> Dense(16, relu) "up" -> Dense(3) "down", compiled with Adam."""
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="down")(hidden))
    if compiled:
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _trained(model):
    model.fit(dataset(), epochs=2, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


@pytest.fixture(scope="module")
def one_device_pair():
    """`_column_row_pair` trained on one device (no strategy, no distribution)."""
    return _trained(_column_row_pair())


def _split_pair():
    """``ModelParallel`` on a (1, 2) mesh: "up" column-split, "down" row-split."""
    import keras

    return keras.distribution.ModelParallel(layout_map=layout_map(
        [("up/kernel", (None, "model")), ("up/bias", ("model",)),
         ("down/kernel", ("model", None))], shape=(1, 2)))


@pytest.mark.parametrize("order", ["data_then_model", "model_then_data"])
def test_replacing_a_distribution_trains_equal_to_one_device(logical_cpus, no_distribution,
                                                             one_device_pair, order):
    """The keras-io distribution guide sets DataParallel, then ModelParallel (no None in
    between); the second strategy's byte counter was made in the first one's scope."""
    import keras

    import tfdist

    first, second = keras.distribution.DataParallel(), _split_pair()
    if order == "model_then_data":
        first, second = second, first
    keras.distribution.set_distribution(first)
    under_first = _column_row_pair()
    keras.distribution.set_distribution(second)
    under_second = _column_row_pair()
    kinds = {"data_then_model": (tfdist.MirroredStrategy, tfdist.ModelParallelStrategy),
             "model_then_data": (tfdist.ModelParallelStrategy, tfdist.MirroredStrategy)}
    assert isinstance(under_first.distribute_strategy, kinds[order][0])
    assert isinstance(under_second.distribute_strategy, kinds[order][1])
    assert_weights_close(_trained(under_second), one_device_pair)
    assert under_second.distribute_strategy.bytes_communicated > 0
    # A model built under the first distribution keeps its strategy, as on JAX.
    assert_weights_close(_trained(under_first), one_device_pair)
    assert keras.distribution.distribution() is second


def test_a_strategy_created_inside_another_s_scope(logical_cpus, one_device_pair):
    import tensorflow as tf

    import tfdist

    with tfdist.MirroredStrategy().scope():
        inner = tfdist.ModelParallelStrategy(layout_map={
            "up/kernel": (None, "model"), "up/bias": ("model",),
            "down/kernel": ("model", None)})
    counter = inner.communicator.counter.variable
    assert not isinstance(counter, tf.distribute.DistributedValues)
    with inner.scope():
        model = _column_row_pair()
    assert_weights_close(_trained(model), one_device_pair)
    assert inner.bytes_communicated > 0


def test_a_model_built_before_set_distribution_trains_on_one_device(
        logical_cpus, no_distribution, one_device_pair):
    """docs/keras_distribution.md: it stays on one device, as on JAX."""
    import keras
    import tensorflow as tf

    import tfdist

    before, uncompiled = _column_row_pair(), _column_row_pair(compiled=False)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    assert_weights_close(_trained(before), one_device_pair, atol=1e-6)
    assert np.asarray(before.predict(dataset(), verbose=0)).shape == (64, 3)
    assert isinstance(tf.distribute.get_strategy(), tfdist.MirroredStrategy)  # still set
    # Compiled after set_distribution with an optimizer made after it: refused in one
    # line (Keras made the optimizer's step counter under the distribution's strategy).
    with pytest.raises(ValueError, match=r"its optimizer was made after it.*Received: "
                                         r"optimizer=.* made under MirroredStrategy"):
        uncompiled.compile(keras.optimizers.Adam(0.01), "mse")


def test_a_saved_model_loads_compiled_after_set_distribution(logical_cpus, no_distribution,
                                                             tmp_path):
    """Wrapping ``compile`` for a model built before `set_distribution` keeps it Keras'
    own: `keras.saving.load_model` compiles a loaded model only when its class's
    ``compile`` is ``Trainer.compile`` (else: "compile() method is custom", no optimizer,
    and ``fit`` fails with "no attribute 'optimizer'")."""
    import keras

    saved = _column_row_pair()
    saved.save(tmp_path / "pair.keras")
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.distribution.set_distribution(None)
    loaded = keras.saving.load_model(tmp_path / "pair.keras")
    assert loaded.compiled and loaded.optimizer is not None
    assert type(loaded.optimizer) is type(saved.optimizer)
