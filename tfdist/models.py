"""Built-in models of the main job, and loading the user's own ``module:function``."""

from __future__ import annotations

import importlib
import math


def build_model(model_config: dict, input_shape: tuple, num_classes: int):
    """Builds the model a config names (uncompiled, logits out).

    ``mlp``: dense layers of ``hidden`` units. ``cnn``: two small conv layers on the
    input reshaped to a square image. ``module:function``: ``function(input_shape,
    num_classes, **options)`` from the user's module, which returns a Keras model.
    """
    import keras

    name = model_config["name"]
    if ":" in name:
        module_name, _, function_name = name.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"model.name {name!r} cannot be loaded: {error}") from None
        return function(input_shape, num_classes)
    inputs = keras.Input(input_shape)
    x = inputs
    if name == "cnn":
        side = int(math.isqrt(int(math.prod(input_shape))))
        if side * side != math.prod(input_shape):
            raise ValueError(f"model 'cnn' needs square images; input shape {input_shape} "
                             "is not a square")
        x = keras.layers.Reshape((side, side, 1))(x)
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    for units in model_config["hidden"]:
        x = keras.layers.Dense(units, activation="relu")(x)
        if model_config["dropout"]:
            x = keras.layers.Dropout(model_config["dropout"])(x)
    outputs = keras.layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name=name)


def build_optimizer(train_config: dict):
    import keras

    if train_config["optimizer"] == "sgd":
        return keras.optimizers.SGD(train_config["learning_rate"],
                                    momentum=train_config["momentum"])
    return keras.optimizers.Adam(train_config["learning_rate"])
