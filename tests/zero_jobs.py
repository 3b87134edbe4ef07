"""Training runs shared by the sharded-optimizer-state tests (in process and launched)."""

import numpy as np

from helpers import classification_data, mlp

GLOBAL_BATCH = 16
OPTIMIZERS = ("adam", "adamw", "sgd")


def make_optimizer(name, **kwargs):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(0.01, **kwargs)
    if name == "adamw":
        opt = keras.optimizers.AdamW(0.01, weight_decay=0.1, **kwargs)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt
    if name == "sgd":
        return keras.optimizers.SGD(0.1, momentum=0.9, **kwargs)
    if name == "rmsprop":
        return keras.optimizers.RMSprop(0.01, **kwargs)
    if name == "adagrad":
        return keras.optimizers.Adagrad(0.1, **kwargs)
    if name == "lion":
        return keras.optimizers.Lion(0.001, **kwargs)
    if name in UNSHARDABLE:
        return getattr(keras.optimizers, UNSHARDABLE[name])(0.01)
    raise ValueError(name)


# Optimizers that need whole tensors (layer-wise trust ratios, orthogonalised updates,
# factored second moments): refused by shard_optimizer_state=True.
UNSHARDABLE = {"lamb": "Lamb", "muon": "Muon", "adafactor": "Adafactor"}


def compiled(strategy, build, optimizer="adam", build_optimizer=False, **opt_kwargs):
    """``build()`` compiled with `make_optimizer` and cross-entropy on logits, in
    ``strategy``'s scope unless None; its optimizer built (its slots, to load) if asked."""
    import contextlib

    import keras

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        model.compile(make_optimizer(optimizer, **opt_kwargs),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if build_optimizer:
            model.optimizer.build(model.trainable_variables)
    return model


def fitted(model, x, y, epochs=1, batch_size=GLOBAL_BATCH, load=None):
    """``model`` (after loading the weights file ``load``, if given) fit in order; its
    weights."""
    if load is not None:
        model.load_weights(load)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def compile_and_fit(strategy, build, x, y, optimizer="adam", epochs=2,
                    batch_size=GLOBAL_BATCH, **opt_kwargs):
    """`compiled`, then `fitted`; returns ``(weights, model)``."""
    model = compiled(strategy, build, optimizer, **opt_kwargs)
    return fitted(model, x, y, epochs, batch_size), model


def train(strategy, optimizer, epochs=2, n=64, policy=None, batch_size=GLOBAL_BATCH,
          **opt_kwargs):
    """Trains the small MLP; returns ``(weights, model)``."""
    import keras

    if policy:
        keras.mixed_precision.set_global_policy(policy)
    try:
        return compile_and_fit(strategy, mlp, *classification_data(n=n), optimizer, epochs,
                               batch_size, **opt_kwargs)
    finally:
        if policy:
            keras.mixed_precision.set_global_policy("float32")


# A small Transformer text classifier: Embedding (sparse gradients), MultiHeadAttention,
# Dense on 3-D inputs (kernel gradients of unknown static shape in the traced step) and
# LayerNormalization. 16 steps of batch 32 in 2 epochs.
VOCAB, SEQ, TEXTS = 50, 12, 256


def text_data(n=TEXTS):
    rng = np.random.default_rng(3)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype("int32")
    return x, (x[:, 0] % 2).astype("int32")


def transformer(seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    h = keras.layers.LayerNormalization()(
        h + keras.layers.Dense(8)(keras.layers.Dense(16, activation="relu")(h)))
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, out)


def train_transformer(strategy, epochs=2, batch_size=32):
    """Trains `transformer` with Adam on `text_data`; its weights."""
    return compile_and_fit(strategy, transformer, *text_data(), "adam", epochs, batch_size)[0]


def slot_elements(strategy, model):
    """Per local replica, the slot elements its sharded optimizer holds."""
    return strategy.sharded_optimizer_state(model.optimizer).slot_elements()


def full_slot_elements(model):
    """Slot elements of an unsharded optimizer of the same kind on the model."""
    from tfdist.keras.optimizer import inner_optimizer

    return sum(int(np.prod(v.shape)) for v in model.trainable_variables) * {
        "Adam": 2, "AdamW": 2, "SGD": 1, "RMSprop": 1, "Adagrad": 1,
        "Lion": 1}[type(inner_optimizer(model.optimizer)).__name__]


def launched_task(engine):
    """One worker of a 2-worker job: each optimizer sharded and unsharded, the
    Transformer block with Adam sharded and unsharded, and (on the chief) the
    single-process references; returns arrays only."""
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine, shard_optimizer_state=True)
    out = {"chief": strategy.is_chief, "replicas": strategy.num_replicas_in_sync}
    for name in OPTIMIZERS:
        strategy.shard_optimizer_state = True
        weights, model = train(strategy, name)
        counts = slot_elements(strategy, model)
        strategy.shard_optimizer_state = False
        plain, _ = train(strategy, name)
        out[name] = {"sharded": weights, "plain": plain, "slots": counts,
                     "full_slots": full_slot_elements(model)}
    # mixed_float16: the loss scale's finite-gradient decision is taken on every worker
    # from the reduced gradient, so sharded and unsharded runs agree.
    runs = []
    for sharded in (True, False):
        strategy.shard_optimizer_state = sharded
        runs.append(train(strategy, "adamw", policy="mixed_float16")[0])
    out["mixed_float16"] = {"sharded": runs[0], "plain": runs[1]}
    runs = []
    for sharded in (True, False):
        strategy.shard_optimizer_state = sharded
        runs.append(train_transformer(strategy))
    out["transformer"] = {"sharded": runs[0], "plain": runs[1]}
    if strategy.is_chief:
        out["reference"] = {name: train(None, name)[0] for name in OPTIMIZERS}
        out["reference"]["transformer"] = train_transformer(None)
    return out


