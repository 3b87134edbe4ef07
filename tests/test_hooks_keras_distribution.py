"""What tfdist/_hooks/keras_distribution.py patches still exists in this Keras.

If one of these fails after a Keras upgrade, the hook it names must be rewritten:
``keras.distribution`` would otherwise train on one device again, silently.
"""

import inspect

import pytest


def test_keras_public_functions_call_the_backend_module_by_name():
    from keras.src.distribution import distribution_lib

    from tfdist._hooks.keras_distribution import BACKEND_FUNCTIONS

    for name in ("list_devices", "get_device_count", "initialize", "distribute_tensor"):
        source = inspect.getsource(getattr(distribution_lib, name))
        assert f"distribution_lib.{name}(" in source, (
            f"keras.distribution.{name} no longer calls the backend's {name}: tfdist's "
            "replacement (patched into the TF backend module) would not run")
    init = inspect.getsource(distribution_lib.Distribution.__init__)
    assert 'hasattr(distribution_lib, "num_processes")' in init and "process_id()" in init, (
        "Distribution no longer asks the backend for num_processes/process_id: a "
        "multi-worker job would not shard its dataset")
    assert set(BACKEND_FUNCTIONS) >= {"num_processes", "process_id"}


def test_scope_and_the_data_adapter_go_through_the_patched_points():
    from keras.src.distribution import distribution_lib
    from keras.src.trainers import data_adapters
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    assert "set_distribution(self)" in inspect.getsource(
        distribution_lib.Distribution.scope), (
        "Distribution.scope no longer calls the module's set_distribution: `with "
        "distribution.scope():` would not make the tfdist strategy current")
    assert "distribution.distribute_dataset(" in inspect.getsource(
        tf_dataset_adapter.TFDatasetAdapter.__init__), (
        "Keras' tf.data adapter no longer calls Distribution.distribute_dataset")
    assert "distribution_lib.distribution()" in inspect.getsource(
        data_adapters.get_data_adapter)


def test_keras_skips_its_own_distribute_for_a_distributed_dataset():
    from keras.src.backend.tensorflow import trainer

    source = inspect.getsource(trainer.TFEpochIterator.__init__)
    assert "tf.distribute.DistributedDataset" in source, (
        "TFEpochIterator now re-distributes every dataset: each worker's Keras shard "
        "would be split again by TF")


def test_tf_variables_are_created_through_initialize():
    from keras.src.backend.common import variables
    from keras.src.backend.tensorflow.core import Variable
    from keras.src.distribution import distribution_lib

    # Keras' own method under any tfdist patches (each names what it wraps).
    assert "self._initialize(" in inspect.getsource(
        inspect.unwrap(Variable._initialize_with_initializer))
    common = inspect.getsource(variables.Variable.__init__)
    assert "self._initialize(initializer)" in common and "self._layout = layout" in common
    assert "self._layout_map[variable.path]" in inspect.getsource(
        distribution_lib.ModelParallel.get_variable_layout), (
        "ModelParallel no longer keeps its LayoutMap in _layout_map "
        "(tfdist._hooks.keras_distribution.layout_map_of)")


def test_import_tfdist_installs_the_patches():
    import keras
    from keras.src.backend.tensorflow import distribution_lib as backend
    from keras.src.backend.tensorflow.core import Variable

    import tfdist  # noqa: F401
    from tfdist._hooks import keras_distribution as hooks
    from tfdist.keras import distribution as api

    assert hooks.is_installed()
    assert backend.list_devices is api.list_devices and backend.process_id is api.process_id
    assert keras.distribution.set_distribution.__wrapped__ is not None
    # Other tfdist patches (split variables) may wrap it since: each names what it wraps.
    chain, patch = [], Variable._initialize
    while patch is not None:
        chain.append(patch)
        patch = getattr(patch, "__wrapped__", None)
    assert any(p.__name__ == "_initialize" and "check_variable_layout" in p.__code__.co_names
               for p in chain)


@pytest.mark.multiprocess
def test_keras_imported_before_tfdist_is_patched_too():
    """``import keras`` first: the patch lands on the loaded modules and the public
    re-export (the other order, tfdist first, is the test process's own)."""
    import os
    import subprocess
    import sys

    code = ("import keras, tfdist\n"
            "from tfdist.keras import distribution as api\n"
            "assert keras.distribution.set_distribution.__wrapped__ is not None\n"
            "assert keras.src.backend.tensorflow.distribution_lib.process_id is api.process_id\n"
            "print('patched', keras.distribution.list_devices())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KERAS_BACKEND": "tensorflow"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("patched ['cpu:0'")


def test_keras_keeps_the_strategy_a_model_and_an_optimizer_were_made_under():
    """`built_under` and `_check_optimizer` read Keras' private strategy fields."""
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow import optimizer, trainer

    from tfdist._hooks.keras_distribution import MODEL_CALLS, built_under

    assert "self._distribute_strategy = tf.distribute.get_strategy()" in inspect.getsource(
        trainer.TensorFlowTrainer.__init__), (
        "Keras' TF trainer no longer records the strategy a model is built under in "
        "_distribute_strategy: models built before set_distribution would run under it")
    assert "self._distribution_strategy = tf.distribute.get_strategy()" in \
        inspect.getsource(optimizer.TFOptimizer.__init__)
    assert all(callable(getattr(keras.Model, name)) for name in MODEL_CALLS)
    assert built_under(keras.Sequential([keras.Input((2,))])) is None
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        assert built_under(keras.Sequential([keras.Input((2,))])) is strategy
