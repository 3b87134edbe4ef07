"""Model averaging's state: a `Fragment` per part of the model, an `AveragingState` per
trained optimizer, both `tfdist.strategies.state.StateComponent`s; and the helpers that
read, write and recognise per-replica variables and pieces (rows) of them.

A fragment owns what its exchanges need: its pieces' anchors (the weights at its last
average), its outer optimizer (SlowMo / DiLoCo slots), its error-feedback residuals
(``outer_compression``) and its buffers (the outgoing copy of an exchange in flight,
``sync_delay > 0``). A piece (`tfdist.comm.fragments.Piece`) is a whole variable, or a
block of its rows when a fragment boundary cuts it.
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfdist import env
from tfdist.comm.fragments import split_fragments, variable_rows
from tfdist.strategies.state import StateComponent, unique


class Fragment(StateComponent):
    """One fragment: its pieces, anchors, outer optimizer, residuals and buffers.

    - Shared (every member holds them equal after each average; committed, saved and
      sent to a joiner): the anchors and the outer optimizer's variables.
    - Own: the error-feedback residuals, each replica's rounding error of its own outer
      gradients. They cannot be re-cut from N replicas to M: the residual of a lost
      member is lost with it, so a resize with residuals is refused.
    - Buffers: ``outgoing`` (this replica's outer gradient of an exchange in flight) and
      ``pending`` (the exchange itself). They are scratch between a start and its
      apply, never committed; an exchange in flight cannot survive a re-forming (its
      collective was started with the old members), so a resize with one is refused.

    Attributes:
        index: The fragment's number (its step in each period).
        indices: Its pieces' numbers among every fragment's pieces.
        pieces: Its `tfdist.comm.fragments.Piece`s.
        anchors: Keras variables, one per piece: the piece at the last average.
        outer: Its outer optimizer (a copy of the template), or None.
        residuals: Float32 variables, one per piece (``outer_compression``), or None.
        outgoing: The exchange buffers (one per piece), made by the runner, or None.
        pending: The exchange in flight (`tfdist.strategies.averaging.runner`), or None.
    """

    feature = "model averaging"

    def __init__(self, index, indices, pieces, anchors, outer=None, residuals=None):
        self.index = index
        self.indices = list(indices)
        self.pieces = list(pieces)
        self.anchors = list(anchors)
        self.outer = outer
        self.residuals = residuals
        self.outgoing = None
        self.pending = None

    def shared_variables(self) -> list:
        """The anchors and the outer optimizer's variables (slots and step)."""
        return [*self.anchors, *(self.outer.variables if self.outer is not None else ())]

    def own_variables(self) -> list:
        """The error-feedback residuals (each replica's own rounding error)."""
        return list(self.residuals or ())

    def resize_refusal(self, old: int, new: int) -> str | None:
        """Residuals and an exchange in flight belong to the members that made them."""
        if old == new:
            return None
        if self.pending is not None:
            return (f"fragment {self.index} has an exchange in flight (sync_delay), "
                    "started among the old members")
        if self.residuals is not None:
            return (f"fragment {self.index} keeps each replica's error-feedback residual "
                    "(outer_compression); a lost member's residual is lost with it")
        return None


class AveragingState(StateComponent):
    """Everything model averaging keeps for one trained optimizer, made on the first
    traced step (`make_state`): its fragments, and what the runner adds.

    Its shared and own variables are its fragments'; a resize is refused when a
    fragment refuses it, and with several fragments at all (they average at different
    steps, so no step has every member's whole model equal to hand over).

    Attributes:
        optimizer: The trained (inner) optimizer.
        variables: The trainable Keras variables it updates, in order.
        pieces: Every fragment's pieces, in fragment order.
        fragments: The `Fragment`s.
        slots: The optimizer's per-replica floats (momentum, moments).
        averaged_at: Optimizer step of the last forced average.
        full_at: ... of the last full one (slots too, exact).
        force_fns: Forced-average tf.functions by variable set.
        exchange: The runner's per-optimizer record (buffers of the non-trainable
            floats, traced functions, last step), or None.
    """

    feature = "model averaging"

    def __init__(self, optimizer, variables, fragments, slots):
        self.optimizer = optimizer
        self.variables = list(variables)
        self.fragments = list(fragments)
        self.pieces = [p for f in self.fragments for p in f.pieces]
        self.slots = slots
        self.averaged_at = 0
        self.full_at = 0
        self.force_fns = {}
        self.exchange = None

    @property
    def anchors(self) -> list:
        """Every piece's anchor, in piece order."""
        return [a for f in self.fragments for a in f.anchors]

    @property
    def residuals(self) -> list | None:
        """Every piece's residual (piece order), or None without outer compression."""
        if self.fragments[0].residuals is None:
            return None
        return [r for f in self.fragments for r in f.residuals]

    @property
    def outers(self) -> list:
        """The outer optimizers, one per fragment, or none."""
        return [f.outer for f in self.fragments if f.outer is not None]

    def in_flight(self):
        """The fragment whose exchange is in flight, or None."""
        return next((f for f in self.fragments if f.pending is not None), None)

    def shared_variables(self) -> list:
        return unique(v for f in self.fragments for v in f.shared_variables())

    def own_variables(self) -> list:
        return unique(v for f in self.fragments for v in f.own_variables())

    def resize_refusal(self, old: int, new: int) -> str | None:
        if old == new:
            return None
        if len(self.fragments) > 1:
            return ("its fragments average at different steps, so no step holds every "
                    "member's whole model equal")
        return next((r for r in (f.resize_refusal(old, new) for f in self.fragments) if r),
                    None)


def make_state(optimizer, variables, fragments: int, make_outer, with_residuals: bool,
               slots: list):
    """The `AveragingState` of ``optimizer``: its ``variables`` split into ``fragments``.

    Call in the strategy's scope, outside any traced function.

    Args:
        optimizer: The trained (inner) optimizer.
        variables: Its trainable Keras variables.
        fragments: How many fragments.
        make_outer: ``f(anchors)`` returning a built outer optimizer, or None.
        with_residuals: Make error-feedback residuals (``outer_compression``).
        slots: The optimizer's per-replica floats.
    """
    import keras

    tf_vars = [tf_variable(v) for v in variables]
    split = split_fragments([v.shape.num_elements() * v.dtype.size for v in tf_vars],
                            fragments, [variable_rows(v.shape) for v in tf_vars])
    made, start = [], 0
    for index, pieces in enumerate(split):
        anchors = [keras.Variable(piece_of(tf.identity(tf_vars[p.variable]), p),
                                  trainable=False, dtype=variables[p.variable].dtype,
                                  name=f"tfdist_anchor_{p.variable}"
                                  + ("" if p.whole else f"_{p.start}"))
                   for p in pieces]
        made.append(Fragment(index, range(start, start + len(pieces)), pieces, anchors))
        start += len(pieces)
    for fragment in made:  # outer optimizers, then residuals: the order of their names
        fragment.outer = make_outer(fragment.anchors)
    if with_residuals:
        names = iter(range(start))
        for fragment in made:
            fragment.residuals = make_residuals(fragment.anchors, names)
    return AveragingState(optimizer, variables, made, slots)


def make_residuals(variables, numbers=None):
    """Zero error-feedback residuals (float32, local to each replica), one per variable
    (per piece's anchor); ``numbers`` gives their name suffixes (default 0, 1, ...).

    Call in the strategy's scope, outside any traced function."""
    import keras

    numbers = iter(numbers if numbers is not None else range(len(variables)))
    return [keras.Variable(tf.zeros(v.shape, tf.float32), trainable=False,
                           dtype="float32", name=f"tfdist_residual_{next(numbers)}")
            for v in variables]


def agreed_variables(pieces, variables, piece_indices) -> list:
    """The ``variables`` every row of which is in ``pieces`` at ``piece_indices`` (those
    an exchange of those pieces leaves equal on every worker), in order."""
    chosen = set(piece_indices)
    partial = {p.variable for j, p in enumerate(pieces) if j not in chosen}
    touched = sorted({pieces[j].variable for j in chosen} - partial)
    return [variables[i] for i in touched]


def wants_multi_worker(cluster_resolver) -> bool:
    """Whether the replicas span several workers (a resolver, or TF_CONFIG with many)."""
    if cluster_resolver is not None:
        return True
    if not os.environ.get(env.TF_CONFIG):
        return False
    from tfdist.cluster import resolve_cluster

    return resolve_cluster(None).num_workers > 1


def tf_variable(variable):
    """The TF variable behind a Keras variable (or ``variable`` itself)."""
    return variable.value if hasattr(variable, "path") and hasattr(variable, "value") \
        else variable


def is_replicated_float(variable) -> bool:
    """A floating variable whose per-replica copies may differ (mirrored, on write)."""
    v = tf_variable(variable)
    return (isinstance(v, tf.distribute.DistributedValues) and v.dtype.is_floating
            and v.synchronization != tf.VariableSynchronization.ON_READ)


def piece_of(value, piece):
    """``value`` (a variable's tensor or per-device variable) restricted to ``piece``:
    itself for a whole piece, else its rows ``piece.start:piece.stop``."""
    return value if piece.whole else value[piece.start:piece.stop]


def piece_value(variable, piece):
    """In replica context: this replica's value of ``piece`` of the Keras ``variable``
    (the variable itself for a whole piece, as the un-cut code path always read it)."""
    value = tf_variable(variable)
    return value if piece.whole else tf.convert_to_tensor(value)[piece.start:piece.stop]


def assign_piece(variable, piece, value):
    """Assigns ``value`` to ``piece`` of a per-device ``variable`` (sliced for a cut)."""
    if piece.whole:
        return variable.assign(value)
    return variable[piece.start:piece.stop].assign(value)
