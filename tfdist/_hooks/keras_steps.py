"""Hooks into Keras' train step and TF's input: a train step that stays on this worker.

Two things make every step of a multi-worker ``fit`` wait for every peer, even when no
weight moves: Keras 3 reduces each step's outputs (loss, metric results) across workers
with ``strategy.reduce`` (the private
``keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker``, asked by
``reduce_per_replica``), and TF's distributed iterator sums across workers whether any
replica still has a batch (the private
``tensorflow.python.distribute.input_lib._calculate_replicas_with_values``). For a
strategy whose hand-off sets ``keras_local_step_outputs`` (model averaging), the train
function Keras makes does both on this worker only; ``evaluate``/``predict`` and
validation are unchanged. Every worker must then have the same number of batches per
epoch (as Keras' arrays and TF's ``DATA`` auto-sharding give).
The epoch's logs stay global: Keras' metric variables are on-read (``SUM``), so the read
of ``get_metrics_result()`` after the epoch sums them over every worker, once.
An elastic ``fit`` also gets Keras' per-batch step rebuilt with its commit's reads after
the step, in the same traced function (`committing_train_function`), and its own read of
the epoch's metrics (`wrap_epoch_metrics`).
``tests/test_hooks_steps.py`` fails loudly when a Keras upgrade removes what it touches.
"""

from __future__ import annotations

import threading
import weakref

_training = threading.local()          # .model: the model whose train function runs here
_traced_steps = weakref.WeakKeyDictionary()   # model -> [FuncGraph of one train step]


def install_local_step_outputs(handoff_of) -> None:
    """Patches Keras once so that train steps of local-output strategies stay local.

    Why: Keras' ``reduce_per_replica`` sends each step's loss and metrics across
    workers and waits for every peer, so with model averaging every inner step pays for
    the slowest worker although no weights move between averages. Keras has no public
    switch for it: the train function (``TensorFlowTrainer.make_train_function``) is
    wrapped to mark the model whose step is traced (and to call the hand-off's
    ``keras_after_train_step`` after each call), and the trainer's private
    ``_collective_all_reduce_multi_worker`` answers False for that model's strategy, so
    ``reduce_per_replica`` takes its one-process path (mean over local replicas). TF's
    iterator sums the replicas holding a batch over every worker (so workers with
    uneven shards step together); for that model, only this worker's replicas count.

    Args:
        handoff_of: ``f(strategy)``: its `tfdist.keras.handoff.KerasHandoff`, or None.
    """
    from keras.src.backend.tensorflow import trainer
    from tensorflow.python.distribute import input_lib

    if getattr(trainer, "_tfdist_local_step_outputs", False):
        return
    original_check = trainer._collective_all_reduce_multi_worker
    original_count = input_lib._calculate_replicas_with_values
    original_make = trainer.TensorFlowTrainer.make_train_function

    def _collective_all_reduce_multi_worker(strategy):
        model = getattr(_training, "model", None)
        if model is None or model.distribute_strategy is not strategy:
            return original_check(strategy)
        _record_step_graph(model)
        return False

    def _calculate_replicas_with_values(strategy, input_workers, optional_list):
        model = getattr(_training, "model", None)
        if model is None or model.distribute_strategy is not strategy:
            return original_count(strategy, input_workers, optional_list)
        _record_step_graph(model)
        return _local_replicas_with_values(input_workers, optional_list)

    def make_train_function(self, force=False):
        result = original_make(self, force)
        handoff = handoff_of(self.distribute_strategy)
        function = self.train_function
        if (function is None or getattr(function, "_tfdist_local", False)
                or handoff is None or not handoff.keras_local_step_outputs):
            return result
        self.train_function = _local_train_function(self, function, handoff)
        return None if result is None else self.train_function

    # The originals stay reachable (``_tfdist_original``) for tests/test_hooks_steps.py.
    _collective_all_reduce_multi_worker._tfdist_original = original_check
    make_train_function._tfdist_original = original_make
    _calculate_replicas_with_values._tfdist_original = original_count
    trainer._collective_all_reduce_multi_worker = _collective_all_reduce_multi_worker
    trainer.TensorFlowTrainer.make_train_function = make_train_function
    input_lib._calculate_replicas_with_values = _calculate_replicas_with_values
    trainer._tfdist_local_step_outputs = True


def _local_train_function(model, function, handoff):
    """``function`` (Keras' train function) run with ``model`` marked as training here,
    then ``handoff.keras_after_train_step(model)``."""

    def train_function(iterator):
        result = run_marked(model, function, iterator)
        handoff.keras_after_train_step(model)
        return result

    train_function._tfdist_local = True
    train_function._tfdist_inner = function  # Keras' own (`committing_train_function`)
    train_function._tfdist_handoff = handoff
    return train_function


def run_marked(model, function, *args):
    """``function(*args)`` with ``model`` marked as training here (its step's outputs and
    batch count stay on this worker while it is traced)."""
    previous = getattr(_training, "model", None)
    _training.model = model
    try:
        return function(*args)
    finally:
        _training.model = previous


