"""Each private Keras hook in tfdist/_hooks/keras*.py still exists in this Keras.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect


def test_keras_optimizer_step_has_the_points_model_averaging_replaces():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.losses import loss as loss_module
    from keras.src.optimizers import base_optimizer

    apply_source = inspect.getsource(base_optimizer.BaseOptimizer.apply)
    assert "self._backend_apply_gradients(" in apply_source, (
        "Keras' apply no longer calls _backend_apply_gradients: "
        "tfdist._hooks.keras.install_keras_hooks would not see the optimizer step")
    step_source = inspect.getsource(tf_optimizer.TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(" in step_source, (
        "TFOptimizer no longer reduces gradients in _all_reduce_sum_gradients: model "
        "averaging would sum gradients across replicas (synchronous training)")
    update_source = inspect.getsource(tf_optimizer.TFOptimizer._distributed_tf_update_step)
    assert "self.update_step(" in update_source and "extended.update(" in update_source, (
        "TFOptimizer no longer updates through update_step/extended.update: the outer "
        "optimizer step of ModelAverageStrategy copies that")
    scale_source = inspect.getsource(loss_module.scale_loss_for_distribution)
    assert "num_replicas_in_sync" in scale_source, (
        "Keras no longer scales the loss by 1/num_replicas_in_sync: ModelAverageStrategy "
        "multiplies local gradients by it and would now change the learning rate")


def test_local_update_hook_skips_the_gradient_all_reduce(logical_cpus):
    """Per-replica gradients: model averaging keeps them local, mirrored sums them."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    def step(strategy, period):
        with strategy.scope():
            weight = keras.Variable(np.zeros((2,), "float32"))
            optimizer = keras.optimizers.SGD(1.0)
            optimizer.build([weight])

        @tf.function
        def run():
            def replica_fn():
                rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                              tf.float32)
                # Keras scales by 1/N before the optimizer; do the same.
                grad = tf.fill([2], rid + 1.0) / strategy.num_replicas_in_sync
                optimizer.apply_gradients([(grad, weight)])

            strategy.run(replica_fn)

        run()
        return [c.numpy() for c in weight.value.values]

    local = step(tfdist.ModelAverageStrategy(period=2), 2)
    np.testing.assert_allclose(local, [[-1.0, -1.0], [-2.0, -2.0]])  # lr not divided by N
    synced = step(tfdist.MirroredStrategy(), None)
    np.testing.assert_allclose(synced, [[-1.5, -1.5], [-1.5, -1.5]])


def test_model_hooks_call_the_strategy(logical_cpus):
    import keras
    import numpy as np
    import pytest

    import tfdist

    from tfdist.keras.handoff import KerasHandoff

    tfdist.ModelAverageStrategy()  # installs the hooks
    assert keras.Model._tfdist_keras_hooks

    class Stop(Exception):
        pass

    class Fake(KerasHandoff):
        def keras_model_event(self, model, method, when):
            raise Stop(method, when)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model._distribute_strategy = Fake()
    x = np.zeros((4, 2), "float32")
    calls = {"evaluate": lambda: model.evaluate(x, x[:, :1], verbose=0),
             "predict": lambda: model.predict(x, verbose=0),
             "save": lambda: model.save("unused.keras"),
             "save_weights": lambda: model.save_weights("unused.weights.h5")}
    for name, call in calls.items():
        with pytest.raises(Stop) as info:
            call()
        assert info.value.args == (name, "before")


def test_route_keras_fit_to_driver_only_for_marked_strategies():
    import keras
    import numpy as np

    from tfdist.keras.handoff import KerasHandoff, install_keras_hooks

    install_keras_hooks()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)  # Keras' own fit
    assert len(history.history["loss"]) == 1

    class Marked(KerasHandoff):
        keras_fit_driver = "tests_fake_fit_driver"

    import sys
    import types

    fake = types.ModuleType("tests_fake_fit_driver")
    fake.evaluate = lambda model, *args, **kwargs: ("driver", args, kwargs)
    sys.modules["tests_fake_fit_driver"] = fake
    try:
        model._distribute_strategy = Marked()
        assert model.evaluate(1, verbose=0) == ("driver", (1,), {"verbose": 0})
    finally:
        del sys.modules["tests_fake_fit_driver"]


