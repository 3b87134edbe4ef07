"""Variables laid out over "batch" alone on a d x m data x model mesh, in one process of
4 logical CPUs (tests/test_tensor_parallel_batch_axis.py runs it: a pytest process has
2): a Dense stack whose outer layers are laid out ``("batch", None)`` / ``("batch",)``
around a column/row pair over "model", on 2 x 1 and 2 x 2 meshes, against one device;
and the ("batch", "model") pair of tests/tp_fsdp_jobs.py under mixed precision."""

import os
import pickle
import sys

import numpy as np

from tp_jobs import BATCH, FEATURES, OUTPUTS, keras_mesh_run, train, train_and_report

WIDE, MIDDLE = 16, 8  # layer "a": FEATURES -> WIDE; the pair WIDE -> WIDE -> MIDDLE
STACK = {"a/kernel": ("batch", None), "a/bias": ("batch",),
         "up/kernel": (None, "model"), "down/kernel": ("model", None),
         "b/kernel": ("batch", None), "b/bias": ("batch",)}
BATCH_ONLY = ("a/kernel", "a/bias", "b/kernel", "b/bias")
EPOCHS = 1
STEPS = EPOCHS * (32 // BATCH)  # one epoch of 32 rows
CLIP = 0.05  # the 2 x 2 mesh's Adam clips by global norm (its steps' norms are above)


def stack():
    """Dense a (over "batch"), the column/row pair up/down (over "model"), Dense b."""
    import keras

    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(WIDE, activation="relu", name="a")(inputs)
    h = keras.layers.Dense(WIDE, activation="relu", name="up")(h)
    h = keras.layers.Dense(MIDDLE, activation="relu", name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(OUTPUTS, name="b")(h))


def held(model) -> dict:
    """Per split variable (and optimizer slot, as ``slot/<name>``): the elements each
    local replica stores, and the whole variable's."""
    from tp_fsdp_jobs import held as tp_held

    return tp_held(model)


def clipped():
    """Adam clipping by global norm: on the 2 x 2 mesh, each block over "batch" alone
    (held by m replicas) must count once in the norm."""
    import keras

    return keras.optimizers.Adam(0.01, global_clipnorm=CLIP)


def run(strategy, optimizer="adam", save=None):
    """The stack trained under ``strategy`` (None: one device) with ``optimizer``:
    `train_and_report`."""
    return train_and_report(strategy, stack, held, optimizer, save, epochs=EPOCHS)


def keras_mesh():
    """The stack under keras.distribution.ModelParallel on DeviceMesh((2, 2)), with the
    2 x 2 run's clipped Adam."""
    return keras_mesh_run(STACK, stack, held, epochs=EPOCHS, optimizer=clipped)


def halves_pair():
    """tp_jobs.pair with its row layer's product summed as the mesh sums it: two
    half-products over the hidden axis, each rounded to the compute dtype, then added
    (one device, another reduction order)."""
    import keras

    class Halves(keras.layers.Dense):
        def call(self, inputs):
            from keras import ops

            x1, x2 = ops.split(inputs, 2, axis=-1)
            k1, k2 = ops.split(ops.convert_to_tensor(self.kernel), 2, axis=0)
            return ops.matmul(x1, k1) + ops.matmul(x2, k2) + self.bias

    from tp_jobs import HIDDEN

    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(HIDDEN, activation="relu", name="up")(inputs)
    return keras.Model(inputs, Halves(OUTPUTS, name="down")(h))


def mixed(policy, mesh):
    """The ("batch", "model") pair of tests/tp_fsdp_jobs.py under the Keras dtype policy
    ``policy`` (Keras wraps Adam in a LossScaleOptimizer for "mixed_float16"): trained
    on the 2 x 2 ``mesh()``, on one device, and on one device in the mesh's order of the
    row layer's sum; the optimizer's class, the final loss scales (mesh, one device),
    and each replica's stored elements."""
    import keras

    from tp_jobs import pair

    keras.mixed_precision.set_global_policy(policy)
    try:
        weights, model = train(mesh(), pair)
        reference, plain = train(None, pair)
        return {"mesh": weights, "optimizer": type(model.optimizer).__name__,
                "scales": [float(np.asarray(m.optimizer.dynamic_scale))
                           for m in (model, plain) if hasattr(m.optimizer, "dynamic_scale")],
                "compute_dtype": model.get_layer("down").compute_dtype,
                "held": held(model), "reference": reference,
                "halves": train(None, halves_pair)[0]}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main(out_path, directory):
    import tfdist

    tfdist.devices.use_logical_cpus(4)

    def mesh(d, m):
        devices = [f"/cpu:{i}" for i in range(d * m)]
        return tfdist.ModelParallelStrategy(layout_map=STACK, devices=devices,
                                            model_parallel=m)

    def pair_mesh():
        from tp_fsdp_jobs import SHARDED

        return tfdist.ModelParallelStrategy(layout_map=SHARDED, model_parallel=2)

    saved = os.path.join(directory, "stack.keras")
    results = {"2x1": run(mesh(2, 1)), "2x2": run(mesh(2, 2), clipped, save=saved),
               "reference": run(None), "clipped": run(None, clipped),
               "keras": keras_mesh(), "saved": saved,
               "float16": mixed("mixed_float16", pair_mesh),
               "bfloat16": mixed("mixed_bfloat16", pair_mesh),
               "float32": train(None, __import__("tp_jobs").pair)[0]}
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
