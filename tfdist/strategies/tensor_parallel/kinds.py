"""What a split layer is (`tfdist.strategies.tensor_parallel.splits`): its kind (a Dense or
EinsumDense kernel split on its outputs or inputs, an Embedding table on its rows or
columns), read from an EinsumDense's equation; which activations and layers may run on
a slice of the features; what is refused on a split variable."""

from __future__ import annotations

COLUMN, ROW = "column", "row"  # a Dense kernel split on its outputs / inputs
VOCAB, FEATURES = "vocab", "features"  # an Embedding table split on its rows / columns


def is_supported(layer, kind) -> bool:
    """Whether ``layer`` (its exact class) runs split as ``kind``."""
    import keras

    if type(layer) is keras.layers.EinsumDense and kind in (COLUMN, ROW):
        return einsum_axes(layer, kind) is not None
    if type(layer) is keras.layers.ReversibleEmbedding:  # a tied head: its table's rows
        return kind == VOCAB and layer.tie_weights and layer.reverse_dtype is None
    return (type(layer), kind) in {
        (keras.layers.Dense, COLUMN), (keras.layers.Dense, ROW),
        (keras.layers.Embedding, VOCAB), (keras.layers.Embedding, FEATURES)}


# Keras' activations that work on each element alone (not softmax, log_softmax,
# sparsemax, glu, nor any other callable): only these run on a slice of the features.
ELEMENTWISE = ("celu", "elu", "exponential", "gelu", "hard_shrink", "hard_sigmoid",
               "hard_silu", "hard_tanh", "leaky_relu", "linear", "log_sigmoid", "mish",
               "relu", "relu6", "selu", "sigmoid", "silu", "soft_shrink", "softplus",
               "softsign", "sparse_plus", "sparse_sigmoid", "squareplus", "tanh",
               "tanh_shrink", "threshold")


def is_elementwise_activation(activation) -> bool:
    """Whether ``activation`` (a layer's, None for none) is one of `ELEMENTWISE`."""
    import keras

    return activation is None or any(activation is getattr(keras.activations, name, None)
                                     for name in ELEMENTWISE)


def is_elementwise(layer) -> bool:
    """Whether ``layer`` (its exact class) works on each feature alone, without weights:
    it may take a split activation as it is."""
    import keras

    if type(layer) is keras.layers.Activation:
        return is_elementwise_activation(layer.activation)
    return type(layer) in (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)


def may_stay_split(layer) -> bool:
    """Whether a column layer's output may leave it split: its own activation is
    element-wise and no activity regularizer reads the output."""
    return (is_elementwise_activation(layer.activation)
            and getattr(layer, "activity_regularizer", None) is None)


def check_no_penalty(layer, variables) -> None:
    """Raises when a split variable of ``layer`` has a regularizer or a constraint (each
    replica would see one slice).

    Raises:
        ValueError: naming the variable and its regularizer or constraint.
    """
    for variable in variables:
        for what in ("regularizer", "constraint"):
            found = getattr(variable, what, None)
            if found is not None:
                raise ValueError(
                    f"ModelParallelStrategy does not apply a {what} to a split variable "
                    f"(each replica holds one slice): remove it or leave the variable out "
                    f"of the layout map. Received: layer {layer.name!r} with "
                    f"{variable.path!r} {what}={type(found).__name__}"
                    f"({_config_of(found)})")


def _config_of(found) -> str:
    config = getattr(found, "get_config", dict)()
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def kernel_kind(axis: int, rank: int) -> tuple:
    """``(kind, output axis from the end or None)`` of a kernel being made, split on
    ``axis`` of its ``rank``: an EinsumDense's equation decides (`einsum_kind`), a
    Dense's axis (0: ROW, else COLUMN)."""
    import keras

    from tfdist._hooks.tensor_parallel import creating_layer

    layer = creating_layer()
    if type(layer) is keras.layers.EinsumDense:
        kind = einsum_kind(layer.equation, axis)
        return kind, einsum_output_from_end(layer.equation, axis) if kind == COLUMN else None
    return (ROW if axis == 0 else COLUMN), axis - rank


