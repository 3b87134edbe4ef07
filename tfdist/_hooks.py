"""Every private TensorFlow / Keras hook tfdist relies on, in one place.

Each hook says why it is needed, and ``tests/test_hooks.py`` fails loudly when a TF or
Keras upgrade removes what it touches. Modules elsewhere call these functions instead
of reaching into private names themselves.
"""

from __future__ import annotations

import itertools

# Group keys a strategy instance may use before the next instance's range starts.
COLLECTIVE_KEY_STRIDE = 10_000
_collective_key_bases = itertools.count(1)


def assign_collective_key_base(strategy_cls_or_obj) -> int:
    """Gives a strategy instance its own range of collective group keys.

    Why: stock MirroredStrategy instances all start their group keys at 1, so two of
    them in one process (two models in a notebook) collide: "Shape mismatch in the
    collective instance 100". TF reads the private ``_collective_key_base`` attribute of
    the container strategy in ``MirroredExtended.__init__``; an instance attribute set
    before ``super().__init__`` shadows the class default of 0.
    """
    base = next(_collective_key_bases) * COLLECTIVE_KEY_STRIDE
    strategy_cls_or_obj._collective_key_base = base
    return base
