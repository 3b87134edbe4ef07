"""What the workers and the chief read under `tfdist.ParameterServerStrategy`.

Input: a `tf.data.Dataset` (batched; worker ``i`` of K reads ``dataset.shard(K, i)``
repeated), a dataset function ``fn(input_context)`` (called once per worker with
``InputContext(num_input_pipelines=K, input_pipeline_id=i)``; its dataset is repeated),
or numpy arrays (batched by ``batch_size``, shuffled with one seed on every worker,
batches sharded over the workers). ``evaluate`` and ``predict`` iterate a finite
dataset on the chief (`chief_dataset`).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfdist._hooks.coordinator import dataset_copier

DEFAULT_BATCH_SIZE = 32


def _is_dataset(x) -> bool:
    return isinstance(x, tf.data.Dataset)


def _is_dataset_fn(x) -> bool:
    return callable(x) and not _is_dataset(x) and not hasattr(x, "shape")


def _arrays_dataset(x, y, sample_weight):
    parts = (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
    return tf.data.Dataset.from_tensor_slices(parts)


def _num_examples(x) -> int:
    return int(tf.nest.flatten(x)[0].shape[0])


def _check_arrays(x, name):
    leaves = tf.nest.flatten(x)
    if x is None or not leaves or not all(hasattr(leaf, "shape") for leaf in leaves):
        raise ValueError(
            f"ParameterServerStrategy takes numpy arrays (or tensors), a batched "
            f"tf.data.Dataset, or a dataset function fn(input_context) as {name}. "
            f"Received: {name}={type(x).__name__}")


def _cardinality(dataset) -> int:
    return int(dataset.cardinality().numpy())


class TrainInput:
    """What the workers read in fit: a dataset function per worker, and its spec."""

    def __init__(self, strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch):
        k = strategy.num_workers
        replicas = strategy.num_replicas_in_sync
        if _is_dataset(x) or _is_dataset_fn(x):
            for name, value in (("y", y), ("sample_weight", sample_weight)):
                if value is not None:
                    raise ValueError(f"{name} must be None when x is a dataset or a dataset "
                                     f"function (put it in the dataset). Received: "
                                     f"{name}={type(value).__name__}")
        if _is_dataset(x):
            batches = _cardinality(x)
            copy_fn = dataset_copier(x)
            shard = 0 < batches and batches >= k

            def make(i):
                def dataset_fn():
                    dataset = copy_fn()
                    return (dataset.shard(k, i) if shard else dataset).repeat()
                return dataset_fn

            self.element_spec = x.element_spec
            default_steps = batches if batches > 0 else None
        elif _is_dataset_fn(x):
            def make(i):
                context = tf.distribute.InputContext(
                    num_input_pipelines=k, input_pipeline_id=i, num_replicas_in_sync=replicas)
                return lambda: x(context).repeat()

            sample = x(tf.distribute.InputContext(k, 0, replicas))
            if not _is_dataset(sample):
                raise ValueError("a dataset function must return a tf.data.Dataset. "
                                 f"Received: {type(sample).__name__}")
            self.element_spec = sample.element_spec
            batches = _cardinality(sample)
            default_steps = batches * k if batches > 0 else None
        else:
            _check_arrays(x, "x")
            batch_size = batch_size or DEFAULT_BATCH_SIZE
            n = _num_examples(x)
            seed = int(np.random.randint(0, 2**31 - 1))

            def make(i):
                def dataset_fn():
                    dataset = _arrays_dataset(x, y, sample_weight)
                    if shuffle:
                        # One seed on every worker: the same order, then disjoint batches.
                        dataset = dataset.shuffle(n, seed=seed, reshuffle_each_iteration=True)
                    return dataset.batch(batch_size).shard(k, i).repeat() if n >= k * batch_size \
                        else dataset.batch(batch_size).repeat()
                return dataset_fn

            self.element_spec = _arrays_dataset(x, y, sample_weight).batch(batch_size).element_spec
            default_steps = math.ceil(n / batch_size)
        if steps_per_epoch is None:
            # One epoch is one pass over the data; a sync step reads K batches.
            if default_steps is not None and strategy.mode == "sync":
                default_steps = max(1, math.ceil(default_steps / k))
            if default_steps is None:
                raise ValueError("steps_per_epoch is required when the dataset is infinite or "
                                 "its length is unknown. Received: steps_per_epoch=None")
            steps_per_epoch = default_steps
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or \
                steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be an integer >= 1. "
                             f"Received: steps_per_epoch={steps_per_epoch!r}")
        self.steps_per_epoch = steps_per_epoch
        self.dataset_fns = [make(i) for i in range(k)]


def _chief_dataset(strategy, x, y, sample_weight, batch_size, steps):
    """A finite dataset iterated on the chief, whose batches are shipped to workers."""
    if _is_dataset_fn(x):
        x = x(tf.distribute.InputContext(1, 0, strategy.num_replicas_in_sync))
    if _is_dataset(x):
        if y is not None or sample_weight is not None:
            raise ValueError("y and sample_weight must be None when x is a dataset. "
                             f"Received: y={type(y).__name__}, "
                             f"sample_weight={type(sample_weight).__name__}")
        dataset = x
    else:
        _check_arrays(x, "x")
        dataset = _arrays_dataset(x, y, sample_weight).batch(batch_size or DEFAULT_BATCH_SIZE)
    if steps is not None:
        dataset = dataset.take(steps)
    elif _cardinality(dataset) == tf.data.INFINITE_CARDINALITY:
        raise ValueError("steps is required when the dataset is infinite. Received: steps=None")
    return dataset
