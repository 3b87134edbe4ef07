"""tfdist/_hooks/keras_steps.py: the Keras and TF internals that keep a train step local,
and the collective count (tfdist/comm/collectives.py) the tests rely on.

If one of these fails after an upgrade, model averaging would again wait for every peer
at every step (or the count that shows it would not would be blind).
"""

import inspect
import re


def _original(function):
    """Keras' or TF's own function, when tfdist's hook already replaced it."""
    return getattr(function, "_tfdist_original", function)


def test_keras_and_tf_internals_of_the_per_step_reduce_exist():
    from keras.src.backend.tensorflow import trainer
    from tensorflow.python.distribute import input_lib

    reduce_source = inspect.getsource(trainer.reduce_per_replica)
    assert "_collective_all_reduce_multi_worker(strategy)" in reduce_source, (
        "Keras' reduce_per_replica no longer asks _collective_all_reduce_multi_worker: "
        "tfdist._hooks.keras_steps would not keep model averaging's step outputs local")
    assert "self._make_function(self.train_step)" in inspect.getsource(
        _original(trainer.TensorFlowTrainer.make_train_function))
    assert "_in_multi_worker_mode()" in inspect.getsource(
        _original(trainer._collective_all_reduce_multi_worker))
    assert "get_next_as_optional()" in inspect.getsource(trainer.TensorFlowTrainer._make_function)
    count = _original(input_lib._calculate_replicas_with_values)
    count_source = inspect.getsource(count)
    assert "strategy.reduce(" in count_source, (
        "TF's iterator no longer reduces its has-a-batch count there: check where it "
        "communicates now")
    assert list(inspect.signature(count).parameters) == [
        "strategy", "input_workers", "optional_list"]
    for method in ("get_next_as_optional", "get_next"):
        source = inspect.getsource(getattr(input_lib.DistributedIteratorBase, method))
        assert "_calculate_replicas_with_values(" in source
    from keras.src.metrics import metric

    assert 'synchronization="on_read"' in inspect.getsource(metric.Metric.add_variable), (
        "Keras' metric variables are no longer on-read: model averaging's epoch logs "
        "would be this worker's only")


def test_hooks_replace_the_functions_keras_and_tf_call(logical_cpus):
    """After install, the names Keras and TF look up at call time are the hooks."""
    from keras.src.backend.tensorflow import trainer
    from tensorflow.python.distribute import input_lib

    import tfdist

    tfdist.ModelAverageStrategy(period=2)  # installs the hooks
    for function in (trainer._collective_all_reduce_multi_worker,
                     trainer.TensorFlowTrainer.make_train_function,
                     input_lib._calculate_replicas_with_values):
        assert hasattr(function, "_tfdist_original"), function


def test_hook_marks_only_local_output_strategies(logical_cpus):
    """A local-output strategy's train function is wrapped and records its graph; the
    mirrored strategy's is Keras' own."""
    import keras
    import numpy as np

    import tfdist
    from tfdist._hooks.keras_steps import traced_train_steps
    from tfdist.comm.collectives import train_step_collectives

    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def fit(strategy):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        return model

    local = fit(tfdist.ModelAverageStrategy(period=2))
    assert getattr(local.train_function, "_tfdist_local", False)
    assert traced_train_steps(local)
    count = train_step_collectives(local)
    assert count.every_step == 0
    mirrored = fit(tfdist.MirroredStrategy())
    assert not getattr(mirrored.train_function, "_tfdist_local", False)
    assert traced_train_steps(mirrored) == []


def _averaging_model():
    """``(strategy, model, x, y)``: a one-layer regression under model averaging."""
    import keras
    import numpy as np

    import tfdist

    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy = tfdist.ModelAverageStrategy(period=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return strategy, model, x, y


def test_after_train_step_follows_every_train_function_call(logical_cpus):
    """The wrapped train function tells the hand-off after each call, once the step's
    optimizer update is done (model averaging's delayed syncs run there)."""
    strategy, model, x, y = _averaging_model()
    seen = []
    strategy.keras_after_train_step = (
        lambda m: seen.append(int(m.optimizer.iterations.numpy())))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    model.train_on_batch(x[:8], y[:8])
    assert seen == list(range(1, 10)), seen


def test_count_collectives_separates_conditional_branches():
    import tensorflow as tf

    from tfdist.comm.collectives import count_collectives

    def all_reduce(x, key):
        return tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=tf.constant(2), group_key=tf.constant(1),
            instance_key=tf.constant(key), ordering_token=[], merge_op="Add",
            final_op="Id")

    @tf.function
    def step(x, average):
        y = all_reduce(x, 1)
        inner = tf.function(lambda v: all_reduce(v, 2))
        y = inner(y)
        return tf.cond(average, lambda: all_reduce(y, 3), lambda: y)

    graph = step.get_concrete_function(tf.TensorSpec([2]), tf.TensorSpec([], tf.bool)).graph
    count = count_collectives(graph)
    assert (count.every_step, count.in_branches) == (2, 1)
    assert count.op_types == ("CollectiveReduceV2",)

    @tf.function
    def quiet(x):
        return x * 2

    assert count_collectives(quiet.get_concrete_function(tf.TensorSpec([2])).graph
                             ).every_step == 0


