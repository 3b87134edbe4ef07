"""Datasets for the main job: scikit-learn's digits, and .npz / CSV / TFRecord files.

Every loader returns ``(x, y)`` numpy arrays: features as float32, labels as int32, and
checks what it reads: a file that cannot be used raises `DataError` naming the file and
what is wrong. No loader runs a TensorFlow op, so the data can be checked before a
strategy starts. `load_dataset` then checks the whole data set (finite features, class
labels ``0..K-1`` with ``K`` at most the number of samples, non-empty splits).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import struct
import zipfile
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """A data file cannot be used; the message names the file and what is wrong.

    Attributes:
        key: The config key to blame, e.g. ``data.path`` or ``data.label``.
    """

    def __init__(self, message: str, key: str = "data.path"):
        super().__init__(message)
        self.key = key


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A loaded, checked and split data set (see `load_dataset`)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int


def load_digits_data():
    """scikit-learn's 8x8 digits (1,797 images, 10 classes), scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype("float32"), digits.target.astype("int32")


def _check_file(path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory; expected a file")
    if not path.is_file():
        raise DataError(f"{path} does not exist or is not a regular file")
    return path


def load_npz(path: str | Path, label: str = "y"):
    """An .npz file with arrays ``x`` and ``y`` (or the name given by ``label``)."""
    path = _check_file(path)
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path} is not an .npz archive (a zip file of arrays, as written "
                        "by numpy.savez)")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            names = list(arrays.keys())
            label_key = label if label in arrays else "y"
            if "x" not in arrays or label_key not in arrays:
                raise DataError(f"{path}: an .npz dataset needs arrays 'x' and '{label}'. "
                                f"Received arrays: {names}", key="data.label")
            x, y = arrays["x"], arrays[label_key]
    except DataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, KeyError) as error:
        raise DataError(f"{path} cannot be read as an .npz archive: {error}") from None
    for name, array in (("x", x), (label_key, y)):
        if array.dtype.kind not in "biuf":
            raise DataError(f"{path}: array {name!r} must hold numbers. Received dtype "
                            f"{array.dtype}")
    if x.ndim < 2:
        raise DataError(f"{path}: array 'x' must have one row per sample (2 or more "
                        f"dimensions). Received shape {x.shape}")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: array {label_key!r} must hold one label per row of 'x' "
                        f"({len(x)}). Received shape {y.shape}")
    return _features(x, path), _labels(y, path)


def load_csv(path: str | Path, label: str = "label"):
    """A CSV file with a header; ``label`` names the label column, the rest are features."""
    path = _check_file(path)
    try:
        with open(path, newline="") as f:
            rows = [row for row in csv.reader(f) if row]
    except (UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"{path} is not a readable CSV text file: {error}") from None
    if len(rows) < 2:
        raise DataError(f"{path}: a CSV dataset needs a header and at least one row. "
                        f"Received {len(rows)} non-empty line(s)")
    header, body = rows[0], rows[1:]
    if label not in header:
        raise DataError(f"{path}: no label column {label!r}. Received columns: {header}",
                        key="data.label")
    if len(header) < 2:
        raise DataError(f"{path}: no feature column besides {label!r}")
    column = header.index(label)
    table = np.empty((len(body), len(header)), dtype="float64")
    for line, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise DataError(f"{path}: line {line} has {len(row)} values; the header has "
                            f"{len(header)}")
        for index, value in enumerate(row):
            try:
                table[line - 2, index] = float(value)
            except ValueError:
                raise DataError(f"{path}: line {line}, column {header[index]!r} is not a "
                                f"number. Received: {value!r}") from None
    y = _labels(table[:, column], path)
    return _features(np.delete(table, column, axis=1), path), y


def _tfrecords(path: Path):
    """The serialized records of a TFRecord file, read without TensorFlow ops."""
    with open(path, "rb") as f:
        while True:
            header = f.read(12)  # uint64 length, uint32 masked CRC of the length
            if not header:
                return
            if len(header) < 12:
                raise DataError(f"{path} is truncated or not a TFRecord file")
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            if len(data) < length or len(f.read(4)) < 4:
                raise DataError(f"{path} is truncated or not a TFRecord file")
            yield data


def load_tfrecord(path: str | Path, label: str = "label"):
    """TFRecord ``tf.train.Example``s with a float list ``x`` and an int64 ``label``.

    ``path`` is a file or a directory of ``*.tfrecord`` files. Only the protocol-buffer
    classes of TensorFlow are used (no TF op), so this can run before a strategy starts.
    """
    from google.protobuf.message import DecodeError
    from tensorflow.core.example import example_pb2

    path = Path(path)
    files = sorted(path.glob("*.tfrecord")) if path.is_dir() else [_check_file(path)]
    features, labels = [], []
    for file in files:
        for record in _tfrecords(file):
            try:
                feature = example_pb2.Example.FromString(record).features.feature
            except DecodeError as error:
                raise DataError(f"{file}: a record is not a tf.train.Example: "
                                f"{error}") from None
            if "x" not in feature or label not in feature:
                raise DataError(f"{file}: examples need features 'x' and {label!r}. "
                                f"Received features: {sorted(feature.keys())}",
                                key="data.label")
            values = feature[label].int64_list.value or feature[label].float_list.value
            if len(values) != 1:
                raise DataError(f"{file}: feature {label!r} must hold one label per "
                                f"example. Received {len(values)} values")
            features.append(list(feature["x"].float_list.value))
            labels.append(values[0])
    if not features:
        raise DataError(f"{path}: no TFRecord examples found")
    widths = {len(f) for f in features}
    if len(widths) != 1 or 0 in widths:
        raise DataError(f"{path}: every example's 'x' must have the same non-zero length. "
                        f"Received lengths {sorted(widths)[:5]}")
    return _features(np.array(features, dtype="float64"), path), \
        _labels(np.array(labels, dtype="float64"), path)