def layer_kind(layer, kind):
    """How a layer with a variable split over "model" runs: an EinsumDense as its
    equation says for its kernel's split axis, any other as its variables said."""
    import keras

    from tfdist._hooks.tensor_parallel import split_of

    split = split_of(getattr(layer, "kernel", None))
    if type(layer) is keras.layers.EinsumDense and split is not None and split.axis is not None:
        return einsum_kind(layer.equation, split.axis)
    return kind


def _axis_in(spec: str, letter: str):
    """The axis of ``letter`` in one einsum operand ``spec`` (negative after ``...``)."""
    if "..." in spec:
        before, after = spec.split("...")
        if letter in after:
            return after.index(letter) - len(after)
        return before.index(letter) if letter in before else None
    return spec.index(letter) if letter in spec else None


def _einsum_letters(equation: str, axis: int):
    """``(inputs, output, letter)``: an EinsumDense equation's input and output specs and
    the letter of its kernel's ``axis``."""
    operands, output = equation.replace(" ", "").split("->")
    inputs, kernel = operands.split(",")
    return inputs, output, kernel.replace("...", "")[axis]


def einsum_kind(equation: str, axis: int):
    """COLUMN when the kernel's split letter (of ``axis``) is in the output and not the
    input (not contracted), ROW when in the input and not the output, else None."""
    inputs, output, letter = _einsum_letters(equation, axis)
    at_input, at_output = _axis_in(inputs, letter), _axis_in(output, letter)
    if at_output is not None and at_input is None:
        return COLUMN
    if at_input is not None and at_output is None:
        return ROW
    return None


def einsum_output_from_end(equation: str, axis: int):
    """The output axis (counted from the end, negative) that a column EinsumDense's
    split letter indexes (a bias is aligned on the output's last axes), or None when it
    is before an ``...``."""
    _, output, letter = _einsum_letters(equation, axis)
    return _from_end(output, letter)


def _from_end(spec: str, letter: str):
    at = _axis_in(spec, letter)
    if "..." in spec:
        return at if at is not None and at < 0 else None
    return None if at is None else at - len(spec)


def split_output_axis(layer):
    """The axis (from the end) of a column layer's output that is split."""
    import keras

    if type(layer) is keras.layers.EinsumDense:
        return einsum_output_from_end(layer.equation, split_axis(layer))
    return -1


def takes_split(consumer, kind, axis) -> bool:
    """Whether ``consumer`` (running as ``kind``) is a row layer whose input is split on
    ``axis`` (from the end): it may take a column output still split there."""
    import keras

    if kind != ROW:
        return False
    if type(consumer) is keras.layers.EinsumDense:
        inputs, _, letter = _einsum_letters(consumer.equation, split_axis(consumer))
        return _from_end(inputs, letter) == axis
    return type(consumer) is keras.layers.Dense and axis == -1


def einsum_axes(layer, kind):
    """For an EinsumDense whose kernel is split as ``kind``: the axis of its output
    (COLUMN) or input (ROW) that the kernel's split letter indexes, or None when that
    letter is not an output-only (COLUMN) or input-only (ROW) letter."""
    from tfdist._hooks.tensor_parallel import split_of

    split = split_of(layer.kernel)
    inputs, output, letter = _einsum_letters(layer.equation, split.axis)
    at_input, at_output = _axis_in(inputs, letter), _axis_in(output, letter)
    if kind == COLUMN and at_output is not None and at_input is None:
        return at_output
    if kind == ROW and at_input is not None and at_output is None:
        return at_input
    return None


def split_axis(layer) -> int:
    """The axis of ``layer``'s kernel split over "model"."""
    from tfdist._hooks.tensor_parallel import split_of

    return split_of(layer.kernel).axis