def test_elastic_fit_seams_in_keras_train_function_and_fit_exist():
    """An elastic fit (tfdist/strategies/elastic/fit.py) puts its wrapper in
    ``model.train_function`` (`remake_train_function`), feeds it a Python iterator, and
    a joiner starts fit at the job's epoch (``initial_epoch``)."""
    from keras.src.backend.tensorflow import trainer

    make = inspect.getsource(_original(trainer.TensorFlowTrainer.make_train_function))
    assert "if self.train_function is not None and not force:" in make, (
        "Keras' make_train_function no longer keeps an existing train_function: an "
        "elastic fit's wrapper would be replaced")
    fit = inspect.getsource(trainer.TensorFlowTrainer.fit)
    assert "self.make_train_function()" in fit and "self.train_function(iterator)" in fit
    assert "initial_epoch" in inspect.signature(trainer.TensorFlowTrainer.fit).parameters
    function = inspect.getsource(trainer.TensorFlowTrainer._make_function)
    assert "range(self.steps_per_execution)" in function and \
        "one_step_on_data(data)" in function, (
        "Keras' train function no longer steps a Python iterator one batch at a time")


def test_remake_train_function_traces_anew_and_fit_keeps_a_wrapper():
    import keras
    import numpy as np

    from tfdist._hooks.keras_steps import remake_train_function

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    first = remake_train_function(model)
    assert callable(first) and remake_train_function(model) is not first
    calls = []

    def wrapper(iterator):
        calls.append(1)
        return inner(iterator)

    inner = remake_train_function(model)
    model.train_function = wrapper
    model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    assert len(calls) == 2  # fit called the wrapper, once per batch


def test_keras_per_batch_step_that_the_committing_step_rebuilds_exists():
    """`committing_train_function` rebuilds Keras' per-batch step (``one_step_on_data``
    of the private ``_make_function``) with an elastic commit's reads after it; if
    Keras changes that step, the rebuilt one would no longer be Keras' step."""
    from keras.src.backend.tensorflow import trainer

    function = inspect.getsource(trainer.TensorFlowTrainer._make_function)
    for piece in ("self.distribute_strategy.run(step_function, args=(data,))",
                  "reduce_per_replica(", 'reduction="auto"', "reduce_retracing=True",
                  "jit_compile=self.jit_compile",
                  "self._autoconvert_optionals(one_step_on_data)"):
        assert piece in function, (
            f"Keras' train function changed ({piece!r} is gone): "
            "tfdist._hooks.keras_steps.committing_train_function rebuilds its per-batch "
            "step and must follow it")
    assert re.search(r"zip\(\s*range\(self\.steps_per_execution\),\s*iterator\s*\)",
                     function), "Keras' train function no longer takes one batch per step"
    assert "self._make_function(self.train_step)" in inspect.getsource(
        _original(trainer.TensorFlowTrainer.make_train_function))
    assert list(inspect.signature(trainer.reduce_per_replica).parameters) == [
        "values", "strategy", "reduction"]
    assert callable(trainer.TensorFlowTrainer._autoconvert_optionals)


def test_committing_step_of_a_local_output_strategy_stays_local(logical_cpus):
    """Model averaging's committing step is traced marked (no per-step collective) and
    the hand-off hears of the call once."""
    import numpy as np
    import tensorflow as tf

    from tfdist._hooks.keras_steps import (committing_train_function,
                                           remake_train_function, traced_train_steps)
    from tfdist.comm.collectives import train_step_collectives

    strategy, model, x, y = _averaging_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    seen = []
    strategy.keras_after_train_step = (
        lambda m: seen.append(int(m.optimizer.iterations.numpy())))
    traced = len(traced_train_steps(model))
    weights = model.trainable_variables
    function = committing_train_function(
        model, remake_train_function(model),
        lambda: [tf.concat([tf.reshape(w.value, [-1]) for w in weights], 0)])
    batches = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)))
    logs, values = function(batches)
    assert "loss" in logs and values is not None
    assert seen == [5]
    assert len(traced_train_steps(model)) == traced + 1
    assert train_step_collectives(model).every_step == 0
    np.testing.assert_allclose(
        values[0].numpy(), np.concatenate([w.numpy().ravel() for w in weights]))


def test_fit_reads_the_epoch_metrics_through_a_wrapped_get_metrics_result():
    """`wrap_epoch_metrics`: Keras' fit reads each epoch's logs with the private
    ``_get_metrics_result_or_logs``, which calls ``get_metrics_result``; an elastic fit
    puts its recovering read there (tfdist/strategies/elastic/fit.py)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer
    from keras.src.trainers import trainer as base

    from tfdist._hooks.keras_steps import wrap_epoch_metrics

    assert "self._get_metrics_result_or_logs(logs)" in inspect.getsource(
        trainer.TensorFlowTrainer.fit)
    assert "self.get_metrics_result()" in inspect.getsource(
        base.Trainer._get_metrics_result_or_logs)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    reads = []

    def wrapper(read):
        result = read()
        if not tf.inside_function():  # the train step reads them too, traced
            reads.append(result)
        return result

    undo = wrap_epoch_metrics(model, wrapper)
    history = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, epochs=2, verbose=0)
    assert len(reads) == 2 and history.history["loss"] == [float(r["loss"]) for r in reads]
    undo()
    model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    assert len(reads) == 2
