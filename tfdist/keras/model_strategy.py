"""A model keeps the strategy it was built under when ``keras.distribution`` changes.

Keras' TensorFlow trainer runs a model under the strategy it was built under, or, for a
model built under none, under TF's current strategy: after
``keras.distribution.set_distribution(d)``, d's tfdist strategy, whose variable updates
fail on the model's plain variables. As on JAX, a model built before
``set_distribution`` keeps training where its variables are (one device), and a model
built under an earlier distribution keeps that one's strategy.
`tfdist._hooks.keras_distribution` runs ``keras.Model``'s ``compile``, ``fit``,
``evaluate``, ``predict``, ``*_on_batch``, ``get_weights``/``set_weights`` and its saves
and loads in `model_call_context` (``MODEL_CALLS``).
"""

from __future__ import annotations

import contextlib
import weakref

# Strategy made for a Keras distribution -> the distribution last set with it.
_distribution_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(strategy, distribution) -> None:
    """Notes that ``distribution`` is set with ``strategy`` as TF's default."""
    _distribution_of[strategy] = distribution


@contextlib.contextmanager
def model_call_context(own, set_keras):
    """Runs a model's call under ``own``, the strategy it was built under (None: none).

    Changes nothing unless TF's current strategy is one a Keras distribution set and
    differs from ``own``; then, for the call, ``own`` (or none) is TF's default and
    Keras' distribution is the one set with it (or none), and both are restored after.

    Args:
        own: The strategy the model was built under, or None.
        set_keras: Keras' own ``set_distribution`` (Keras' state only).

    Yields:
        Whether the call runs under another strategy than the current one.
    """
    import tensorflow as tf

    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if current is None or current is own or current not in _distribution_of:
        yield False
        return
    distribution = _distribution_of[current]
    tf.distribute.experimental_set_strategy(own)  # raises inside a `with scope():`
    set_keras(_distribution_of.get(own) if own is not None else None)
    try:
        yield True
    finally:
        tf.distribute.experimental_set_strategy(current)
        set_keras(distribution)
