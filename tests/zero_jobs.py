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
    if name == "lamb":
        return keras.optimizers.Lamb(0.01)
    raise ValueError(name)


def train(strategy, optimizer, epochs=2, n=64, policy=None, batch_size=GLOBAL_BATCH,
          **opt_kwargs):
    """Trains the small MLP; returns ``(weights, optimizer)``."""
    import contextlib

    import keras

    if policy:
        keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = classification_data(n=n)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = mlp()
            model.compile(make_optimizer(optimizer, **opt_kwargs),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        return [np.asarray(w) for w in model.get_weights()], model
    finally:
        if policy:
            keras.mixed_precision.set_global_policy("float32")


def slot_elements(strategy, model):
    """Per local replica, the slot elements its sharded optimizer holds."""
    return strategy.sharded_optimizer_state(model.optimizer).slot_elements()


def full_slot_elements(model):
    """Slot elements of an unsharded optimizer of the same kind on the model."""
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables) * {
        "Adam": 2, "AdamW": 2, "SGD": 1}[type(model.optimizer).__name__]


def launched_task(engine):
    """One worker of a 2-worker job: each optimizer sharded and unsharded, and (on the
    chief) the single-process reference; returns arrays only."""
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
    if strategy.is_chief:
        out["reference"] = {name: train(None, name)[0] for name in OPTIMIZERS}
    return out


def save_and_resume(strategy_factory, path, optimizer="adam", resume=True):
    """Trains 1 epoch and saves weights; with ``resume``, a new model loads the file
    and trains 1 more epoch. Returns ``(weights after resume or None, saved optimizer
    arrays read back in a plain model)``."""
    import keras

    x, y = classification_data(n=64)
    strategy = strategy_factory()
    with strategy.scope():
        model = mlp()
        model.compile(make_optimizer(optimizer),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    model.save_weights(path)
    resumed = None
    if resume:
        with strategy.scope():
            again = mlp(seed=7)
            again.compile(make_optimizer(optimizer),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        again.load_weights(path)
        again.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        resumed = [np.asarray(w) for w in again.get_weights()]
    return resumed


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
