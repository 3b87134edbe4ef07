"""Each private TF/Keras hook in tfdist/_hooks.py still exists in this TF/Keras.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect

import pytest


def test_mirrored_reads_collective_key_base():
    from tensorflow.python.distribute import mirrored_strategy

    source = inspect.getsource(mirrored_strategy.MirroredExtended.__init__)
    assert "container_strategy._collective_key_base" in source, (
        "MirroredExtended no longer reads _collective_key_base: "
        "tfdist._hooks.assign_collective_key_base does nothing now")


def test_collective_key_base_is_distinct_per_instance(logical_cpus):
    import tfdist

    first = tfdist.MirroredStrategy(cross_device_ops="collective")
    second = tfdist.MirroredStrategy(cross_device_ops="collective")
    assert first.extended._collective_key_base != second.extended._collective_key_base


def test_tf_distribute_internals_for_horovod_strategy():
    import inspect

    from tensorflow.python.distribute import cross_device_ops

    from tfdist import _hooks

    internals = _hooks.tf_distribute_internals()
    for name in ("simple_broadcast", "reduce_non_distributed_value", "get_distributed_dataset",
                 "get_distributed_datasets_from_function", "regroup", "is_mirrored"):
        assert callable(getattr(internals, name)), name
    # HorovodExtended overrides these MirroredExtended members; TF must still call them.
    for name in ("_reduce_to", "_batch_reduce_to", "_gather_to_implementation",
                 "_experimental_distribute_dataset", "_distribute_datasets_from_function",
                 "_experimental_distribute_values_from_function", "_create_variable",
                 "_get_cross_device_ops", "_use_merge_call", "_in_multi_worker_mode",
                 "_input_workers_with_options", "_num_replicas_in_sync"):
        assert hasattr(internals.MirroredExtended, name), name
    assert "input_context" in inspect.signature(internals.get_distributed_dataset).parameters
    # HorovodCrossDeviceOps relies on this to stop reductions being skipped.
    assert "_num_between_graph_workers" in inspect.getsource(cross_device_ops.CrossDeviceOps.reduce)
    assert "_num_between_graph_workers" in inspect.getsource(
        cross_device_ops.CrossDeviceOps.batch_reduce)


def test_keras_multi_worker_path_follows_the_mwms_class():
    import tensorflow as tf

    from tfdist import _hooks

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

    assert _hooks.keras_uses_multi_worker_path(fake(Subclass, True))
    assert not _hooks.keras_uses_multi_worker_path(fake(Subclass, False))
    assert not _hooks.keras_uses_multi_worker_path(fake(tf.distribute.MirroredStrategy, True))


# ---- the Keras hand-off: install_keras_hooks ----------------------------------------------

def test_keras_optimizer_step_has_the_points_model_averaging_replaces():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.losses import loss as loss_module
    from keras.src.optimizers import base_optimizer

    apply_source = inspect.getsource(base_optimizer.BaseOptimizer.apply)
    assert "self._backend_apply_gradients(" in apply_source, (
        "Keras' apply no longer calls _backend_apply_gradients: "
        "tfdist._hooks.install_keras_hooks would not see the optimizer step")
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

    from tfdist import _hooks

    tfdist.ModelAverageStrategy()  # installs the hooks
    assert keras.Model._tfdist_keras_hooks

    class Stop(Exception):
        pass

    class Fake(_hooks.KerasHandoff):
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


# ---- multi-worker (tfdist.strategies.multi_worker, tfdist.keras.callbacks) ---------------


def test_multi_worker_strategy_init_is_still_what_tfdist_replays():
    """tfdist builds the extended object itself; TF's __init__ must still only do that."""
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    from tfdist import _hooks

    assert _hooks.collective_all_reduce_extended_class() is cars.CollectiveAllReduceExtended
    assert tf.distribute.MultiWorkerMirroredStrategy is cars.CollectiveAllReduceStrategy
    source = inspect.getsource(cars.CollectiveAllReduceStrategy.__init__)
    assert "CollectiveAllReduceExtended(" in source and "super(CollectiveAllReduceStrategy" \
        in source, "MultiWorkerMirroredStrategy.__init__ changed: re-check tfdist's __init__"
    assert hasattr(cars.CollectiveAllReduceExtended, "_in_multi_worker_mode")