def save_and_resume(strategy_factory, path, optimizer="adam", resume=True, n=64,
                    batch_size=GLOBAL_BATCH):
    """Trains 1 epoch and saves weights; with ``resume``, a new model loads the file
    and trains 1 more epoch. Returns the weights after the resume, or None."""
    strategy = strategy_factory()
    model = _compiled(strategy, optimizer)
    x, y = classification_data(n=n)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    model.save_weights(path)
    return resume_from(strategy, path, optimizer, n, batch_size) if resume else None


def _compiled(strategy, optimizer, seed=1):
    return compiled(strategy, lambda: mlp(seed=seed), optimizer)


def resume_from(strategy, path, optimizer="adam", n=64, batch_size=GLOBAL_BATCH):
    """A new model loads ``path`` and trains 1 more epoch; its weights."""
    return fitted(_compiled(strategy, optimizer, seed=7), *classification_data(n=n),
                  batch_size=batch_size, load=path)


# Batches that split over 1, 2 and 3 workers.
RESUME_N, RESUME_BATCH = 48, 12


def save_job(directory, engine):
    """2 workers: 1 epoch sharded and 1 unsharded, each saved (rank 0's files are read)."""
    import os

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine, shard_optimizer_state=True)
    mine = os.path.join(directory, f"{{}}-{strategy.rank}.weights.h5")
    for name in ("adam", "sgd"):
        strategy.shard_optimizer_state = True
        save_and_resume(lambda: strategy, mine.format(f"sharded-{name}"), name,
                        resume=False, n=RESUME_N, batch_size=RESUME_BATCH)
        strategy.shard_optimizer_state = False
        save_and_resume(lambda: strategy, mine.format(f"plain-{name}"), name,
                        resume=False, n=RESUME_N, batch_size=RESUME_BATCH)
    return strategy.rank


def resume_job(path, engine):
    """Any number of workers: resume the 2-worker Adam file, sharded; the weights."""
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(engine=engine, shard_optimizer_state=True)
    return resume_from(strategy, path, "adam", RESUME_N, RESUME_BATCH)


def read_saved(path, optimizer="adam"):
    """The weights and optimizer variables a plain process reads from ``path``."""
    import keras

    model = mlp(seed=9)
    model.compile(make_optimizer(optimizer),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return ([np.asarray(w) for w in model.get_weights()],
            [np.asarray(v) for v in model.optimizer.variables])


def h5_names(path):
    """``{name: shape}`` of every group (shape None) and dataset in a ``.weights.h5``
    file, or in the weights of a ``.keras`` file."""
    import io
    import zipfile

    import h5py

    names = {}

    def visit(name, item):
        names[name] = getattr(item, "shape", None)

    if path.endswith(".keras"):
        with zipfile.ZipFile(path) as archive:
            data = io.BytesIO(archive.read("model.weights.h5"))
        with h5py.File(data, "r") as file:
            file.visititems(visit)
    else:
        with h5py.File(path, "r") as file:
            file.visititems(visit)
    return names
