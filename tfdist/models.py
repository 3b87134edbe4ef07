"""Built-in models of the main job, and loading the user's own ``module:function``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import os
import sys


def _import_path() -> None:
    """Lets ``module:function`` name a module in the working directory, as ``python -m``
    does (the ``tfdist`` console script does not put the working directory on the path)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def check_model_name(name: str) -> None:
    """Checks that ``module:function`` can be loaded, without running the module.

    The module must be found on the import path, its source must parse, and it must
    define ``function`` at top level (a ``def``, an assignment or an import). Modules
    without Python source (extensions) are only looked up. Built-in names pass.

    Raises:
        ValueError: the module or the function is missing, or the source has a syntax
            error; the message says which and what was received.
    """
    if ":" not in name:
        return
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name.isidentifier():
        raise ValueError(f"model.name must be 'module:function'. Received: {name!r}")
    _import_path()
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as error:  # a parent package is missing or broken
        raise ValueError(f"model.name {name!r}: module {module_name!r} cannot be found "
                         f"({error})") from None
    if spec is None:
        raise ValueError(f"model.name {name!r}: no module named {module_name!r} on the "
                         f"import path (working directory: {os.getcwd()})")
    origin = spec.origin if spec.has_location else None
    if not origin or not origin.endswith(".py"):
        return
    try:
        with open(origin, "rb") as f:
            tree = ast.parse(f.read(), origin)
    except (OSError, SyntaxError, ValueError) as error:
        raise ValueError(f"model.name {name!r}: {origin} cannot be read or parsed: "
                         f"{error}") from None
    if not (_defines(tree.body, function_name) or _defines(tree.body, "__getattr__")):
        raise ValueError(f"model.name {name!r}: module {module_name!r} ({origin}) defines "
                         f"no {function_name!r}")


def _defines(body: list, name: str) -> bool:
    """Whether top-level statements bind ``name`` (or may: ``from x import *``)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name).split(".")[0] == name:
                    return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name
                   for target in targets for n in ast.walk(target)):
                return True
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # e.g. under try/except
            nested = list(node.body) + list(getattr(node, "orelse", []))
            nested += [s for h in getattr(node, "handlers", []) for s in h.body]
            if _defines(nested + list(getattr(node, "finalbody", [])), name):
                return True
    return False


def build_model(model_config: dict, input_shape: tuple, num_classes: int):
    """Builds the model a config names (uncompiled, logits out).

    ``mlp``: dense layers of ``hidden`` units. ``cnn``: the input reshaped to a square
    image, a 3x3 convolution of 16 filters, 2x2 max-pooling, a 3x3 convolution of 32
    filters, flattened, then the ``hidden`` dense layers. ``module:function``:
    ``function(input_shape, num_classes)`` from the user's module, which returns a Keras
    model.
    """
    import keras

    name = model_config["name"]
    if ":" in name:
        module_name, _, function_name = name.partition(":")
        _import_path()
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
        # Flatten, not global pooling: on small images (8x8 digits) where a stroke is
        # matters, and global pooling needed 3x the epochs to reach the MLP.
        x = keras.layers.Reshape((side, side, 1))(x)
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D(padding="same")(x)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.Flatten()(x)
    for units in model_config["hidden"]:
        x = keras.layers.Dense(units, activation="relu")(x)
        if model_config["dropout"]:
            x = keras.layers.Dropout(model_config["dropout"])(x)
    outputs = keras.layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name=name)


def build_optimizer(train_config: dict):
    """The Keras optimizer of ``[train]``: ``sgd`` (with momentum) or ``adam``."""
    import keras

    if train_config["optimizer"] == "sgd":
        return keras.optimizers.SGD(train_config["learning_rate"],
                                    momentum=train_config["momentum"])
    return keras.optimizers.Adam(train_config["learning_rate"])
