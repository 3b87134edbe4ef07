"""A test engine in one file: TF's collectives on the ring implementation, in small packs,
through a communicator of its own that counts its reductions.

It proves that a new engine is one module plus one `tfdist.engines.register_engine`
call: nothing else in tfdist names it. `tests/test_engine_plugin.py` trains ``fit``
through ``MultiWorkerMirroredStrategy(engine="ring")`` and
``ModelAverageStrategy(engine="ring")`` with it on 2 launched workers.
"""

import dataclasses

import tfdist
from tfdist.comm.communicator import Communicator
from tfdist.engines.tf import TFEngine

NAME = "ring"
PACK_BYTES = 256  # tiny packs: the gradients of a small model travel as several


class RingCommunicator(Communicator):
    """All-reduces with TF's ring collectives, packed in `PACK_BYTES`, and counts them."""

    reductions = 0  # per process: how many batches of tensors went through here

    def __init__(self, options):
        self._options = options

    def all_reduce(self, distribution, values, destinations, op="mean"):
        import tensorflow as tf

        if not values:
            return []
        type(self).reductions += 1
        reduce_op = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}[op]
        pairs = [(v, d if d is not None else (v.device if isinstance(v, tf.Tensor) else v))
                 for v, d in zip(values, destinations)]
        return distribution.extended.batch_reduce_to(reduce_op, pairs, options=self._options)


class RingEngine(TFEngine):
    """TF's engine with the ring implementation and `PACK_BYTES` packs, everywhere."""

    def communication_options(self, options):
        return dataclasses.replace(options, implementation="ring",
                                   bytes_per_pack=PACK_BYTES).to_tf()

    def create_extended(self, strategy, cluster_resolver, options):
        self._ring_options = self.communication_options(options)
        return super().create_extended(strategy, cluster_resolver, options)

    def make_inner_communicator(self, name):
        return RingCommunicator(self._ring_options)


def register() -> None:
    """Registers `RingEngine` as ``"ring"`` (once per process)."""
    if NAME not in tfdist.engines.available():
        tfdist.engines.register_engine(NAME, RingEngine)
