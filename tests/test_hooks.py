"""Each private TF/Keras hook in tfdist/_hooks.py still exists in this TF/Keras.

If one of these fails after an upgrade, the hook it names must be rewritten: tfdist
would otherwise fall back to a different behaviour silently.
"""

import inspect


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
