"""shard_parameters=True (ZeRO-3 / FSDP): on 2 logical CPUs under MirroredStrategy and on
2 workers under tfdist launch (both engines), a model with Embedding,
MultiHeadAttention, Dense and Conv2D ends equal to one device with the global batch;
each replica holds half of the sharded elements; saves hold the unsharded layout."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fsdp_jobs import MIN_ELEMENTS, element_counts, model, train
from helpers import assert_weights_close

OPTIMIZERS = ("adam", "adamw", "sgd")


def _check_counts(counts, whole, replicas=2):
    assert counts, "no sharded variable"
    for count in counts:  # half, plus padding: less than one element per variable
        assert whole / replicas <= count <= whole / replicas + 64


def test_sharded_parameters_match_one_device_and_save_unsharded(logical_cpus, tmp_path):
    import keras
    import tfdist
    from tfdist._hooks.fsdp import shard_of

    for name in OPTIMIZERS:
        strategy = tfdist.MirroredStrategy(shard_parameters=True,
                                           min_shard_elements=MIN_ELEMENTS)
        got, trained = train(strategy, name)
        ref, _ = train(None, name)
        assert_weights_close(got, ref, atol=1e-5)
        counts, whole = element_counts(trained)
        assert len(counts) == 2
        _check_counts(counts, whole)
        for v in trained.weights:  # every kernel (Dense, Conv2D, EinsumDense) and the table
            assert (shard_of(v) is not None) == v.path.endswith(("kernel", "embeddings"))
    # The save holds the unsharded layout: a plain model (no strategy) loads it.
    path = str(tmp_path / "sharded.weights.h5")
    trained.save_weights(path)
    plain = model()
    plain.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(path)
    assert_weights_close([np.asarray(w) for w in plain.get_weights()], got, atol=0)
    momenta = [np.asarray(v) for v in plain.optimizer.variables if len(v.shape)]
    assert any(np.abs(m).max() > 0 for m in momenta)
    # ...and loads back into a sharded model (each replica takes its slice).
    with strategy.scope():
        again = model(seed=5)
    again.load_weights(path)
    assert_weights_close([np.asarray(w) for w in again.get_weights()], got, atol=0)


def test_shard_filter_decides_before_the_size_rule(logical_cpus):
    import tfdist
    from tfdist._hooks.fsdp import shard_of

    strategy = tfdist.MirroredStrategy(
        shard_parameters=True, min_shard_elements=10**9,
        shard_filter=lambda path: True if path.endswith("kernel") else None)
    with strategy.scope():
        built = model()
    sharded = {v.path for v in built.weights if shard_of(v) is not None}
    assert sharded and all(p.endswith("kernel") for p in sharded)
    # Every trainable variable sharded (biases, LayerNormalization's gamma and beta,
    # 2-element slices): still equal to one device.
    strategy = tfdist.MirroredStrategy(shard_parameters=True, shard_filter=lambda path: True)
    got, trained = train(strategy, "adam")
    assert all(shard_of(v) is not None for v in trained.trainable_weights)
    assert_weights_close(got, train(None, "adam")[0], atol=1e-5)
    with pytest.raises(ValueError, match="Received: 1 for path="):
        with tfdist.MirroredStrategy(shard_parameters=True,
                                     shard_filter=lambda path: 1).scope():
            model()


@pytest.mark.parametrize("kwargs, message", [
    ({"shard_optimizer_state": True}, "Received: shard_optimizer_state=True"),
    ({"min_shard_elements": 0}, "min_shard_elements"),
    ({"shard_filter": "kernel"}, "Received: shard_filter='kernel'"),
])
def test_refused_arguments(logical_cpus, kwargs, message):
    import tfdist

    with pytest.raises(ValueError, match=message):
        tfdist.MirroredStrategy(shard_parameters=True, **kwargs)


def _check_launched(results):
    chief, other = results
    assert chief["chief"] and not other["chief"] and chief["replicas"] == 2
    for name in OPTIMIZERS:
        mine, theirs = chief[name], other[name]
        assert_weights_close(mine["weights"], theirs["weights"], atol=0)
        assert_weights_close(mine["weights"], chief["reference"][name], atol=1e-5)
        for result in (mine, theirs):
            (count,) = result["counts"]
            _check_counts([count], result["whole"])


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize("engine", ["tf", "horovod"])
def test_two_workers(engine, tmp_path):
    """Both engines: Adam, AdamW, SGD equal one process, half the elements per worker,
    the chief's save loads in this process; with engine="tf" that save also resumes,
    sharded, on 1 and on 3 workers, equal to this process resuming it."""
    from helpers import require_horovod, run_cluster

    from fsdp_jobs import launched_task

    if engine == "horovod":
        require_horovod()
    results = run_cluster(launched_task, engine, timeout=280,
                          env={"TFDIST_TEST_DIR": str(tmp_path)})
    _check_launched(results)
    # The chief's save loads in this plain process.
    import keras

    plain = model()
    plain.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(results[0]["saved"])
    assert_weights_close([np.asarray(w) for w in plain.get_weights()],
                         results[0]["sgd"]["weights"], atol=0)
    if engine == "tf":  # the 2-worker save resumes sharded on 1 and on 3 workers
        from fsdp_jobs import resume, resume_task

        # Both launches at once, while this plain process resumes the same file.
        with ThreadPoolExecutor(max_workers=2) as pool:
            launches = [pool.submit(run_cluster, resume_task, results[0]["saved"], engine,
                                    workers=workers, timeout=200) for workers in (1, 3)]
            want = resume(results[0]["saved"])
            for launch in launches:
                for got in launch.result():
                    assert_weights_close(got, want, atol=1e-5)


def test_sharded_training_resumes_from_a_save(logical_cpus, tmp_path):
    """1 epoch, a save (weights and Adam's sharded slots, unsharded layout), a load
    into a new sharded model and 1 more epoch equal 2 uninterrupted epochs."""
    import tfdist

    from fsdp_jobs import save_and_resume

    strategy = tfdist.MirroredStrategy(shard_parameters=True, min_shard_elements=MIN_ELEMENTS)
    resumed = save_and_resume(strategy, str(tmp_path / "a.weights.h5"), "adam")
    ref, _ = train(None, "adam", epochs=2)
    assert_weights_close(resumed, ref, atol=1e-5)


def test_sharded_parameters_with_compression(logical_cpus):
    """fp16 on the wire (gathers and reduce-scatters): close to the unsharded fp16 run."""
    import tfdist

    got, _ = train(tfdist.MirroredStrategy(shard_parameters=True, compression="fp16",
                                           min_shard_elements=MIN_ELEMENTS), "sgd")
    plain, _ = train(tfdist.MirroredStrategy(compression="fp16"), "sgd")
    ref, _ = train(None, "sgd")
    assert_weights_close(got, plain, atol=2e-3)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) > 0  # fp16 did act


@pytest.mark.parametrize("case", ["mixed_float16", "mixed_bfloat16", "clipnorm",
                                  "global_clipnorm"])
def test_sharded_matches_unsharded_with(logical_cpus, case):
    """Mixed precision and clipping (norms over whole variables: the slices' squares
    are summed over the replicas) equal the unsharded run; evaluate and predict too.
    Under mixed precision with layers run again in the backward pass
    (reshard_after_forward=True, TF's recompute_grad) the result differs from the
    unsharded run by up to 2.5e-3: recompute_grad alone does that in float16 (the same
    layers rematerialised without sharding: 2.0e-3); with reshard_after_forward=False
    it is equal. mixed_bfloat16 alike (5.7e-3)."""
    import keras
    import tfdist

    from fsdp_jobs import data

    mixed = case.startswith("mixed")
    kwargs = {} if mixed else {case: 0.05}
    if mixed:
        keras.mixed_precision.set_global_policy(case)
    try:
        got, sharded = train(tfdist.MirroredStrategy(
            shard_parameters=True, min_shard_elements=MIN_ELEMENTS), "adam", **kwargs)
        plain, unsharded = train(tfdist.MirroredStrategy(), "adam", **kwargs)
        if mixed:
            kept, _ = train(tfdist.MirroredStrategy(
                shard_parameters=True, min_shard_elements=MIN_ELEMENTS,
                reshard_after_forward=False), "adam")
            assert_weights_close(kept, plain, atol=1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # recompute_grad's own rounding in 16 bits (see above); bfloat16 keeps fewer digits.
    tolerance = {"mixed_float16": 5e-3, "mixed_bfloat16": 1e-2}.get(case, 1e-5)
    assert_weights_close(got, plain, atol=tolerance)
    if not mixed:  # clipping acted: the unclipped run differs
        unclipped, _ = train(None, "adam")
        assert max(float(np.abs(a - b).max()) for a, b in zip(got, unclipped)) > 1e-3
    x, y = data()
    assert sharded.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(
        unsharded.evaluate(x, y, batch_size=16, verbose=0), abs=tolerance)
    np.testing.assert_allclose(sharded.predict(x, batch_size=16, verbose=0),
                               unsharded.predict(x, batch_size=16, verbose=0),
                               atol=max(2 * tolerance, 1e-4))  # outputs in 16 bits


def test_reshard_after_forward_gathers_again_for_the_backward_pass(logical_cpus):
    """True: each Dense kernel is all-gathered twice a step (forward, and its layer run
    again in the backward pass); False: once, kept. Both equal one device."""
    import keras
    import tfdist
    from tfdist._hooks.fsdp import shard_of, tf_value

    x = np.random.default_rng(0).normal(size=(32, 12)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")

    def run(strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy else __import__("contextlib").nullcontext():
            built = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, "tanh"),
                                      keras.layers.Dense(4)])
            built.compile(keras.optimizers.Adam(0.01), "mse")
        built.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 2 steps
        return built

    ref = run(None).get_weights()
    counted = {}
    for reshard in (True, False):
        strategy = tfdist.MirroredStrategy(shard_parameters=True, min_shard_elements=50,
                                           reshard_after_forward=reshard)
        built = run(strategy)
        assert_weights_close(built.get_weights(), ref, atol=1e-5)
        counted[reshard] = strategy.bytes_communicated
        slices = [tf_value(v).values[0].shape[0] for v in built.trainable_weights
                  if shard_of(v) is not None]
    assert len(slices) == 2  # the two kernels; the biases stay whole
    # One more gather of every kernel slice per step (float32), in each of 2 steps.
    assert counted[True] - counted[False] == 2 * 4 * sum(slices)


def test_backup_and_restore_resumes_sharded_training(logical_cpus, tmp_path):
    """Keras' BackupAndRestore: 1 epoch backed up, a new sharded model resumes it for
    the 2nd epoch, equal to 2 uninterrupted epochs on one device."""
    import keras
    import tfdist

    from fsdp_jobs import GLOBAL_BATCH, data, make_optimizer

    x, y = data()

    def fit(epochs, seed):
        strategy = tfdist.MirroredStrategy(shard_parameters=True,
                                           min_shard_elements=MIN_ELEMENTS)
        with strategy.scope():
            built = model(seed=seed)
            built.compile(make_optimizer("adam"),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"),
                                                  delete_checkpoint=False)
        built.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[backup])
        return [np.asarray(w) for w in built.get_weights()]

    fit(1, seed=1)
    resumed = fit(2, seed=7)  # other initial weights: all restored from the backup
    ref, _ = train(None, "adam", epochs=2)
    assert_weights_close(resumed, ref, atol=1e-5)


def test_accumulate_steps_equals_the_unsharded_accumulation(logical_cpus):
    """accumulate_steps=2 on half batches: the sharded slices' sums (reduce-scattered at
    every micro-batch) and the whole variables' (all-reduced once) equal the unsharded
    accumulation; a norm clip is refused with it."""
    import tfdist

    from fsdp_jobs import GLOBAL_BATCH

    def run(**options):
        strategy = tfdist.MirroredStrategy(accumulate_steps=2, **options)
        return train(strategy, "adam", batch_size=GLOBAL_BATCH // 2)[0]

    got = run(shard_parameters=True, min_shard_elements=MIN_ELEMENTS)
    assert_weights_close(got, run(), atol=1e-5)
    strategy = tfdist.MirroredStrategy(accumulate_steps=2, shard_parameters=True,
                                       min_shard_elements=MIN_ELEMENTS)
    with pytest.raises(ValueError, match="does not clip by norm yet. Received: clipnorm=0.1"):
        train(strategy, "adam", batch_size=GLOBAL_BATCH // 2, clipnorm=0.1)


@pytest.mark.parametrize("options", [
    {"shard_parameters": True, "min_shard_elements": 4},
    {"layout_map": {"table/embeddings": ("model", None)}},
    {"shard_optimizer_state": True},
    {},
], ids=["fully-sharded", "vocab-parallel", "zero", "mirrored"])
def test_global_clipnorm_with_duplicate_ids_equals_one_device(logical_cpus, options):
    """An Embedding looking up the same ids several times in a batch: Keras' clipping on
    one device squares its ``IndexedSlices`` gradient occurrence by occurrence (each
    looked-up row, before the duplicates are summed), so every strategy does the same.
    The dense gradient's norm is smaller here and would clip less (8e-4 off)."""
    import contextlib

    import keras
    import tensorflow as tf

    import tfdist

    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, size=(32, 3)).astype("int32")  # 3 ids of 10: duplicates
    y = rng.normal(size=(32, 2)).astype("float32")

    def build():
        ids = keras.Input((3,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(10, 4, name="table")(ids))
        return keras.Model(ids, keras.layers.Dense(2, name="head")(h))

    def fit(strategy, clip=0.05):
        keras.utils.set_random_seed(1)
        initial = build().get_weights()
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = build()
            for variable, value in zip(model.weights, initial):
                variable.assign(value)
            model.compile(keras.optimizers.SGD(0.1, global_clipnorm=clip), "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return [np.asarray(w) for w in model.get_weights()]

    keras.utils.set_random_seed(1)
    model = build()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:8], model(x[:8]))
    table = tape.gradient(loss, model.trainable_variables)[0]
    assert isinstance(table, tf.IndexedSlices)
    occurrences = float(tf.reduce_sum(tf.square(table.values)))
    dense = float(tf.reduce_sum(tf.square(tf.convert_to_tensor(table))))
    assert occurrences > 1.1 * dense  # the duplicates make the two norms differ

    make = (tfdist.ModelParallelStrategy if "layout_map" in options
            else tfdist.MirroredStrategy)
    ref = fit(None)
    assert_weights_close(fit(make(**options)), ref, atol=1e-5)
    unclipped = fit(None, clip=None)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ref, unclipped)) > 1e-3  # it bit
