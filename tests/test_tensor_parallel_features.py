"""What tensor parallelism keeps doing (issue #34, "everything else keeps working"):
clipping by norm over whole variables, attention masks with heads split, restarts
(``tfdist launch --max-restarts``) and several hosts, each compared with one device
holding the same initial weights and seeing the same global batch (atol 1e-5)."""

import contextlib
import os
import signal

import numpy as np
import pytest

from helpers import assert_weights_close, kill_worker_1

from test_multi_node import hosts  # noqa: F401 (the fixture: two network namespaces)
from tp_jobs import BATCH, PAIR, data, pair


def _fit(strategy, build, optimizer, x, y, epochs=2, loss="mse", callbacks=None):
    """Trains ``build()`` from weights seeded 1; returns its weights."""
    import keras

    keras.utils.set_random_seed(1)
    initial = build().get_weights()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        for variable, value in zip(model.weights, initial):
            variable.assign(value)  # a split variable takes its slice
        model.compile(optimizer(), loss)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    _fit.model = model  # the last one trained
    return [np.asarray(w) for w in model.get_weights()]


def _first_gradients(build, x, y):
    """One device: ``{path: gradient}`` of the first global batch at the initial weights."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    model = build()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:BATCH], model(x[:BATCH]))
    grads = tape.gradient(loss, model.trainable_variables)
    return {v.path: np.asarray(g) for v, g in zip(model.trainable_variables, grads)}


@pytest.mark.parametrize("clip, policy", [("global_clipnorm", "float32"),
                                          ("clipnorm", "float32"),
                                          ("global_clipnorm", "mixed_float16")])
def test_clipping_by_norm_sees_whole_variables(logical_cpus, clip, policy):
    """SGD (Adam would undo most of a global scale): the split gradients' norms are
    those of whole variables, as on one device; a replica's slice alone is smaller.
    Under mixed_float16 the loss-scale optimizer's inner one clips, unscaled."""
    import keras

    import tfdist

    x, y = data()
    grads = _first_gradients(pair, x, y)
    whole = float(np.sqrt(sum(np.sum(g ** 2) for g in grads.values())))
    if clip == "global_clipnorm":
        limit = whole / 4
        assert whole > limit
    else:
        limit = 0.3
        # The split kernels' whole norms bite; each replica's half alone would give
        # another factor (the up kernel's halves, the down kernel's rows).
        for path, axis in (("up/kernel", 1), ("down/kernel", 0)):
            halves = np.split(grads[path], 2, axis=axis)
            assert np.linalg.norm(grads[path]) > limit
            assert all(np.linalg.norm(h) < np.linalg.norm(grads[path]) for h in halves)

    def optimizer():
        return keras.optimizers.SGD(0.1, **{clip: limit})

    keras.mixed_precision.set_global_policy(policy)
    try:
        strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
        got = _fit(strategy, pair, optimizer, x, y)
        assert isinstance(_fit.model.optimizer, keras.optimizers.LossScaleOptimizer) == (
            policy == "mixed_float16")
        ref = _fit(None, pair, optimizer, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    unclipped = _fit(None, pair, lambda: keras.optimizers.SGD(0.1), x, y)
    assert_weights_close(got, ref, atol=1e-5 if policy == "float32" else 1e-4)
    assert max(np.max(np.abs(a - b)) for a, b in zip(ref, unclipped)) > 1e-3  # it bit


SEQ, DIM, VOCAB = 4, 8, 6
HEADS = {"mha/(query|key|value)/kernel": (None, "model", None),
         "mha/attention_output/kernel": ("model", None, None)}


def _masked_attention(case):
    """Token ids (0: padding) embedded with ``mask_zero``: Keras' implicit masks reach
    the attention (query and value) and, through its output's mask, a mask-aware
    pooling. ``"explicit"`` adds a per-row ``attention_mask`` input, a cross-attention
    (another masked value) and the attention scores (every head) into the output."""
    import keras

    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, mask_zero=True, name="table")(ids)
    mha = keras.layers.MultiHeadAttention(num_heads=4, key_dim=3, name="mha")
    if case == "implicit":
        out = mha(h, h)
        inputs, extra = ids, []
    else:
        other = keras.Input((SEQ,), dtype="int32")
        allowed = keras.Input((SEQ, SEQ))
        v = keras.layers.Embedding(VOCAB, DIM, mask_zero=True, name="other")(other)
        out, scores = mha(h, v, attention_mask=allowed, return_attention_scores=True)
        inputs = [ids, other, allowed]
        extra = [keras.layers.Flatten(name="scores")(scores)]
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(out)  # uses out's mask
    if extra:
        pooled = keras.layers.Concatenate(name="join")([pooled, *extra])
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(pooled))