def test_atomic_keras_updates_under_a_marked_strategy():
    import keras
    import tensorflow as tf
    from keras.src.backend.common import variables

    from tfdist.keras.handoff import KerasHandoff, install_keras_hooks

    # What the hook replaces: Keras' read-then-write assign_add.
    assert "self.assign(self + value)" in inspect.getsource(variables.Variable.assign_add)
    install_keras_hooks()

    class Atomic(KerasHandoff, tf.distribute.OneDeviceStrategy):
        keras_atomic_updates = True

    strategy = Atomic("/cpu:0")
    with strategy.scope():
        v = keras.Variable(1.0)
        calls = []
        original = type(v.value).assign_add
        type(v.value).assign_add = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
        try:
            v.assign_add(2.0)
            v.assign_sub(0.5)
        finally:
            type(v.value).assign_add = original
    assert calls == [1] and float(v.numpy()) == 2.5
    plain = keras.Variable(1.0)  # outside the marked strategy: Keras' own method
    plain.assign_add(1.0)
    assert float(plain.numpy()) == 2.0


def test_loss_scale_optimizer_check_finite_is_what_apply_calls():
    import inspect

    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    source = inspect.getsource(LossScaleOptimizer)
    assert "self.check_finite" in source and "def check_finite(self, grads)" in source, (
        "LossScaleOptimizer no longer decides through check_finite(grads): "
        "tfdist._hooks.keras no longer makes it global")


def test_keras_gradient_reduce_and_update_step_exist():
    """tfdist replaces _all_reduce_sum_gradients (gradients go through the strategy's
    communicator); its accumulation applies reduced gradients with
    _distributed_tf_update_step."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    for name in ("_all_reduce_sum_gradients", "_distributed_tf_update_step",
                 "_backend_apply_gradients", "_clip_gradients"):
        assert callable(getattr(TFOptimizer, name, None)), f"Keras removed TFOptimizer.{name}"
    import inspect

    params = list(inspect.signature(TFOptimizer._distributed_tf_update_step).parameters)
    assert params == ["self", "distribution", "grads_and_vars", "learning_rate"], params
    assert "self._iterations.assign_add(1)" in inspect.getsource(
        __import__("keras").optimizers.Optimizer.apply), (
        "Keras' apply() no longer adds 1 to _iterations after the step: tfdist's "
        "accumulation (which subtracts 1 on non-update micro-steps) must change")


def test_keras_multi_worker_path_follows_the_mwms_class():
    import tensorflow as tf

    from tfdist._hooks.keras_trainer import keras_uses_multi_worker_path

    class Extended:
        def __init__(self, multi_worker):
            self.multi_worker = multi_worker

        def _in_multi_worker_mode(self):
            return self.multi_worker

    class Subclass(tf.distribute.MultiWorkerMirroredStrategy):
        pass

    def fake(cls, multi_worker):
        strategy = object.__new__(cls)
        strategy._extended = Extended(multi_worker)
        return strategy

    assert keras_uses_multi_worker_path(fake(Subclass, True))
    assert not keras_uses_multi_worker_path(fake(Subclass, False))
    assert not keras_uses_multi_worker_path(fake(tf.distribute.MirroredStrategy, True))


def test_keras_internals_used_by_chief_aware_callbacks():
    """tfdist.keras.callbacks overrides these private Keras methods and attributes."""
    import keras
    from keras.src.backend.tensorflow import trainer

    assert "self._initial_epoch or initial_epoch" in inspect.getsource(
        trainer.TensorFlowTrainer.fit), \
        "tfdist._hooks.keras_trainer.set_initial_epoch no longer resumes fit"
    checkpoint = inspect.getsource(keras.callbacks.ModelCheckpoint)
    assert "filepath = self._get_file_path(epoch, batch, logs)" in checkpoint
    assert "self._save_model(epoch=epoch, batch=None, logs=logs)" in checkpoint
    backup = inspect.getsource(keras.callbacks.BackupAndRestore)
    for needle in ("self._load_model()", "self._save_model()", "self._current_epoch = epoch + 1",
                   "self._last_batch_seen"):
        assert needle in backup, f"BackupAndRestore no longer has {needle}"


def test_keras_trainer_internals_used_by_the_ps_fit_driver():
    import keras
    from keras.src.backend.tensorflow import trainer

    # keras_fit_driver: the strategy a model was built under is kept here.
    assert "self._distribute_strategy = tf.distribute.get_strategy()" in \
        inspect.getsource(trainer.TensorFlowTrainer.__init__)
    for name in ("fit", "evaluate", "predict"):
        assert callable(getattr(keras.Model, name))
    # build_keras_state / keras_initial_epoch / keras_metrics_or_logs / keras_flatten_metrics
    assert "data_batch" in inspect.signature(keras.Model._symbolic_build).parameters
    assert "self._initial_epoch" in inspect.getsource(trainer.TensorFlowTrainer.fit)
    assert callable(keras.Model._get_metrics_result_or_logs)
    assert callable(keras.Model._flatten_metrics_in_order)


# ---- keras_optimizer and keras_trainer: private members tfdist calls ----------------------

def test_apply_replaced_shadows_the_optimizer_apply_then_restores_it():
    """ps_steps takes the gradients of Keras' train_step instead of applying them."""
    import keras
    from keras.src.backend.tensorflow import trainer
    from keras.src.optimizers import base_optimizer

    from tfdist._hooks.keras_optimizer import apply_replaced

    assert "self.optimizer.apply_gradients(" in inspect.getsource(
        trainer.TensorFlowTrainer.train_step) and "self.apply(" in inspect.getsource(
        base_optimizer.BaseOptimizer.apply_gradients), (
        "Keras' train_step no longer hands its gradients to optimizer.apply: "
        "tfdist._hooks.keras_optimizer.apply_replaced sees no gradients")
    optimizer = keras.optimizers.SGD(0.1)
    seen = []
    with apply_replaced(optimizer, lambda grads, variables=None: seen.append(grads)):
        optimizer.apply([1.0])
    assert seen == [[1.0]] and "apply" not in vars(optimizer)
    assert optimizer.apply.__func__ is type(optimizer).apply


