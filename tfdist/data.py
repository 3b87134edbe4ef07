"""Datasets for the main job: scikit-learn's digits, and .npz / CSV / TFRecord files.

Every loader returns ``(x, y)`` numpy arrays: features as float32, labels as int32.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def load_digits_data():
    """scikit-learn's 8x8 digits (1,797 images, 10 classes), scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype("float32"), digits.target.astype("int32")


def load_npz(path: str | Path, label: str = "y"):
    """An .npz file with arrays ``x`` and ``y`` (or the name given by ``label``)."""
    with np.load(path, allow_pickle=False) as arrays:
        names = list(arrays.keys())
        label_key = label if label in arrays else "y"
        if "x" not in arrays or label_key not in arrays:
            raise ValueError(f"{path}: an .npz dataset needs arrays 'x' and '{label}'. "
                             f"Received arrays: {names}")
        return arrays["x"].astype("float32"), arrays[label_key].astype("int32")


def load_csv(path: str | Path, label: str = "label"):
    """A CSV file with a header; ``label`` names the label column, the rest are features."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path}: a CSV dataset needs a header and at least one row")
    header, body = rows[0], rows[1:]
    if label not in header:
        raise ValueError(f"{path}: no label column {label!r}. Received columns: {header}")
    column = header.index(label)
    try:
        table = np.array([[float(v) for v in row] for row in body], dtype="float32")
    except ValueError as error:
        raise ValueError(f"{path}: every CSV value must be a number ({error})") from None
    y = table[:, column].astype("int32")
    x = np.delete(table, column, axis=1)
    return x, y


def load_tfrecord(path: str | Path, label: str = "label"):
    """TFRecord ``tf.train.Example``s with a float list ``x`` and an int64 ``label``."""
    import tensorflow as tf

    files = sorted(str(p) for p in Path(path).glob("*.tfrecord")) if Path(path).is_dir() \
        else [str(path)]
    records = list(tf.data.TFRecordDataset(files).as_numpy_iterator())
    if not records:
        raise ValueError(f"{path}: no TFRecord examples found")
    first = tf.train.Example.FromString(records[0]).features.feature
    if "x" not in first or label not in first:
        raise ValueError(f"{path}: examples need features 'x' and {label!r}. "
                         f"Received features: {sorted(first.keys())}")
    width = len(first["x"].float_list.value)
    spec = {"x": tf.io.FixedLenFeature([width], tf.float32),
            label: tf.io.FixedLenFeature([], tf.int64)}
    parsed = tf.io.parse_example(tf.constant(records), spec)
    return parsed["x"].numpy().astype("float32"), parsed[label].numpy().astype("int32")


def write_tfrecord(path: str | Path, x, y, label: str = "label") -> None:
    """Writes ``(x, y)`` in the format `load_tfrecord` reads."""
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as writer:
        for features, target in zip(x, y):
            example = tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(
                    value=np.ravel(features).tolist())),
                label: tf.train.Feature(int64_list=tf.train.Int64List(value=[int(target)])),
            }))
            writer.write(example.SerializeToString())


def load_dataset(data_config: dict, seed: int = 0):
    """Loads and splits the dataset a config names.

    Returns:
        ``(x_train, y_train, x_val, y_val)``; the validation arrays are empty when
        ``validation_split`` is 0. The split is a seeded shuffle, identical on every task.
    """
    name, path, label = data_config["name"], data_config["path"], data_config["label"]
    if name == "digits":
        x, y = load_digits_data()
    elif name == "npz":
        x, y = load_npz(path, label)
    elif name == "csv":
        x, y = load_csv(path, label)
    elif name == "tfrecord":
        x, y = load_tfrecord(path, label)
    else:
        raise ValueError(f"unknown data.name. Received: {name!r}")
    order = np.random.default_rng(seed).permutation(len(x))
    if data_config.get("limit"):
        order = order[:data_config["limit"]]
    x, y = x[order], y[order]
    n_val = int(round(len(x) * data_config["validation_split"]))
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]