def _features(x: np.ndarray, path) -> np.ndarray:
    """Features as float32; refuses NaN and infinity (also values too large for float32)."""
    with np.errstate(over="ignore"):
        x = np.asarray(x).astype("float32")
    bad = ~np.isfinite(x)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise DataError(f"{path}: features must be finite numbers. Received "
                        f"{int(bad.sum())} NaN or infinite value(s), the first in sample "
                        f"{row}")
    return x


def _labels(y: np.ndarray, path) -> np.ndarray:
    """Labels as int32 class indices; refuses fractions, negatives and NaN."""
    y = np.asarray(y)
    if y.dtype.kind == "f":
        wrong = ~np.isfinite(y) | (y != np.round(y))
        if wrong.any():
            index = int(np.argmax(wrong))
            raise DataError(f"{path}: labels must be whole numbers (class indices 0, 1, "
                            f"...). Received: {y[index].item()!r} (sample {index})")
    if len(y) and y.min() < 0:
        index = int(np.argmin(y))
        raise DataError(f"{path}: labels must be class indices >= 0. Received: "
                        f"{y[index].item()!r} (sample {index})")
    if len(y) and y.max() > np.iinfo("int32").max:
        raise DataError(f"{path}: a label is too large for a class index. Received: "
                        f"{y.max().item()!r}")
    return y.astype("int32")


def count_classes(y: np.ndarray, source="data") -> int:
    """The number of classes ``K = max(label) + 1``, at most the number of samples.

    A label larger than the data could hold classes for is almost surely a wrong column
    or a corrupt file (a label of 100000 would build a 100001-way output layer).

    Raises:
        DataError: there are no labels, or ``K`` exceeds the number of samples.
    """
    if not len(y):
        raise DataError(f"{source}: the data set has no samples")
    k = int(y.max()) + 1
    if k > len(y):
        raise DataError(f"{source}: labels must be class indices 0..K-1 with K at most the "
                        f"number of samples ({len(y)}). Received: a label of {k - 1}")
    return k


def read_data(data_config: dict):
    """The full ``(x, y)`` of the data set a config's ``[data]`` names, checked."""
    name, path, label = data_config["name"], data_config["path"], data_config["label"]
    if name == "digits":
        return load_digits_data()
    if name == "npz":
        return load_npz(path, label)
    if name == "csv":
        return load_csv(path, label)
    if name == "tfrecord":
        return load_tfrecord(path, label)
    raise DataError(f"unknown data.name. Received: {name!r}")


def split_data(data_config: dict, seed: int = 0) -> Dataset:
    """Loads, checks and splits the data set of a config's ``[data]`` (see `load_dataset`).

    The number of classes comes from the whole file, before ``limit``, so a smaller
    ``limit`` never changes the model.

    Raises:
        DataError: the file cannot be used, or a split would be empty.
    """
    x, y = read_data(data_config)
    source = data_config["path"] or data_config["name"]
    num_classes = count_classes(y, source)
    order = np.random.default_rng(seed).permutation(len(x))
    if data_config.get("limit"):
        order = order[:data_config["limit"]]
    x, y = x[order], y[order]
    split = data_config["validation_split"]
    n_val = int(round(len(x) * split))
    if n_val >= len(x):
        raise DataError(f"{source}: validation_split={split} of {len(x)} samples leaves "
                        "no training sample", key="data.validation_split")
    if split and not n_val:
        raise DataError(f"{source}: validation_split={split} of {len(x)} samples leaves "
                        "no validation sample (use more samples, or validation_split = 0)",
                        key="data.validation_split")
    return Dataset(x[n_val:], y[n_val:], x[:n_val], y[:n_val], num_classes)


def load_dataset(data_config: dict, seed: int = 0):
    """Loads and splits the dataset a config names.

    Returns:
        ``(x_train, y_train, x_val, y_val)``; the validation arrays are empty when
        ``validation_split`` is 0. The split is a seeded shuffle, identical on every task.

    Raises:
        DataError: the data cannot be used (see `split_data`).
    """
    data = split_data(data_config, seed)
    return data.x_train, data.y_train, data.x_val, data.y_val


def make_train_dataset(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int,
                       start_batch: int = 0):
    """Batches of ``(x, y)`` whose order depends only on ``seed`` and the batch index.

    Pass ``p`` over the data is a permutation drawn from ``(seed, p)`` with a stateless
    random op, batched (the last batch of a pass may be smaller). The dataset is
    infinite and starts at global batch ``start_batch``: a job resumed at epoch ``e``
    with ``steps_per_epoch = s`` passes ``start_batch = e * s`` and sees exactly the
    batches an uninterrupted run would.
    """
    import tensorflow as tf

    n = len(x)
    per_pass = math.ceil(n / batch_size)
    first_pass, offset = divmod(int(start_batch), per_pass)
    features, labels = tf.constant(x), tf.constant(y)

    def one_pass(p):
        keys = tf.random.stateless_uniform([n], seed=tf.stack([tf.constant(seed, tf.int64), p]))
        return tf.data.Dataset.from_tensor_slices(tf.argsort(keys)).batch(batch_size)

    dataset = tf.data.Dataset.range(first_pass, 2**62).flat_map(one_pass).skip(offset)
    dataset = dataset.map(lambda i: (tf.gather(features, i), tf.gather(labels, i)))
    options = tf.data.Options()
    # Keras does the same for numpy input: split each global batch over the workers.
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options).prefetch(2)