def test_multi_worker_keeps_a_preconfigured_coordination_service():
    """tfdist configures the coordination service first; TF must not overwrite it."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    from tensorflow.python.eager import context

    fields = coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    for field in ("cluster_register_with_barrier", "cluster_register_timeout_in_ms",
                  "heartbeat_timeout_in_ms", "coordinated_job_list"):
        assert field in fields, f"coordination config lost {field}"
    source = inspect.getsource(cars.CollectiveAllReduceExtended._initialize_multi_worker)
    assert "context.context().coordination_service is None" in source
    assert "cluster_register_timeout_in_ms" in inspect.signature(
        context.Context.configure_coordination_service).parameters
    assert isinstance(context.Context.coordination_service, property)


def test_keras_internals_used_by_chief_aware_callbacks():
    """tfdist.keras.callbacks overrides these private Keras methods and attributes."""
    import keras
    from keras.src.backend.tensorflow import trainer

    assert "self._initial_epoch or initial_epoch" in inspect.getsource(
        trainer.TensorFlowTrainer.fit), "_hooks.set_initial_epoch no longer resumes fit"
    checkpoint = inspect.getsource(keras.callbacks.ModelCheckpoint)
    assert "filepath = self._get_file_path(epoch, batch, logs)" in checkpoint
    assert "self._save_model(epoch=epoch, batch=None, logs=logs)" in checkpoint
    backup = inspect.getsource(keras.callbacks.BackupAndRestore)
    for needle in ("self._load_model()", "self._save_model()", "self._current_epoch = epoch + 1",
                   "self._last_batch_seen"):
        assert needle in backup, f"BackupAndRestore no longer has {needle}"


# ---- parameter server ---------------------------------------------------------------------

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


def test_route_keras_fit_to_driver_only_for_marked_strategies():
    import keras
    import numpy as np

    from tfdist import _hooks

    _hooks.install_keras_hooks()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)  # Keras' own fit
    assert len(history.history["loss"]) == 1

    class Marked(_hooks.KerasHandoff):
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


def test_cluster_coordinator_internals_for_per_worker_inputs_and_pinned_steps():
    from tensorflow.python.distribute import input_lib
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.distribute.coordinator import values

    # create_per_worker_iterators
    assert callable(cc.Worker.create_resource)
    assert "self.workers" in inspect.getsource(cc.Cluster.__init__)
    assert callable(values.PerWorkerDistributedIterator)
    assert callable(input_lib.get_iterator_spec_from_dataset)
    # schedule_on_worker: a tagged closure is handed out without counting it in flight,
    # and a normal closure is marked finished (or put back untagged) by the worker.
    source = inspect.getsource(cc._CoordinatedClosureQueue)
    for name in ("_queue_lock", "_tagged_queue", "_closures_queued_condition",
                 "_cancellation_mgr", "def _raise_if_error", "def inflight_closure_count"):
        assert name in source, name
    get = inspect.getsource(cc._CoordinatedClosureQueue.get)
    assert get.index("self._tagged_queue[tag].get") < get.index("inflight_closure_count += 1")
    assert "assert closure.tag is None" in inspect.getsource(cc._CoordinatedClosureQueue.put_back)
    assert "mark_finished()" in inspect.getsource(cc.Worker._process_closure)
    assert list(inspect.signature(cc.Closure.__init__).parameters)[:3] == \
        ["self", "function", "cancellation_mgr"]


def test_dataset_copier_rebuilds_the_dataset():
    import tensorflow as tf

    from tfdist import _hooks

    dataset = tf.data.Dataset.range(10).map(lambda i: i * 2).batch(4)
    copy = tf.function(_hooks.dataset_copier(dataset))()
    assert [b.numpy().tolist() for b in copy] == [b.numpy().tolist() for b in dataset]


def test_atomic_keras_updates_under_a_marked_strategy():
    import keras
    import tensorflow as tf
    from keras.src.backend.common import variables

    from tfdist import _hooks

    # What the hook replaces: Keras' read-then-write assign_add.
    assert "self.assign(self + value)" in inspect.getsource(variables.Variable.assign_add)
    _hooks.install_keras_hooks()

    class Atomic(_hooks.KerasHandoff, tf.distribute.OneDeviceStrategy):
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


def test_shard_aware_gradients_join_shard_gradients():
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.distribute import parameter_server_strategy as pss

    from tfdist import _hooks

    # What the gradient hook works around, and what allow_sharded_updates replaces.
    from keras.src.backend.tensorflow import core

    assert "self.value.handle" in inspect.getsource(core.Variable.handle.fget)
    assert "colocate_with(var)" in inspect.getsource(pss.ParameterServerStrategyExtended._update)
    for name in ("_select_single_value", "_local_results"):
        assert hasattr(pss.ParameterServerStrategyExtended, name)

    table = np.arange(12, dtype="float32").reshape(6, 2)
    sharded = tf.__internal__.distribute.ShardedVariable(
        [tf.Variable(table[:4]), tf.Variable(table[4:])])
    plain = tf.Variable(table)
    ids = tf.constant([0, 5, 5, 2])

    class Holder:  # stands for a Keras variable whose value is sharded
        value = sharded

    with _hooks.shard_aware_gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(sharded), ids) ** 2)
        (grad,) = tape.gradient(loss, [Holder()])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(plain, ids) ** 2)
    (expected,) = tape.gradient(loss, [plain])
    np.testing.assert_allclose(tf.convert_to_tensor(grad), tf.convert_to_tensor(expected))
    assert tf.GradientTape.gradient.__name__ == "gradient"  # restored


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


def test_keras_backup_and_restore_private_paths(tmp_path):
    import os

    import keras

    from tfdist import _hooks

    callback = keras.callbacks.BackupAndRestore(str(tmp_path))
    for attribute, name in _hooks._BACKUP_PATHS.items():
        assert getattr(callback, attribute) == os.path.join(str(tmp_path), name), (
            f"keras BackupAndRestore.{attribute} changed: keras_callbacks_write_elsewhere "
            "would write the chief's backup from other workers")


def test_keras_callbacks_write_elsewhere_redirects_and_restores(tmp_path):
    import keras

    from tfdist import _hooks

    real = {"checkpoint": str(tmp_path / "m.keras"), "csv": str(tmp_path / "log.csv"),
            "tb": str(tmp_path / "tb"), "backup": str(tmp_path / "backup")}
    callbacks = [keras.callbacks.ModelCheckpoint(real["checkpoint"]),
                 keras.callbacks.CSVLogger(real["csv"]),
                 keras.callbacks.TensorBoard(real["tb"]),
                 keras.callbacks.BackupAndRestore(real["backup"])]
    with _hooks.keras_callbacks_write_elsewhere(callbacks, "worker-1"):
        checkpoint, csv, tensorboard, backup = callbacks
        assert "tfdist-worker-1-" in checkpoint.filepath and checkpoint.filepath.endswith(
            "m.keras")
        assert "tfdist-worker-1-" in csv.filename and "tfdist-worker-1-" in tensorboard.log_dir
        assert "on_train_begin" in vars(backup)
    assert [callbacks[0].filepath, callbacks[1].filename, callbacks[2].log_dir,
            callbacks[3].backup_dir] == list(real.values())
    assert "on_train_begin" not in vars(callbacks[3])


def test_tf_data_compute_batch_size():
    import tensorflow as tf

    from tfdist import _hooks

    batched = tf.data.Dataset.range(10).batch(4).prefetch(2)
    assert _hooks.dataset_batch_size(batched) == 4, (
        "TF's compute_batch_size changed: the uneven-global-batch check misses datasets")


def test_loss_scale_optimizer_check_finite_is_what_apply_calls():
    import inspect

    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    source = inspect.getsource(LossScaleOptimizer)
    assert "self.check_finite" in source and "def check_finite(self, grads)" in source, (
        "LossScaleOptimizer no longer decides through check_finite(grads): "
        "tfdist._hooks.install_global_loss_scale_check no longer makes it global")


def test_cluster_coordinator_internals_for_the_step_deadline():
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.distribute.coordinator import values

    # track_running_closures: a worker thread runs each closure through the instance's
    # _process_closure, and reports a failed worker through _on_closure_failure.
    process_queue = inspect.getsource(cc.Worker._process_queue)
    assert "self._process_closure(closure)" in process_queue
    assert "self._on_closure_failure(closure, e)" in inspect.getsource(
        cc.Worker._process_closure)
    assert "put_back(closure)" in inspect.getsource(cc.Worker._on_closure_failure)
    # wait_for_closures / wait_for_remote_value: the timeouts join() and fetch() lack.
    assert "timeout" in inspect.signature(cc._CoordinatedClosureQueue.wait).parameters
    assert "self._status_available_event.set()" in inspect.getsource(
        values.RemoteValueImpl._set_values)


def _sharded_keras_variable(value, shards):
    """A Keras variable whose value is a ShardedVariable of ``shards`` shards on axis 0,
    as a partitioner under a parameter-server strategy makes it."""
    import keras
    import numpy as np
    import tensorflow as tf

    variable = keras.Variable(np.zeros_like(value))
    variable._value = tf.__internal__.distribute.ShardedVariable(
        [tf.Variable(part) for part in np.array_split(value, shards)])
    return variable


def test_sharded_variables_save_and_restore_through_keras_and_checkpoints(tmp_path):
    import inspect

    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow.core import Variable
    from tensorflow.python.checkpoint import restore, save_util
    from tensorflow.python.training.saving import saveable_object_util

    from tfdist import _sharded_io

    # The private pieces tfdist._sharded_io relies on.
    assert "_value" in vars(keras.Variable(1.0))
    assert "_gather_saveables_for_checkpoint" in vars(tf.__internal__.distribute.ShardedVariable
                                                       .__mro__[1])
    for module in (save_util, restore):
        assert "saveable_object_util.trackable_has_serialize_to_tensor" in \
            inspect.getsource(module), (
                f"{module.__name__} no longer looks up trackable_has_serialize_to_tensor "
                "on its module: tfdist._sharded_io's patch of it does nothing now")
    _sharded_io.install()
    _sharded_io.install()  # idempotent
    table = np.arange(40, dtype="float32").reshape(10, 4)
    two = _sharded_keras_variable(table, 2)
    assert not saveable_object_util.trackable_has_serialize_to_tensor(two)
    assert saveable_object_util.trackable_has_serialize_to_tensor(keras.Variable(table))
    assert isinstance(two, Variable)
    # Keras' saving reads with np.array / numpy() and writes with assign.
    np.testing.assert_array_equal(np.array(two), table)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(two), table)
    np.testing.assert_array_equal(two.numpy(), table)
    two.assign(table + 1)
    np.testing.assert_array_equal(two.value.variables[1].numpy(), table[5:] + 1)
    two.assign(table)
    # tf.train.Checkpoint: slices of one tensor, restorable into any number of shards.
    saved = tf.train.Checkpoint(v=two).write(str(tmp_path / "two"))
    for target in (_sharded_keras_variable(0 * table, 3), _sharded_keras_variable(0 * table, 1),
                   keras.Variable(0 * table)):
        tf.train.Checkpoint(v=target).read(saved).assert_consumed()
        np.testing.assert_array_equal(np.array(target), table)
    plain = tf.train.Checkpoint(v=keras.Variable(table)).write(str(tmp_path / "plain"))
    three = _sharded_keras_variable(0 * table, 3)
    tf.train.Checkpoint(v=three).read(plain).assert_consumed()
    np.testing.assert_array_equal(np.array(three), table)


def _keras_variable_over_shards(table, rows):
    """A Keras variable whose value is a `ShardedVariable` split after ``rows`` rows, as a
    partitioner under ParameterServerStrategy makes it."""
    import keras
    import tensorflow as tf

    parts = [tf.Variable(table[:rows]), tf.Variable(table[rows:])]

    def creator(next_creator, **kwargs):
        return tf.__internal__.distribute.ShardedVariable(parts)

    with tf.variable_creator_scope(creator):
        return keras.Variable(initializer="zeros", shape=table.shape, dtype="float32",
                              name="table")


def test_sharded_optimizer_state_keras_internals():
    """What install_sharded_optimizer_state replaces and relies on (Keras/TF private)."""
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers import base_optimizer

    from tfdist import _hooks

    # Keras colocates each slot with the variable's value: a ShardedVariable's is on the chief.
    add = TFOptimizer.add_variable_from_reference
    assert "colocate_vars_with" in inspect.getsource(getattr(add, "_tfdist_original", add))
    update = TFOptimizer._distributed_tf_update_step
    assert "distribution.extended.update(" in inspect.getsource(
        getattr(update, "_tfdist_original", update))
    params = list(inspect.signature(
        base_optimizer.BaseOptimizer.add_variable_from_reference).parameters)
    assert params == ["self", "reference_variable", "name", "initializer"], params
    assert "self.add_variable(" in inspect.getsource(
        base_optimizer.BaseOptimizer.add_variable_from_reference)
    # Slot lookup by the private index dict and _var_key; ShardedVariable's key.
    assert "self._trainable_variables_indices[self._var_key(variable)]" in inspect.getsource(
        base_optimizer.BaseOptimizer._get_variable_index)
    assert "_unique_id" in inspect.getsource(TFOptimizer._var_key)
    sharded = tf.__internal__.distribute.ShardedVariable([tf.Variable([1.0]), tf.Variable([2.0])])
    assert isinstance(sharded._unique_id, str) and len(sharded.variables) == 2
    # Keras' TF variable keeps its value in _value, and reads and writes through it.
    from keras.src.backend.tensorflow.core import Variable
    from keras.src.backend.common.variables import Variable as KerasVariable

    assert "self._value" in inspect.getsource(Variable._initialize)
    assert "self._value" in inspect.getsource(KerasVariable.value.fget)
    assert "variable.value" in inspect.getsource(TFOptimizer.assign_add)
    for name in _hooks.ELEMENTWISE_OPTIMIZERS:
        assert callable(getattr(keras.optimizers, name).update_step), name


@pytest.mark.parametrize("block_rows", [None, 2])
def test_sharded_optimizer_state_shards_slots_and_updates_shard_by_shard(
        monkeypatch, block_rows):
    """Slots sharded like their variable, one update per shard (or per block of rows of
    a shard, as for a large shard: ``block_rows``), equal to the unsharded update."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import _hooks

    if block_rows:
        monkeypatch.setattr(_hooks, "UPDATE_BLOCK_BYTES", block_rows * 3 * 4)  # 3 float32
    _hooks.install_shard_aware_gradients()
    _hooks.install_sharded_optimizer_state()
    table = np.random.default_rng(0).normal(size=(7, 3)).astype("float32")
    ids = tf.constant([0, 6, 6, 2, 4])
    for make in (lambda: keras.optimizers.Adam(0.1), lambda: keras.optimizers.SGD(0.1, 0.9),
                 lambda: keras.optimizers.RMSprop(0.1, centered=True)):
        sharded, plain = _keras_variable_over_shards(table, 4), keras.Variable(table)
        sharded_opt, plain_opt = make(), make()
        sharded_opt.build([sharded])
        seen = []
        update_step = sharded_opt.update_step

        def recording_update_step(gradient, variable, learning_rate, update_step=update_step):
            seen.append(tuple(variable.shape))
            return update_step(gradient, variable, learning_rate)

        sharded_opt.update_step = recording_update_step
        slots = _hooks.sharded_slots(sharded_opt, sharded)
        assert slots and len(slots) == len(sharded_opt.variables) - 2  # all but iteration, lr
        for slot in slots:
            assert [tuple(p.shape) for p in slot.value.variables] == [(4, 3), (3, 3)]
            assert [p.device for p in slot.value.variables] == \
                [p.device for p in sharded.value.variables]

        @tf.function
        def sharded_step(scale):
            with tf.GradientTape() as tape:  # a sparse gradient, then a dense one
                loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(sharded), ids) ** 2)
                loss += scale * tf.reduce_sum(tf.convert_to_tensor(sharded))
            sharded_opt.apply(tape.gradient(loss, [sharded]), [sharded])

        for step in range(3):
            sharded_step(tf.constant(float(step)))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(plain), ids) ** 2)
                loss += float(step) * tf.reduce_sum(tf.convert_to_tensor(plain))
            plain_opt.apply(tape.gradient(loss, [plain]), [plain])
        # Traced once: one update per shard, or per block of rows of each shard.
        assert seen == ([(2, 3), (2, 3), (2, 3), (1, 3)] if block_rows else
                        [(4, 3), (3, 3)]), seen
        np.testing.assert_allclose(tf.convert_to_tensor(sharded.value), plain.numpy(),
                                   atol=1e-6, rtol=0)
        for got, want in zip(sharded_opt.variables, plain_opt.variables):
            np.testing.assert_allclose(tf.convert_to_tensor(got.value), want.numpy(),
                                       atol=1e-6, rtol=0, err_msg=got.path)
    assert _hooks.updates_shard_by_shard(keras.optimizers.AdamW())
    assert not _hooks.updates_shard_by_shard(keras.optimizers.Lamb())  # layer-wise norms


