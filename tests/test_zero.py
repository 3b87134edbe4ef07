"""shard_optimizer_state=True (ZeRO-2) under MirroredStrategy on 2 logical CPUs and on 2
workers under tfdist launch (both engines): the same weights as the unsharded run and
one device, half the slots per replica.

Clipping: sharded, unsharded and one device agree; tfdist clips the reduced gradient
(stock Keras 3 clips each replica's gradient before its all-reduce)."""

import pytest

from helpers import assert_weights_close
from zero_jobs import UNSHARDABLE, full_slot_elements, slot_elements, train


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd", "rmsprop", "adagrad",
                                       "lion"])
def test_sharded_matches_unsharded_and_one_device(logical_cpus, optimizer, monkeypatch):
    import tfdist
    from tfdist.strategies.zero import sharded_state as _zero

    monkeypatch.setattr(_zero, "BUCKET_BYTES", 256)  # several buckets, split variables
    strategy = tfdist.MirroredStrategy(shard_optimizer_state=True)
    got, model = train(strategy, optimizer)
    plain, _ = train(tfdist.MirroredStrategy(), optimizer)
    ref, _ = train(None, optimizer)
    assert_weights_close(got, plain)
    assert_weights_close(got, ref)
    counts = slot_elements(strategy, model)
    full = full_slot_elements(model)
    assert len(counts) == 2
    for count in counts:  # half, plus at most one padding element per bucket and slot
        assert full / 2 <= count <= full / 2 + 2 * len(
            strategy.sharded_optimizer_state(model.optimizer).buckets)
    # The wrapper's only non-scalar variables are the slices; the user's optimizer has none.
    assert [id(v) for v in model.optimizer.variables if len(v.shape)] == [
        id(v) for v in model.optimizer.sharded_variables()]
    assert all(len(v.shape) == 0 for v in model.optimizer.inner_optimizer.variables)


@pytest.mark.parametrize("optimizer", sorted(UNSHARDABLE))
def test_unshardable_optimizer_is_refused_before_training(logical_cpus, optimizer):
    import tfdist

    strategy = tfdist.MirroredStrategy(shard_optimizer_state=True)
    name = UNSHARDABLE[optimizer]
    with pytest.raises(ValueError, match=f"Received: optimizer={name}$"):
        train(strategy, optimizer)


def test_shard_optimizer_state_must_be_a_bool():
    import tfdist

    with pytest.raises(ValueError, match="shard_optimizer_state=1"):
        tfdist.MirroredStrategy(shard_optimizer_state=1)


def test_a_sharded_save_needs_every_worker(logical_cpus):
    """`tfdist train` (train/task.py) asks this: every worker then joins the save."""
    import tfdist

    assert tfdist.MirroredStrategy(shard_optimizer_state=True).save_needs_every_worker
    assert not tfdist.MirroredStrategy().save_needs_every_worker


