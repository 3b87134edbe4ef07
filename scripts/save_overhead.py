"""Measures what Keras 3 writes besides the values, the figures behind
`tfdist.files.model_save_size`'s margins.

    python scripts/save_overhead.py

Saves 17 small models (Dense stacks of 1 to 129 layers, BatchNormalization, Embedding;
Adam, SGD and no optimizer) as ``.weights.h5`` and ``.keras``, prints each file's
bookkeeping (its size less its values), the least-squares fit of that bookkeeping to
``per file + per group * groups + per variable * variables`` for each format, and the
range of tfdist's estimate over it.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist import files  # noqa: E402

CASES = [("dense", 0, 1, "sgd"), ("dense", 1, 4, "adam"), ("dense", 1, 64, "adam"),
         ("dense", 1, 256, "adam"), ("dense", 4, 16, "adam"), ("dense", 16, 4, "adam"),
         ("dense", 32, 4, "adam"), ("dense", 64, 4, "adam"), ("dense", 2, 64, "sgd"),
         ("dense", 32, 4, None), ("nobias", 32, 4, None), ("nobias", 64, 4, "sgd"),
         ("embed", 0, 8, "adam"), ("embed", 32, 4, None), ("bn", 16, 8, "adam"),
         ("bn", 32, 4, None), ("dense", 128, 4, "adam")]


def build(kind, layers, width, optimizer):
    """A model of ``layers`` hidden layers ``width`` wide, its optimizer's slots built."""
    keras.utils.set_random_seed(0)
    if kind == "embed":
        inputs = keras.Input((4,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(50, width)(inputs))
        for _ in range(layers):
            h = keras.layers.Dense(width, use_bias=False)(h)
    else:
        h = inputs = keras.Input((8,))
        for _ in range(layers):
            h = keras.layers.Dense(width, use_bias=kind != "nobias")(h)
            if kind == "bn":
                h = keras.layers.BatchNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    if optimizer:
        model.compile(optimizer, "mse")
        model.optimizer.build(model.trainable_variables)
    return model


def main():
    directory = tempfile.mkdtemp()
    rows = {".weights.h5": [], ".keras": []}
    for index, case in enumerate(CASES):
        model = build(*case)
        optimizer = getattr(model, "optimizer", None)
        variables = [*model.weights, *(optimizer.variables if optimizer else [])]
        values = sum(int(np.prod(v.shape)) * files._itemsize(v) for v in variables)
        groups = len({v.path.rpartition("/")[0] for v in variables})
        for suffix, table in rows.items():
            path = os.path.join(directory, f"{index}{suffix}")
            (model.save_weights if suffix.endswith(".h5") else model.save)(path)
            over = os.path.getsize(path) - values
            estimate = files.model_save_size(model) - values
            table.append((groups, len(variables), over, estimate))
            print(f"{str(case):28s} {suffix:12s} groups={groups:3d} vars={len(variables):3d} "
                  f"values={values:7d} bookkeeping={over:7d} estimate={estimate:7d}")
    for suffix, table in rows.items():
        a = np.array([[1, g, v] for g, v, _, _ in table], float)
        over = np.array([o for _, _, o, _ in table], float)
        ratio = np.array([e for *_, e in table]) / over
        fit = np.linalg.lstsq(a, over, rcond=None)[0]
        print(f"{suffix}: bookkeeping ~ {fit[0]:.0f} + {fit[1]:.0f} per group + "
              f"{fit[2]:.0f} per variable; the estimate is {ratio.min():.2f} to "
              f"{ratio.max():.2f} times it")


if __name__ == "__main__":
    main()
