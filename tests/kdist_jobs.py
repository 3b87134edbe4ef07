"""One backend-agnostic Keras 3 script under ``keras.distribution``, shared by the in-process
and the launched tests of tests/test_keras_distribution.py.

The script has no tfdist line: ``import tfdist`` (done by the test process and by every
``tfdist launch`` task) is all that makes it distributed.
"""

import contextlib

import numpy as np

from helpers import classification_data, layout_map, mlp

GLOBAL_BATCH = 16
EPOCHS = 2


def dataset(n=64):
    """The global dataset (tf.data, batches of GLOBAL_BATCH, a fixed order)."""
    import tensorflow as tf

    x, y = classification_data(n=n)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def worker_part(process, processes, n=64):
    """This worker's own part of `dataset` (``auto_shard_dataset=False``): its slice of
    every global batch, batched, so that the parts of batch k make global batch k."""
    import tensorflow as tf

    x, y = classification_data(n=n)
    part = GLOBAL_BATCH // processes
    rows = np.concatenate([np.arange(start + process * part, start + (process + 1) * part)
                           for start in range(0, n, GLOBAL_BATCH)])
    return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(part)


def batch_axis_model_parallel():
    """``ModelParallel`` whose LayoutMap lays every kernel out on the batch axis (fully
    sharded kernels; biases replicated), over every device."""
    import keras

    return keras.distribution.ModelParallel(
        layout_map=layout_map([(".*kernel", ("batch", None))]))


def keras_script(how="set", presharded=False, kind="data"):
    """Trains the small MLP with Adam on `dataset` under ``DataParallel()``.

    Args:
        how: ``"set"`` (``set_distribution``), ``"scope"`` (``with d.scope():``) or
            ``"none"`` (no distribution: the single-device reference).
        presharded: Each worker passes its own part (`worker_part`) with
            ``auto_shard_dataset=False`` instead of the global dataset.
        kind: ``"data"`` (``DataParallel()``) or ``"model"`` (`batch_axis_model_parallel`).

    Returns:
        ``{"devices", "count", "processes", "process", "replicas", "weights", "loss",
        "predictions"}``.
    """
    import keras

    distribution = None
    if how != "none":
        distribution = (keras.distribution.DataParallel() if kind == "data"
                        else batch_axis_model_parallel())
    data = dataset
    if presharded:
        distribution.auto_shard_dataset = False
        data = lambda: worker_part(distribution.data_shard_id, distribution.num_processes)
    if how == "set":
        keras.distribution.set_distribution(distribution)
    scope = distribution.scope() if how == "scope" else contextlib.nullcontext()
    try:
        with scope:
            model = mlp()
            model.compile(keras.optimizers.Adam(0.01),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            replicas = model.distribute_strategy.num_replicas_in_sync
            sharded = _sharded_paths(model) if kind == "model" else None
            model.fit(data(), epochs=EPOCHS, verbose=0)
            loss = model.evaluate(data(), verbose=0)
            predictions = model.predict(data(), verbose=0)
    finally:
        if how == "set":
            keras.distribution.set_distribution(None)
    return {"devices": keras.distribution.list_devices(),
            "count": keras.distribution.get_device_count(),
            "processes": distribution.num_processes if distribution else 1,
            "process": distribution.data_shard_id if distribution else 0,
            "replicas": replicas, "loss": float(loss), "predictions": predictions,
            "sharded": sharded,
            "weights": [np.asarray(w) for w in model.get_weights()]}


def _sharded_paths(model):
    """Paths of the model's variables stored 1/N per replica (fully sharded parameters,
    `shard_parameters=True`)."""
    from tfdist._hooks.fsdp import shard_of

    return sorted(v.path for v in model.weights if shard_of(v) is not None)


def launched_task():
    """In each task of the 2-worker launch: initialize() from TF_CONFIG, then the script
    on the global dataset, then on each worker's own part (one strategy serves both)."""
    import keras

    keras.distribution.initialize()
    return {"global": keras_script("set"), "parts": keras_script("set", presharded=True)}


def launched_model_parallel_task():
    """In each task of a 2-worker launch: the script under `batch_axis_model_parallel`."""
    return keras_script("set", kind="model")
