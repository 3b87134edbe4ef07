"""Keras sees whole variables under every strategy (issue 40): ``count_params()``,
``summary()``'s total, every model and optimizer variable's ``shape`` and
``set_weights(get_weights())`` are what a plain model reports, however the variables
are stored, as on Keras with JAX. Here on 2 logical CPUs (MirroredStrategy,
``shard_parameters=True``, ModelParallelStrategy on 1 x 2 and Keras' ModelParallel);
the 2 x 2 mesh in tests/test_tensor_parallel_mesh.py."""

import numpy as np
import pytest

from helpers import assert_weights_close, layout_map
from tp_jobs import HEADS, PAIR, attention_block, attention_data, keras_facts, pair, train

CASES = {"pair": (pair, "adam", None), "attention": (attention_block, "sgd", attention_data())}


def _strategies():
    import tfdist

    return {
        "mirrored": lambda: tfdist.MirroredStrategy(),
        "shard_parameters": lambda: tfdist.MirroredStrategy(shard_parameters=True,
                                                            min_shard_elements=1),
        "model_parallel_1x2": lambda: tfdist.ModelParallelStrategy(
            layout_map={**PAIR, **HEADS}),
    }


def _facts(strategy, name):
    build, optimizer, xy = CASES[name]
    x, y = xy if xy is not None else (None, None)
    weights, model = train(strategy, build, optimizer=optimizer, x=x, y=y, epochs=1)
    return weights, keras_facts(model)


@pytest.fixture(scope="module")
def plain():
    return {name: _facts(None, name) for name in CASES}


@pytest.mark.parametrize("kind", ["mirrored", "shard_parameters", "model_parallel_1x2"])
def test_keras_reports_the_plain_models_shapes(logical_cpus, plain, kind):
    for name in CASES:
        weights, facts = _facts(_strategies()[kind](), name)
        assert facts == plain[name][1], name
        assert facts["round_trip"], name
        assert_weights_close(weights, plain[name][0], atol=1e-5)


def test_keras_model_parallel_reports_the_plain_models_shapes(logical_cpus, plain):
    import keras

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(PAIR.items(), shape=(1, 2))))
    try:
        weights, facts = _facts(None, "pair")
    finally:
        keras.distribution.set_distribution(None)
    assert facts == plain["pair"][1]
    assert_weights_close(weights, plain["pair"][0], atol=1e-5)


def test_set_weights_takes_whole_values_and_refuses_slices(logical_cpus):
    import tfdist

    _, model = train(tfdist.ModelParallelStrategy(layout_map=PAIR), pair, epochs=1)
    rng = np.random.default_rng(3)
    new = [rng.normal(size=w.shape).astype("float32") for w in model.get_weights()]
    model.set_weights(new)
    assert_weights_close(model.get_weights(), new, atol=0)
    kernel = model.get_layer("up").kernel
    with pytest.raises(ValueError, match="shape"):
        model.set_weights([w[..., :w.shape[-1] // 2] if w.ndim == 2 else w for w in new])
    assert tuple(kernel.shape) == new[0].shape
