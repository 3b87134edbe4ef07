"""The data of an elastic ``fit``: every worker reads every global batch and keeps its
replicas' rows, so a data position is (epoch, batch) whatever the membership
(`tfdist.strategies.elastic.fit`). The position is a state component (`DataPosition`)."""

from __future__ import annotations

import collections

import tensorflow as tf

from tfdist._hooks import tf as tf_hooks
from tfdist.strategies.state import StateComponent


class ElasticDataset:
    """The training data of an elastic ``fit``: each global batch's rows of this worker.

    Args:
        dataset: The user's batched `tf.data.Dataset` (global batches).
        strategy: The strategy (its ``extended`` gives the replica ids now).
    """

    def __init__(self, dataset, strategy):
        self._dataset = dataset
        self._strategy = strategy
        self.element_spec = dataset.element_spec

    def __iter__(self) -> "ElasticIterator":
        return ElasticIterator(iter(self._dataset), self._strategy)


class ElasticIterator:
    """Global batches in order, sliced to this worker's replicas, with a replay buffer.

    ``position`` counts the global batches taken this epoch. `rewind` gives back every
    batch taken since `mark` (the last commit), in order.
    """

    def __init__(self, source, strategy):
        self._source = source
        self._strategy = strategy
        self._taken: list = []  # global batches since the last mark
        self._replay: collections.deque = collections.deque()
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = self._replay.popleft() if self._replay else next(self._source)
        self._taken.append(batch)
        self.position += 1
        return self._share(batch)

    def mark(self) -> None:
        """Forgets the batches taken so far: the state was committed here."""
        self._taken.clear()

    def rewind(self) -> None:
        """Goes back to the last `mark`: its batches come again, in order."""
        self._replay.extendleft(reversed(self._taken))
        self.position -= len(self._taken)
        self._taken.clear()

    def skip(self, count: int) -> None:
        """Takes ``count`` batches without using them (another member trained on them)."""
        for _ in range(count):
            next(self)

    def _share(self, batch):
        """This worker's replicas' rows of ``batch``, as one value per local replica."""
        strategy = self._strategy
        rows = int(tf.shape(tf.nest.flatten(batch)[0])[0])

        def rows_of(context):
            replicas = context.num_replicas_in_sync
            start = context.replica_id_in_sync_group * rows // replicas
            stop = (context.replica_id_in_sync_group + 1) * rows // replicas
            return tf.nest.map_structure(lambda t: t[start:stop], batch)

        extended = strategy.extended
        if len(extended.worker_devices) == 1:
            # Plain tensors, not per-replica values: Keras' fit then builds the model
            # from a batch without reducing it across workers, which a worker joining a
            # running job could not do (the members are training).
            return rows_of(tf.distribute.experimental.ValueContext(
                tf_hooks.replica_id_in_sync_group(extended, 0), strategy.num_replicas_in_sync))
        return strategy.experimental_distribute_values_from_function(rows_of)


class DataPosition(StateComponent):
    """The elastic data position: a state component with no variables.

    Its state is the epoch and the global batch of the last commit (``committed_at``),
    which identify the commit (members agree on the newest one and take the state from
    a member holding it), and the batches taken since, which a rollback gives back in
    order. Every worker reads every global batch, so a position means the same for any
    replica count: it resizes freely.

    Attributes:
        iterator: This epoch's `ElasticIterator`.
        epoch: The epoch being trained (-1 before the first).
        committed_at: ``(epoch, batch)`` of the last commit; ``(-1, -1)`` on a joiner
            before it takes the job's state.
        fast_forward: Keras' steps the job trained, this epoch, before a joiner joined.
        steps_lost: Steps rolled back so far (the one in flight included).
    """

    feature = "the data position"

    def __init__(self):
        self.iterator: ElasticIterator | None = None
        self.epoch = -1
        self.committed_at = (0, 0)
        self.fast_forward = 0
        self.steps_lost = 0

    def start_epoch(self, iterator: ElasticIterator) -> None:
        """A new epoch's iterator: skips what the job trained before a joiner joined."""
        self.iterator, self.epoch = iterator, self.epoch + 1
        iterator.skip(self.fast_forward)

    @property
    def batch(self) -> int:
        """Global batches taken this epoch."""
        return self.iterator.position

    def committed(self) -> None:
        self.committed_at = (self.epoch, self.iterator.position)
        self.iterator.mark()

    def rolled_back(self) -> None:
        self.steps_lost += self.iterator.position - self.committed_at[1]
        self.iterator.rewind()

    def take(self, epoch: int, batch: int) -> None:
        """Moves to another member's newer commit in this epoch (skips its batches)."""
        self.iterator.skip(batch - self.iterator.position)
        self.committed_at = (epoch, batch)
        self.iterator.mark()

    def joined(self, epoch: int, batch: int) -> None:
        """A joiner took the commit at ``(epoch, batch)``: its next epoch is ``epoch``,
        whose first ``batch`` batches it skips."""
        self.epoch, self.fast_forward = epoch - 1, batch


def check_elastic_batch(batch_size, local_replicas: int, bounds: tuple[int, int]) -> None:
    """Raises unless ``batch_size`` divides by every replica count the job can have.

    Args:
        batch_size: The global batch (None: unknown, not checked).
        local_replicas: Replicas per worker.
        bounds: ``(min_workers, max_workers)``.
    """
    if batch_size is None:
        return
    counts = [w * local_replicas for w in range(bounds[0], bounds[1] + 1)]
    bad = [c for c in counts if batch_size % c]
    if bad:
        raise ValueError(
            f"in an elastic job the global batch must split evenly over every replica "
            f"count the job can have ({', '.join(map(str, counts))}), so that every "
            f"membership trains on the same global batch. Received: batch_size="
            f"{batch_size}, which does not divide by {', '.join(map(str, bad))}.")