def test_optimizer_learning_rate_clip_and_step_count_internals():
    import keras
    import numpy as np

    from tfdist._hooks.keras_optimizer import (clip_gradients, learning_rate_variable,
                                               undo_step_count)

    optimizer = keras.optimizers.SGD(0.5, clipvalue=1.0)
    weight = keras.Variable(np.zeros((2,), "float32"))
    optimizer.build([weight])
    rate = learning_rate_variable(optimizer)
    assert any(rate is v for v in optimizer.variables), (
        "Keras no longer keeps the learning rate variable in _learning_rate: model "
        "averaging would average it as optimizer state")
    (clipped,) = clip_gradients(optimizer, [np.array([3.0, -0.5], "float32")])
    np.testing.assert_allclose(np.asarray(clipped), [1.0, -0.5])
    optimizer.apply([np.ones((2,), "float32")], [weight])
    assert int(optimizer.iterations.numpy()) == 1
    undo_step_count(optimizer)
    assert int(optimizer.iterations.numpy()) == 0


def test_compiled_loss_changes_with_each_compile():
    import keras

    from tfdist._hooks.keras_trainer import compiled_loss

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert compiled_loss(model) is None
    model.compile("sgd", "mse")
    first = compiled_loss(model)
    assert first is not None, "Keras no longer keeps the compiled loss in _compile_loss"
    model.compile("sgd", "mae")
    assert compiled_loss(model) is not first


def test_keras_clips_in_apply_before_its_all_reduce():
    """tfdist._hooks.keras reduces before Keras' ``_backend_apply_gradients`` clips, and
    skips ``_all_reduce_sum_gradients`` inside it: both must still be where Keras clips."""
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.optimizers import base_optimizer

    source = inspect.getsource(base_optimizer.BaseOptimizer._backend_apply_gradients)
    assert "self._clip_gradients(" in source and "self._backend_update_step(" in source, (
        "Keras no longer clips in _backend_apply_gradients before _backend_update_step: "
        "tfdist's clipping after the reduction must be rewritten")
    step_source = inspect.getsource(tf_optimizer.TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(" in step_source