def _check_launched(results):
    chief, other = results
    assert chief["chief"] and not other["chief"] and chief["replicas"] == 2
    for name in ("adam", "adamw", "sgd"):
        mine, theirs = chief[name], other[name]
        assert_weights_close(mine["sharded"], theirs["sharded"], atol=0)
        assert_weights_close(mine["sharded"], mine["plain"])
        assert_weights_close(mine["sharded"], chief["reference"][name])
        for result in (mine, theirs):
            (count,) = result["slots"]
            assert result["full_slots"] / 2 <= count <= result["full_slots"] / 2 + 2
    for result in (chief, other):
        assert_weights_close(result["mixed_float16"]["sharded"],
                             result["mixed_float16"]["plain"])
    assert_weights_close(chief["mixed_float16"]["sharded"], other["mixed_float16"]["sharded"],
                         atol=0)
    # A Transformer block (3-D Dense inputs, Embedding, MultiHeadAttention,
    # LayerNormalization) with Adam: sharded = unsharded = one device.
    mine, theirs = chief["transformer"], other["transformer"]
    assert_weights_close(mine["sharded"], theirs["sharded"], atol=0)
    assert_weights_close(mine["plain"], chief["reference"]["transformer"])
    assert_weights_close(mine["sharded"], mine["plain"])
    assert_weights_close(mine["sharded"], chief["reference"]["transformer"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_tf_engine():
    from helpers import run_cluster
    from zero_jobs import launched_task

    _check_launched(run_cluster(launched_task, "tf", timeout=280))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_horovod_engine():
    from helpers import require_horovod, run_cluster
    from zero_jobs import launched_task

    require_horovod()
    _check_launched(run_cluster(launched_task, "horovod", timeout=280))


@pytest.mark.parametrize("case", ["accumulate", "global_clipnorm", "clipnorm",
                                  "clipvalue", "mixed_float16"])
def test_sharded_matches_unsharded_with(logical_cpus, case):
    import tfdist

    from zero_jobs import GLOBAL_BATCH

    options, kwargs = {}, {}
    if case == "accumulate":
        options = {"accumulate_steps": 2}
        kwargs = {"batch_size": GLOBAL_BATCH // 2}
    elif case in ("global_clipnorm", "clipnorm"):
        kwargs = {case: 0.05}
    elif case == "clipvalue":
        kwargs = {case: 0.01}
    else:
        kwargs = {"policy": "mixed_float16"}
    for optimizer in ("adamw", "sgd"):
        got, _ = train(tfdist.MirroredStrategy(shard_optimizer_state=True, **options),
                       optimizer, **kwargs)
        if case == "mixed_float16":
            plain, _ = train(tfdist.MirroredStrategy(**options), optimizer, **kwargs)
            assert_weights_close(got, plain)
            continue
        # One device with the global batch (k=2 micro-batches of 8 = one step on 16).
        ref, _ = train(None, optimizer,
                       **{k: v for k, v in kwargs.items() if k != "batch_size"})
        assert_weights_close(got, ref)
        if case != "accumulate":  # the unsharded run also clips the reduced gradient
            plain, _ = train(tfdist.MirroredStrategy(), optimizer, **kwargs)
            assert_weights_close(plain, ref)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_saved_state_is_whole_and_resumes(logical_cpus, tmp_path, optimizer):
    import tfdist

    from zero_jobs import h5_names, read_saved, save_and_resume

    sharded_path, plain_path = str(tmp_path / "s.weights.h5"), str(tmp_path / "p.weights.h5")
    resumed = save_and_resume(lambda: tfdist.MirroredStrategy(shard_optimizer_state=True),
                              sharded_path, optimizer)
    save_and_resume(tfdist.MirroredStrategy, plain_path, optimizer, resume=False)
    got, want = read_saved(sharded_path, optimizer), read_saved(plain_path, optimizer)
    assert h5_names(sharded_path) == h5_names(plain_path)  # no inner_optimizer group
    assert_weights_close(got[0], want[0])
    assert len(got[1]) == len(want[1]) > 2
    assert_weights_close(got[1], want[1])
    ref, _ = train(None, optimizer, epochs=2)  # resumed: = 2 uninterrupted epochs
    assert_weights_close(resumed, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_worker_save_loads_whole_and_resumes_on_one_and_three(tmp_path):
    from helpers import run_cluster
    from zero_jobs import RESUME_BATCH, RESUME_N, read_saved, resume_job, save_job

    assert sorted(run_cluster(save_job, str(tmp_path), "tf", timeout=200)) == [0, 1]
    for name in ("adam", "sgd"):
        got = read_saved(str(tmp_path / f"sharded-{name}-0.weights.h5"), name)
        want = read_saved(str(tmp_path / f"plain-{name}-0.weights.h5"), name)
        assert_weights_close(got[0], want[0])
        assert len(got[1]) == len(want[1]) > 2
        assert_weights_close(got[1], want[1])
    ref, _ = train(None, "adam", epochs=2, n=RESUME_N, batch_size=RESUME_BATCH)
    path = str(tmp_path / "sharded-adam-0.weights.h5")
    for workers in (1, 3):
        for weights in run_cluster(resume_job, path, "tf", workers=workers, timeout=200):
            assert_weights_close(weights, ref)


def test_config_and_model_averaging():
    import tfdist
    from tfdist.strategies import registry

    for name in ("mirrored", "multi_worker"):
        assert "shard_optimizer_state" in registry.option_names(name)
    with pytest.raises(ValueError, match="Received: shard_optimizer_state=True"):
        tfdist.ModelAverageStrategy(period=2, shard_optimizer_state=True)


def test_saved_state_with_a_loss_scale(logical_cpus, tmp_path):
    import keras

    import tfdist

    from zero_jobs import h5_names, read_saved, save_and_resume

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        paths = [str(tmp_path / f"{name}.weights.h5") for name in ("s", "p")]
        save_and_resume(lambda: tfdist.MirroredStrategy(shard_optimizer_state=True),
                        paths[0], "adam", resume=False)
        save_and_resume(tfdist.MirroredStrategy, paths[1], "adam", resume=False)
        got, want = read_saved(paths[0]), read_saved(paths[1])
        assert h5_names(paths[0]) == h5_names(paths[1])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_weights_close(got[0], want[0])
    assert len(got[1]) == len(want[1]) > 4  # the loss scale's, then Adam's
    assert_weights_close(got[1], want[1])


@pytest.mark.parametrize("owner", ["keras", "tfdist"])
def test_backup_and_restore_resumes_sharded_state(logical_cpus, tmp_path, owner):
    import keras
    import numpy as np

    import tfdist
    from helpers import classification_data

    from zero_jobs import GLOBAL_BATCH, _compiled

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    x, y = classification_data(n=64)
    strategy = tfdist.MirroredStrategy(shard_optimizer_state=True)
    backup = str(tmp_path / "backup")
    backup_class = (keras if owner == "keras" else tfdist.keras).callbacks.BackupAndRestore
    first = _compiled(strategy, "adam")
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[backup_class(backup), Interrupt()])
    again = _compiled(strategy, "adam", seed=7)
    again.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[backup_class(backup)])
    ref, _ = train(None, "adam", epochs=2)
    assert_weights_close([np.asarray(w) for w in again.get_weights()], ref)


def _fit_one_epoch_with(strategy, callbacks, seed=1):
    from helpers import classification_data

    from zero_jobs import GLOBAL_BATCH, _compiled

    x, y = classification_data(n=64)
    model = _compiled(strategy, "adam", seed=seed)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)
    return model


def _read_keras_file(path):
    import keras
    import numpy as np

    model = keras.models.load_model(path)
    return ([np.asarray(w) for w in model.get_weights()],
            [np.asarray(v) for v in model.optimizer.variables])


def test_model_save_and_tfdist_model_checkpoint_write_the_whole_state(logical_cpus,
                                                                      tmp_path):
    """A `.keras` file from `model.save` and from tfdist's ModelCheckpoint, written by a
    sharded run, loads in a plain process equal to the unsharded run's file, and holds
    its groups."""
    import tfdist

    from zero_jobs import h5_names

    files = {}
    for kind, sharded in (("s", True), ("p", False)):
        checkpoint = str(tmp_path / f"{kind}-checkpoint.keras")
        model = _fit_one_epoch_with(
            tfdist.MirroredStrategy(shard_optimizer_state=sharded),
            [tfdist.keras.callbacks.ModelCheckpoint(checkpoint)])
        model.save(str(tmp_path / f"{kind}.keras"))
        files[kind] = (str(tmp_path / f"{kind}.keras"), checkpoint)
    for sharded_file, plain_file in zip(files["s"], files["p"]):
        assert h5_names(sharded_file) == h5_names(plain_file)  # no inner_optimizer group
        got, want = _read_keras_file(sharded_file), _read_keras_file(plain_file)
        assert_weights_close(got[0], want[0])
        assert len(got[1]) == len(want[1]) > 2
        assert_weights_close(got[1], want[1])


def test_transformer_block_matches_unsharded_and_one_device(logical_cpus, monkeypatch):
    """Embedding (IndexedSlices gradients: Keras' Adam squares each occurrence),
    MultiHeadAttention, Dense on 3-D inputs and LayerNormalization, with Adam."""
    import tfdist
    from tfdist.strategies.zero import sharded_state as _zero

    from zero_jobs import train_transformer

    monkeypatch.setattr(_zero, "BUCKET_BYTES", 1024)  # the table split over buckets too
    got = train_transformer(tfdist.MirroredStrategy(shard_optimizer_state=True))
    plain = train_transformer(tfdist.MirroredStrategy())
    ref = train_transformer(None)
    assert_weights_close(plain, ref)
    assert_weights_close(got, plain)
    assert_weights_close(got, ref)


def test_wrapper_owns_the_slices_and_leaves_the_users_optimizer_alone(logical_cpus):
    """shard_optimizer_state=True wraps the model's optimizer at fit: the user's
    optimizer's __dict__ keeps its keys, and the wrapper's variables hold the slices."""
    import keras

    import tfdist
    from zero_jobs import classification_data, mlp

    strategy = tfdist.MirroredStrategy(shard_optimizer_state=True)
    x, y = classification_data(n=64)
    with strategy.scope():
        model = mlp()
        users = keras.optimizers.Adam()
        model.compile(users, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = set(users.__dict__)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert set(users.__dict__) == before
    assert isinstance(model.optimizer, tfdist.keras.ShardedOptimizer)
    assert model.optimizer.inner_optimizer is users
    slices = model.optimizer.sharded_variables()
    ids = {id(v) for v in model.optimizer.variables}
    assert len(slices) == 2 * 2 * len(strategy.sharded_optimizer_state(model.optimizer).buckets)
    assert all(id(v) in ids for v in slices)  # Adam: m and v, per replica, per bucket
    assert not any(len(v.shape) for v in users.variables)  # no full-size slots
    # benchmarks/zero.py counts each variable once (it once counted the slices twice:
    # "optimizer bytes x N = 2.00"): both replicas' m and v of every padded element,
    # and 12 bytes (step, learning rate) each for the wrapper, the user's optimizer and
    # the 2 replicas' inner optimizers.
    from benchmarks.zero import optimizer_state_bytes

    padded = sum(b.slice_size * 2 for b in strategy.sharded_optimizer_state(
        model.optimizer).buckets)
    assert optimizer_state_bytes(model, strategy) == {"counters": 4 * 12,
                                                      "slots": 2 * 4 * padded}


def test_a_sharded_optimizer_without_a_sharding_strategy_is_refused(logical_cpus):
    import keras

    import tfdist
    from zero_jobs import classification_data, mlp

    x, y = classification_data(n=16)
    with tfdist.MirroredStrategy().scope():
        model = mlp()
        model.compile(tfdist.keras.ShardedOptimizer(keras.optimizers.Adam()),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="shard_optimizer_state=True .*Received: strategy="):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
