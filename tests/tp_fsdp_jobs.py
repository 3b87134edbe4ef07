"""Tensor parallelism plus fully sharded kernels (tests/test_tensor_parallel_fsdp.py):
the Megatron feed-forward pair laid out ("batch", "model") / ("model", "batch") on a
2 x 2 data x model mesh, in one process of 4 logical CPUs (`main`, run as a script):
through tfdist.ModelParallelStrategy and through Keras' ModelParallel, clipped by the
global norm, saved, and a save loaded on the mesh and trained on; and on one device with
the same initial weights and global batch. `launched` runs the pair on the 4 workers of
tests/tp_mesh_jobs.py's shared launch (tests/test_tensor_parallel_mesh.py)."""

import os
import pickle
import sys

import numpy as np

from tp_jobs import (BATCH, FEATURES, HIDDEN, OUTPUTS, data, keras_mesh_run, pair, train,
                     train_and_report)

SHARDED = {"up/kernel": ("batch", "model"), "down/kernel": ("model", "batch")}
STEPS = 2 * (32 // BATCH)  # two epochs of 32 rows
# tp_jobs.attention_block's EinsumDense kernels: by heads, and over "batch" on another axis.
SHARDED_HEADS = {"mha/(query|key|value)/kernel": ("batch", "model", None),
                 "mha/attention_output/kernel": ("model", None, "batch"), **SHARDED}


def sharded_pair_floats(d, m):
    """Per step, per replica, on a d x m mesh: the pair's model-axis collectives
    (tests/test_tensor_parallel_mesh.py's `pair_floats`: rows gathered, partial sums
    reduce-scattered, their gradient gathered, the row bias all-reduced), the up bias's
    slice all-reduced over the batch axis; each kernel's block gathered over the batch
    axis, and its slice's gradient reduce-scattered there (counted at its whole
    payload, as every reduce-scatter). With m = 1 the model axis sends nothing."""
    rows, group = BATCH // (d * m), BATCH // d
    model_axis = (rows * FEATURES + group * OUTPUTS + rows * OUTPUTS) * (m > 1)
    model_axis += OUTPUTS + HIDDEN // m
    slices = FEATURES * HIDDEN // m + HIDDEN // m * OUTPUTS
    return model_axis + slices // d + slices


def check_held(held, d, m):
    """Each replica: 1/(d*m) of each kernel and of its Adam slots, 1/m of the up bias."""
    for path, (parts, whole) in held.items():
        share = m if "bias" in path else d * m
        assert parts == [whole // share] * len(parts), path
    kernels = {path for path in held if path.endswith("kernel")}
    assert kernels == {"up/kernel", "down/kernel"}
    assert {path for path in held if "kernel_" in path} == {
        f"slot/{layer}_kernel_{slot}" for layer in ("up", "down")
        for slot in ("momentum", "velocity")}


PREFIX = "sharded_"  # the pair's layer names in the shared 4-worker launch
LAUNCHED = {PREFIX + key: axes for key, axes in SHARDED.items()}


def launched(strategy, directory):
    """On each of the 4 workers of tests/tp_mesh_jobs.py's launch (a 2 x 2 mesh whose
    layout map holds `LAUNCHED`): the pair named `PREFIX` trained, what this worker's
    replica holds, the bytes, and its save (every worker: a collective)."""
    import functools

    before = strategy.bytes_communicated
    weights, model = train(strategy, functools.partial(pair, prefix=PREFIX))
    out = {"weights": weights, "bytes": strategy.bytes_communicated - before,
           "held": {key.replace(PREFIX, ""): v for key, v in held(model).items()},
           "saved": os.path.join(directory, f"sharded_{strategy.rank}.keras")}
    model.save(out["saved"])
    return out


def held(model) -> dict:
    """Per split variable (the model's, and the optimizer's as ``slot/<name>``):
    ``(the elements of each local replica's stored part, the whole variable's
    elements)``."""
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    def parts(v):
        return ([int(np.prod(c.shape)) for c in tf_value(v).values],
                int(np.prod(split_of(v).full_shape)))

    out = {v.path: parts(v) for v in model.weights if split_of(v) is not None}
    out.update({"slot/" + v.path.partition("/")[2]: parts(v)
                for v in model.optimizer.variables if split_of(v) is not None})
    return out


def run(strategy, optimizer="adam", save=None):
    """The pair trained under ``strategy`` (None: one device): `train_and_report`."""
    return train_and_report(strategy, pair, held, optimizer, save)


def keras_mesh():
    """The pair under keras.distribution.ModelParallel on DeviceMesh((2, 2))."""
    return keras_mesh_run(SHARDED, pair, held)


def continued(path, strategy):
    """The pair saved at ``path``, loaded in ``strategy``'s scope (None: plain): its
    loaded weights and its weights after one more epoch on new data."""
    import contextlib

    import keras

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.saving.load_model(path)
    loaded = [np.asarray(w) for w in model.get_weights()]
    x, y = data(seed=3)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return {"loaded": loaded, "after": [np.asarray(w) for w in model.get_weights()]}


def main(out_path, directory):
    import keras

    import tfdist

    tfdist.devices.use_logical_cpus(4)

    def mesh():
        return tfdist.ModelParallelStrategy(layout_map=SHARDED, model_parallel=2)

    saved = os.path.join(directory, "pair.keras")

    def sgd():
        return keras.optimizers.SGD(0.1, global_clipnorm=0.05)

    results = {"mesh": run(mesh(), save=saved), "reference": run(None),
               "keras": keras_mesh(), "saved": saved,
               "clipped": {"mesh": train(mesh(), pair, optimizer=sgd)[0],
                           "reference": train(None, pair, optimizer=sgd)[0]},
               "on_mesh": continued(saved, mesh())}
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