def _masked_data(case, n=32):
    rng = np.random.default_rng(4)
    ids = rng.integers(1, VOCAB, size=(n, SEQ)).astype("int32")
    ids[:, -1] = 0  # padding at the end of every row, more in some
    ids[::3, -2] = 0
    y = rng.normal(size=(n, 2)).astype("float32")
    if case == "implicit":
        return ids, y
    other = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")
    other[:, 0] = 1  # every query row attends to one position at least
    allowed = (rng.random((n, SEQ, SEQ)) < 0.6).astype("float32")
    allowed[:, :, 0] = 1
    return (ids, other, allowed), y


@pytest.mark.parametrize("case", ["implicit", "explicit"])
def test_attention_split_by_heads_takes_masks(logical_cpus, case):
    """Masks are per batch row: gathered with the rows; scores come back whole."""
    import keras

    import tfdist
    from tfdist._hooks.tensor_parallel import split_of

    x, y = _masked_data(case)
    build = lambda: _masked_attention(case)  # noqa: E731

    def optimizer():  # SGD: see tp_jobs.train on the key bias under Adam
        return keras.optimizers.SGD(0.1)

    strategy = tfdist.ModelParallelStrategy(layout_map=HEADS)
    got = _fit(strategy, build, optimizer, x, y)
    split = sorted(v.path for v in _fit.model.weights if split_of(v) is not None)
    assert [p for p in split if p.endswith("kernel")] == [
        "mha/attention_output/kernel", "mha/key/kernel", "mha/query/kernel",
        "mha/value/kernel"]
    ref = _fit(None, build, optimizer, x, y)
    assert_weights_close(got, ref, atol=1e-5)
    # The masks bite: the same model trained unmasked ends elsewhere.
    unmasked = _fit(None, build, optimizer, _unmasked(x), y)
    assert max(np.max(np.abs(a - b)) for a, b in zip(ref, unmasked)) > 1e-3


def _unmasked(x):
    """Inputs with no padding and every position allowed."""
    if isinstance(x, tuple):
        ids, other, allowed = x
        return np.where(ids == 0, 1, ids), np.where(other == 0, 1, other), np.ones_like(allowed)
    return np.where(x == 0, 1, x)