def test_sharded_embedding_lookup_gathers_shard_by_shard():
    """Keras' Embedding.call is still ops.take on the whole table (what the hook replaces
    for sharded tables); the shard-by-shard lookup and its gradient equal Keras' own."""
    import inspect

    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.layers.core.embedding import Embedding

    from tfdist import _hooks

    _hooks.install_sharded_embedding_lookup()
    _hooks.install_shard_aware_gradients()
    original = Embedding.call._tfdist_original
    assert "ops.take(self.embeddings, inputs, axis=0)" in inspect.getsource(original), (
        "Keras' Embedding.call changed: review tfdist._hooks.install_sharded_embedding_lookup")
    table = np.arange(40, dtype="float32").reshape(10, 4) / 7
    ids = np.array([[0, 9, 3], [4, 4, 7]], dtype="int64")
    for sizes, shard_by_shard in (([4, 3, 3], True), ([2, 8], False)):
        layer = Embedding(10, 4)
        layer.build((None, 3))
        parts = np.split(table, np.cumsum(sizes)[:-1])
        layer._embeddings._value = tf.__internal__.distribute.ShardedVariable(
            [tf.Variable(p) for p in parts])
        assert _hooks.div_partitioned(_hooks.sharded_parts(layer._embeddings)) == shard_by_shard
        with tf.GradientTape() as tape:
            out = layer(ids)
            loss = tf.reduce_sum(out * out)
        grad = tape.gradient(loss, layer._embeddings)
        np.testing.assert_array_equal(out.numpy(), table[ids])
        expected = np.zeros_like(table)
        np.add.at(expected, ids.ravel(), 2 * table[ids].reshape(-1, 4))
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), expected, rtol=1e-6)
        np.testing.assert_array_equal(tf.function(layer)(ids).numpy(), table[ids])
    plain = Embedding(10, 4)
    plain.build((None, 3))
    plain._embeddings.assign(table)
    np.testing.assert_array_equal(plain(ids).numpy(), table[ids])
    assert isinstance(keras.layers.Embedding(2, 2), Embedding)