def _local_replicas_with_values(input_workers, optional_list):
    """How many of this worker's replicas got a batch (TF's count without the reduce)."""
    import tensorflow as tf

    per_device = []
    for device, optionals in zip(input_workers.worker_devices, optional_list):
        with tf.device(device):
            per_device.append(tf.reduce_sum(
                [tf.cast(o.has_value(), tf.int64) for o in optionals], keepdims=True))
    return tf.reshape(tf.reduce_sum(per_device, keepdims=True), [])


def _record_step_graph(model) -> None:
    """Keeps the outermost graph being traced (the train function) for
    `traced_train_steps`."""
    import tensorflow as tf

    if not tf.inside_function():
        return  # run_eagerly: nothing traced
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph  # a function graph inside another
    graphs = _traced_steps.setdefault(model, [])
    if not any(g is graph for g in graphs):
        graphs.append(graph)


def traced_train_steps(model) -> list:
    """The graphs of ``model``'s train function traced with local outputs (newest
    last): each holds the input, the step (as a called function) and its loop."""
    return list(_traced_steps.get(model, ()))


def remake_train_function(model):
    """Makes ``model``'s train function anew (traced again on its first call); returns it.

    Why: an elastic ``fit`` (`tfdist.strategies.elastic.fit`) must re-trace the train step
    after the replica count changed, and put its own wrapper in ``model.train_function``.
    Keras' ``make_train_function`` returns the existing ``train_function`` unless it is
    None, and ``fit`` calls it before the first step, so the attribute is the seam.
    """
    model.train_function = None
    model.make_train_function()
    return model.train_function


def wrap_epoch_metrics(model, wrapper):
    """Makes ``fit``'s read of ``model``'s epoch metrics call ``wrapper(read)`` (``read``:
    Keras' own ``get_metrics_result``); returns a function that undoes it.

    Why: an elastic ``fit`` (`tfdist.strategies.elastic.fit`) recovers a member lost in the
    epoch's read of the metrics, which sums them over the workers outside the train
    function. Keras' fit reads them with the private ``_get_metrics_result_or_logs``,
    which calls the public ``get_metrics_result``; an attribute of the instance takes
    its place for this model only. Keras' train step calls it too, while traced
    (``wrapper`` tells by ``tf.inside_function()``).
    """
    original = model.get_metrics_result
    model.get_metrics_result = lambda: wrapper(original)

    def undo():
        model.__dict__.pop("get_metrics_result", None)

    return undo


def committing_train_function(model, train_function, snapshot):
    """``train_function`` (`remake_train_function`'s) whose call's last step also returns
    ``snapshot()``, traced after that step in the step's own ``tf.function``.

    Returns ``function(iterator) -> (logs, values)``: ``values`` is what ``snapshot()``
    returned, read after the call's last step, or None when the iterator ran out before
    the call's last step (then nothing was read). The first
    ``steps_per_execution - 1`` steps run ``train_function``'s Keras steps unchanged.

    Why: an elastic ``fit`` (`tfdist.strategies.elastic.fit`) copies the training state
    after every step it commits at; a traced function of its own costs one more call
    per step (with a Python-side output per variable), a sizeable part of a small
    model's step. Keras' per-batch step is local to the private
    ``TensorFlowTrainer._make_function`` (``one_step_on_data``: ``strategy.run(
    train_step)``, then the private ``reduce_per_replica(..., reduction="auto")``, in a
    ``tf.function(reduce_retracing=True, jit_compile=model.jit_compile)`` wrapped by
    ``_autoconvert_optionals``), so it is rebuilt here the same way, with the snapshot's
    reads after the step. In a ``tf.function`` automatic control dependencies run a read
    of a variable after every earlier write of it, so the reads see the step's updates
    (``tests/test_elastic_commit.py`` checks the values). For a local-output strategy
    (model averaging) the step is traced with the model marked, as
    `install_local_step_outputs`' wrapper does, and the hand-off's
    ``keras_after_train_step`` follows the call once. ``tests/test_hooks_steps.py``
    fails when a Keras upgrade changes what is rebuilt.
    """
    import itertools

    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    strategy = model.distribute_strategy
    local = getattr(train_function, "_tfdist_local", False)
    keras_steps = getattr(train_function, "_tfdist_inner", train_function)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(model.train_step, args=(data,))
        outputs = trainer.reduce_per_replica(outputs, strategy, reduction="auto")
        return outputs, snapshot()

    if not model.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True,
                                       jit_compile=model.jit_compile)
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)
    missing = object()

    def steps(iterator):
        logs, values = None, None
        if model.steps_per_execution > 1:
            logs = keras_steps(itertools.islice(iterator, model.steps_per_execution - 1))
        data = next(iterator, missing)
        if data is not missing:
            logs, values = one_step_on_data(data)
        return logs, values

    def function(iterator):
        if not local:
            return steps(iterator)
        result = run_marked(model, steps, iterator)
        train_function._tfdist_handoff.keras_after_train_step(model)
        return result

    return function