def test_mixed_bfloat16_matches_one_device(logical_cpus):
    """bfloat16 activations (no loss scaling): the gathered rows, partial sums and their
    gradients travel as bfloat16 (2 bytes), the replicated bias gradient as float32."""
    import keras

    import tfdist
    from tp_jobs import FEATURES, OUTPUTS
    from tp_jobs import train as train_pair

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        strategy = tfdist.ModelParallelStrategy(layout_map=PAIR)
        got, trained = train_pair(strategy, pair, epochs=1)
        ref, _ = train_pair(None, pair, epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert trained.get_layer("up").compute_dtype == "bfloat16"
    assert_weights_close(got, ref, atol=1e-3)  # bfloat16 keeps 8 significant bits
    rows = BATCH // 2
    per_step = 2 * (rows * FEATURES + BATCH * OUTPUTS + rows * OUTPUTS) + 4 * OUTPUTS
    assert strategy.bytes_communicated == per_step * (32 // BATCH)


# ---- restarts: code run inside the launched tasks ------------------------------------------


def _restarted_task(engine="tf", model_parallel=None, fault=signal.SIGKILL, then=None):
    """On each worker: the pair split across them (or over a data x model mesh of
    ``model_parallel``), trained 3 epochs with a backup; worker-1 killed (or sent
    ``fault``) in epoch 1 of the first start. Returns what it ran and ended with, and
    ``then(strategy)`` as ``"then"`` (None: nothing more is run)."""
    import keras

    import tfdist
    from tfdist import env
    from tfdist._hooks.tensor_parallel import split_of, tf_value
    from tfdist.keras import callbacks as cbs

    strategy = tfdist.MultiWorkerModelParallelStrategy(
        layout_map=PAIR, engine=engine, model_parallel=model_parallel, startup_timeout=60,
        collective_timeout=120)
    restart = int(os.environ[env.RESTART])
    epochs_run = []

    def adam(clip=0.5):  # clipped by the whole model's norm, summed across the workers
        return keras.optimizers.Adam(0.01, global_clipnorm=clip)

    x, y = data()
    weights = _fit(strategy, pair, adam, x, y, epochs=3,
                   callbacks=[cbs.BackupAndRestore(), kill_worker_1(epochs_run, fault)])
    model = _fit.model
    split = [v for v in list(model.weights) + list(model.optimizer.variables)
             if split_of(v) is not None]
    out = {"restart": restart, "epochs_run": epochs_run, "weights": weights,
           "engine": strategy.engine, "bytes": strategy.bytes_communicated,
           "held": sum(int(np.prod(tf_value(v).values[0].shape)) for v in split),
           "whole": sum(int(np.prod(split_of(v).full_shape)) for v in split)}
    if then is not None:
        out["then"] = then(strategy)
    if strategy.is_chief:
        out["reference"] = _fit(None, pair, adam, x, y, epochs=3)
        out["unclipped"] = _fit(None, pair, lambda: adam(None), x, y, epochs=3)
        if then is not None:
            out["then_reference"] = then(None)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_restarted_job_resumes_split_variables(tmp_path):
    """``tfdist launch --max-restarts 1`` of 2 workers splitting the pair: worker-1 dies
    mid-epoch, the job restarts, both resume the split weights and Adam slots from the
    chief's BackupAndRestore backup and end equal to the uninterrupted run (which clips
    by global norm: the split gradients' squares summed across the processes)."""
    from helpers import run_cluster

    chief, other = run_cluster(_restarted_task, timeout=280, max_restarts=1,
                               backup_dir=str(tmp_path / "backup"))
    assert chief["restart"] == other["restart"] == 1
    assert chief["epochs_run"] == other["epochs_run"] == [1, 2]  # resumed at epoch 1
    assert_weights_close(chief["weights"], other["weights"], atol=0)
    assert_weights_close(chief["weights"], chief["reference"], atol=1e-5)
    assert max(np.max(np.abs(a - b)) for a, b in zip(chief["reference"],
                                                      chief["unclipped"])) > 1e-3
    for result in (chief, other):  # weights and slots split again after the restart
        assert result["held"] * 2 == result["whole"] > 0


# ---- several hosts -------------------------------------------------------------------------

_TWO_HOSTS = """
    import os, sys
    import numpy as np
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of, tf_value
    from tp_jobs import PAIR, pair, train

    strategy = tfdist.MultiWorkerModelParallelStrategy(
        layout_map=PAIR, engine="tf", startup_timeout=90, collective_timeout=120)
    out, me = sys.argv[1], os.environ["TFDIST_TASK"]
    weights, model = train(strategy, pair)
    split = [v for v in model.weights if split_of(v) is not None]
    held = sum(int(np.prod(tf_value(v).values[0].shape)) for v in split)
    whole = sum(int(np.prod(split_of(v).full_shape)) for v in split)
    np.savez(os.path.join(out, me + ".npz"), *weights, np.array([held, whole]))
    if me == "worker-0":
        np.savez(os.path.join(out, "reference.npz"), *train(None, pair)[0])
"""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hosts_split_the_model_axis(hosts, tmp_path):
    """One launch over two network namespaces (tests/test_multi_node.py's hosts): the
    "model" axis crosses the hosts (engine "tf": TF's collective all-gather and
    reduce-scatter over gRPC), each worker holding half of the split elements, and the
    pair ends equal to one process."""
    from test_multi_node import _load, run_two_nodes

    run_two_nodes(hosts, tmp_path, _TWO_HOSTS, port_offset=7)  # apart from its ports
    reference = _load(tmp_path / "reference.npz")
    for task in ("worker-0", "worker-1"):
        *weights, (held, whole) = _load(tmp_path / f"{task}.npz")
        assert held * 2 == whole > 0
        assert_weights_close(weights, reference, atol=1e-5)
