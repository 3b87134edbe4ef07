"""Tensor parallelism plus fully sharded parameters: the Megatron feed-forward pair's
kernels laid out ("batch", "model") (column-parallel) and ("model", "batch")
(row-parallel) on a d x m data x model mesh with d > 1. Each replica stores 1/(d*m) of
such a kernel (and of its optimizer slots), gathers its model slice within its batch
group when the layer runs, and receives its block's gradient reduce-scattered there.
Every run equals one device with the same initial weights and global batch (atol 1e-5).

The 2 x 2 mesh needs 4 logical CPUs, which a pytest process (2) cannot have: it runs as
one script (`tp_fsdp_jobs.main`); the 2 x 1 mesh runs here."""


import numpy as np
import pytest

from helpers import assert_weights_close, run_job_script

from tp_fsdp_jobs import STEPS, check_held, sharded_pair_floats
from tp_jobs import FEATURES, HIDDEN, OUTPUTS, gathered_as_by_workers, train



@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_job_script(tmp_path_factory.mktemp("fsdp_mesh"), "tp_fsdp_jobs.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(700)
def test_sharded_pair_on_a_2_x_2_mesh_matches_one_device(one_process):
    mesh, reference = one_process["mesh"], one_process["reference"]
    assert_weights_close(mesh["weights"], reference["weights"], atol=1e-5)
    np.testing.assert_allclose(mesh["predict"], reference["predict"], atol=1e-5)
    np.testing.assert_allclose(mesh["evaluate"], reference["evaluate"], rtol=1e-5)
    check_held(mesh["held"], 2, 2)
    assert mesh["bytes"] == 4 * sharded_pair_floats(2, 2) * STEPS


@pytest.mark.multiprocess
@pytest.mark.timeout(700)
def test_keras_model_parallel_shards_batch_model_kernels_on_a_2_x_2_mesh(one_process):
    run = one_process["keras"]
    assert (run["strategy"], run["model_parallel"]) == ("ModelParallelStrategy", 2)
    assert_weights_close(run["weights"], one_process["reference"]["weights"], atol=1e-5)
    check_held(run["held"], 2, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(700)
def test_global_clipnorm_counts_each_sharded_block_once(one_process):
    import keras

    from tp_jobs import pair, train

    run = one_process["clipped"]
    assert_weights_close(run["mesh"], run["reference"], atol=1e-5)
    unclipped = train(None, pair, optimizer=lambda: keras.optimizers.SGD(0.1))[0]
    assert max(np.max(np.abs(a - b)) for a, b in zip(run["reference"], unclipped)) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(700)
def test_a_2_x_2_save_is_whole_and_loads_plain_and_on_the_mesh(one_process):
    import keras

    from tp_fsdp_jobs import continued

    whole = one_process["mesh"]["weights"]
    plain = continued(one_process["saved"], None)
    assert_weights_close(plain["loaded"], whole, atol=0)
    assert [w.shape for w in keras.saving.load_model(one_process["saved"]).get_weights()] \
        == [(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, OUTPUTS), (OUTPUTS,)]
    on_mesh = one_process["on_mesh"]
    assert_weights_close(on_mesh["loaded"], whole, atol=0)
    assert_weights_close(on_mesh["after"], plain["after"], atol=1e-5)


def test_sharded_pair_on_a_2_x_1_mesh_matches_one_device(logical_cpus):
    """d = 2, m = 1 on this process's 2 logical CPUs: the kernels sharded over "batch"
    alone; each replica holds half of each."""
    import tfdist

    from tp_fsdp_jobs import SHARDED, run

    strategy = tfdist.ModelParallelStrategy(layout_map=SHARDED, model_parallel=1)
    mesh, reference = run(strategy), run(None)
    assert_weights_close(mesh["weights"], reference["weights"], atol=1e-5)
    np.testing.assert_allclose(mesh["predict"], reference["predict"], atol=1e-5)
    check_held(mesh["held"], 2, 1)
    assert mesh["bytes"] == 4 * sharded_pair_floats(2, 1) * STEPS


def test_sharded_attention_block_on_a_2_x_1_mesh_matches_one_device(logical_cpus):
    """MultiHeadAttention's EinsumDense kernels laid out ("batch", "model", None) and
    ("model", None, "batch"), and its feed-forward pair as above: half of each held."""
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    from tp_fsdp_jobs import SHARDED_HEADS
    from tp_jobs import attention_block, attention_data

    x, y = attention_data()
    strategy = tfdist.ModelParallelStrategy(layout_map=SHARDED_HEADS, model_parallel=1)
    weights, model = train(strategy, attention_block, optimizer="sgd", x=x, y=y)
    assert_weights_close(weights, train(None, attention_block, optimizer="sgd", x=x, y=y)[0],
                         atol=1e-5)
    sharded = {v.path: [int(np.prod(c.shape)) * 2 for c in tf_value(v).values]
               for v in model.weights
               if split_of(v) is not None and split_of(v).batch_axis is not None}
    assert sorted(sharded) == sorted(["mha/query/kernel", "mha/key/kernel",
                                      "mha/value/kernel", "mha/attention_output/kernel",
                                      "up/kernel", "down/kernel"])
    for v in model.weights:
        if v.path in sharded:
            assert sharded[v.path] == [int(np.prod(split_of(v).full_shape))] * 2, v.path
    # Several workers gather the blocks (`tensor_parallel.batch_axis.full_numpy`) and the split biases:
    # the same whole values.
    wholes = gathered_as_by_workers(strategy, model)
    assert set(sharded) < set(wholes)
    for path, (local, gathered) in wholes.items():
        np.testing.assert_array_equal(gathered, local, err_msg=path)


def test_a_batch_axis_that_does_not_divide_or_an_embedding_is_refused(logical_cpus):
    import keras

    import tfdist

    strategy = tfdist.ModelParallelStrategy(layout_map={"odd/kernel": ("model", "batch")},
                                            model_parallel=1)
    with pytest.raises(ValueError, match=r"Variable 'odd/kernel' of shape \[6, 5\] cannot "
                                         r"be sharded on axis 1 over the 2 replicas of the "
                                         r"'batch' axis.*Received: layout=\('model', 'batch'\)"):
        with strategy.scope():
            keras.layers.Dense(5, name="odd")(keras.Input((FEATURES,)))
    strategy = tfdist.ModelParallelStrategy(
        layout_map={"table/embeddings": ("model", "batch")}, model_parallel=1)
    with strategy.scope():
        ids = keras.Input((3,), dtype="int32")
        model = keras.Model(ids, keras.layers.Embedding(8, 4, name="table")(ids))
        model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"for Dense and EinsumDense kernels only.*"
                                         r"Received: layer 'table' \(Embedding\)"):
        model.predict(np.zeros((4, 3), "int32"), verbose=0)
