"""Model averaging's outer optimizer (SlowMo / DiLoCo): checked, copied, stepped, saved.

`tfdist.strategies.options.arguments.check_template` checks the argument itself.

At each scheduled average, ``anchor - mean(w_i)`` (the averaged change since the last
average, negated) is applied to the anchor as the outer optimizer's gradient, with
Keras' own ``update_step``. Each fragment
(`tfdist.strategies.averaging.fragment.Fragment`) owns one copy; the strategy makes
each an attribute of the model before a save, so Keras saves and loads its state
(momentum, step) with the model's.
"""

from __future__ import annotations

from tfdist._hooks import keras_optimizer

# The model attribute that holds the outer optimizer, so Keras saves its state too.
OUTER_OPTIMIZER_ATTR = "_tfdist_outer_optimizer"


def check_outer(optimizer) -> None:
    """The outer step runs ``update_step`` only: refuse what that would skip."""
    for name in ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay",
                 "gradient_accumulation_steps"):
        if getattr(optimizer, name, None):
            raise ValueError(f"outer_optimizer does not support {name}. Received: "
                             f"{name}={getattr(optimizer, name)!r}")
    if getattr(optimizer, "use_ema", False) or getattr(optimizer, "loss_scale_factor", None):
        raise ValueError("outer_optimizer does not support use_ema or loss_scale_factor. "
                         f"Received: {optimizer!r}")
    if keras_optimizer.overrides_backend_update_step(optimizer):
        raise ValueError("outer_optimizer must do all its work in update_step; "
                         f"{type(optimizer).__name__} does not. Received: {optimizer!r}")


def make_outer(template):
    """The outer optimizer from ``template`` (a copy of an instance), or None.

    Call it in the strategy's scope.
    """
    import keras

    if template is None:
        return None
    if hasattr(template, "get_config"):
        return type(template).from_config(template.get_config())
    outer = keras.optimizers.get(template) if isinstance(template, (str, dict)) \
        else template()
    if not hasattr(outer, "get_config"):
        raise ValueError("outer_optimizer must give a Keras optimizer. "
                         f"Received: {outer!r}")
    check_outer(outer)
    return outer


def attach(model, outer, fragment: int = 0) -> None:
    """Makes ``outer`` (of ``fragment``) an attribute of ``model``, so Keras saves and
    loads its state."""
    suffix = f"_{fragment}" if fragment else ""
    setattr(model, OUTER_OPTIMIZER_ATTR + suffix, outer)


def apply_outer_step(distribution, outer, anchors, mean_deltas) -> None:
    """Cross-replica: one outer step on ``anchors`` with ``mean_deltas`` as gradients.

    Keras' own update, as its TF optimizer runs it (its ``apply`` needs a replica
    context; this is cross-replica). The gradient is the same tensor for every replica.
    """
    import tensorflow as tf

    extended = distribution.extended
    learning_rate = outer.learning_rate
    for anchor, delta in zip(anchors, mean_deltas):
        if isinstance(delta, tf.distribute.DistributedValues):
            delta = distribution.experimental_local_results(delta)[0]
        grad = tf.cast(delta, anchor.dtype)
        extended.update(anchor, lambda a, g, lr: outer.update_step(g, a, lr),
                        args=(grad, learning_rate), group=False)
    outer.iterations.assign_add(1)