def test_exactly_once_call_is_kept_out_of_line():
    """tfdist.keras.ps_steps._once relies on tf.function's private ``_noinline``
    attribute (a step's update must run as one call, not inlined into the step)."""
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import attributes

    assert attributes.NO_INLINE == "_noinline", "review tfdist.keras.ps_steps._once"
    inner = tf.function(lambda x: x + 1, autograph=False,
                        experimental_attributes={"_noinline": True})
    outer = tf.function(lambda x: inner(x) * 2, autograph=False)
    graph = outer.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    calls = [op for op in graph.get_operations() if "PartitionedCall" in op.type]
    assert len(calls) == 1, [op.type for op in graph.get_operations()]
    callee = library[calls[0].get_attr("f").name]
    assert callee.attr["_noinline"].b, "TF dropped _noinline: review ps_steps._once"


def test_initial_rows_of_a_shard_are_the_whole_draws_rows():
    """A shard's initial value drawn alone equals the same rows of the whole draw, bit
    for bit (TF's Philox counter, 4 float32 per step); other initializers say None."""
    import inspect

    import keras
    import numpy as np
    from tensorflow.python.distribute import parameter_server_strategy_v2 as ps_v2

    from tfdist import _hooks

    assert "partition_shape=partition_shape, partition_offset=partition_offset" in \
        inspect.getsource(ps_v2.ParameterServerStrategyV2Extended._create_variable), \
        "TF no longer passes each shard's rows to the initial value: review initial_rows"
    shape = (1001, 6)
    init = keras.initializers
    for initializer in (init.RandomUniform(-0.05, 0.05), init.get("uniform"),
                        init.GlorotUniform(), init.HeUniform(seed=3), init.RandomNormal(0.1, 2.),
                        init.VarianceScaling(2.0, "fan_avg", "untruncated_normal"),
                        init.Zeros(), init.Constant(3.0)):
        whole = np.asarray(initializer(shape, dtype="float32"))
        for start, rows in ((0, 334), (334, 334), (668, 333), (2, 5)):
            part = _hooks.initial_rows(initializer, shape, "float32", (rows, 6), (start, 0))
            np.testing.assert_array_equal(np.asarray(part), whole[start:start + rows],
                                          err_msg=type(initializer).__name__)
    for initializer in (init.TruncatedNormal(), init.Orthogonal(), init.GlorotNormal(),
                        init.RandomUniform(seed=keras.random.SeedGenerator(1))):
        assert _hooks.initial_rows(initializer, shape, "float32", (5, 6), (4, 0)) is None
    assert _hooks.initial_rows(init.RandomUniform(), (9, 1), "float32", (4, 1), (5, 0)) \
        is None  # row 5 starts inside a counter step
    assert _hooks.initial_rows(init.RandomUniform(), shape, "float64", (5, 6), (4, 0)) is None


def test_keras_variable_initialization_is_what_the_shaped_version_replays():
    """tfdist passes shape= to the tf.Variable Keras creates (under a partitioner):
    Keras' own creation must still be these calls."""
    import inspect

    from keras.src.backend.tensorflow.core import Variable

    from tfdist import _hooks

    _hooks.install_shard_sized_initialization()
    original = Variable._initialize_with_initializer._tfdist_original
    assert "self._initialize(lambda: initializer(self._shape, dtype=self._dtype))" in (
        inspect.getsource(original)), "review tfdist._hooks.install_shard_sized_initialization"
    source = inspect.getsource(Variable._initialize)
    for piece in ("tf.Variable(", "dtype=self._dtype", "trainable=self.trainable",
                  "name=self.name", "aggregation=self._map_aggregation(self.aggregation)",
                  "synchronization=self._map_synchronization(self.synchronization)"):
        assert piece in source, f"Keras' Variable._initialize no longer has {piece}"
