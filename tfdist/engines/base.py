"""The engine interface: what moves a multi-worker strategy's tensors between processes.

An `Engine` serves one strategy (`tfdist.MultiWorkerMirroredStrategy` and the strategies
built on it). It joins the job and makes the strategy's ``StrategyExtended`` (replicas,
variables, cross-device reductions), makes its communicator (the
`tfdist.comm.communicator.Accounted` wrapper that compresses and counts, once), answers
``rank``, ``size`` and ``is_chief``, and turns an engine's error about a failed peer
into one that names the peer. A new engine is one module with an `Engine` subclass plus
one `tfdist.engines.register_engine` call.

Nothing here imports TensorFlow: it is imported inside the methods that need it.
"""

from __future__ import annotations

import abc

from tfdist.cluster import TRAINING_TASK_TYPES
from tfdist.comm.accounting import ByteCounter
from tfdist.comm.communicator import Accounted, Communicator, StrategyCommunicator


class Engine(abc.ABC):
    """One strategy's engine; made by the strategy as ``engine_class(strategy)``.

    The strategy gives the engine what it knows before the engine starts: ``cluster``
    (a `tfdist.ClusterSpec`, or None when the process is the whole job),
    ``startup_timeout``, ``collective_timeout``, ``heartbeat_timeout`` and
    ``task_name``. Subclasses implement `create_extended`; the rest has defaults that
    follow the cluster (rank 0 is the chief, or worker-0 without a chief).

    Args:
        strategy: The strategy this engine serves.
    """

    #: The registered name (set by `tfdist.engines.register_engine`).
    name: str = ""

    def __init__(self, strategy):
        self.strategy = strategy

    @abc.abstractmethod
    def create_extended(self, cluster_resolver, options):
        """Joins the job and returns the strategy's ``tf.distribute.StrategyExtended``.

        Called once, from the strategy's constructor, before any TensorFlow op.

        Args:
            cluster_resolver: What the user passed as ``cluster_resolver`` (None for
                TF_CONFIG).
            options: The strategy's `tfdist.CommunicationOptions`.

        Raises:
            tf.errors.DeadlineExceededError: a task did not join in time (naming it).
        """

    def make_communicator(self, compression=None, counter: ByteCounter | None = None,
                          name: str = "tfdist") -> Accounted:
        """The strategy's accounted communicator (compression and byte counting).

        Args:
            compression: None, ``"fp16"``, ``"bf16"`` or a compression policy.
            counter: The `ByteCounter` the payloads are counted in.
            name: A name for this communicator's reductions.
        """
        return Accounted(self.make_inner_communicator(name), compression, counter)

    def make_inner_communicator(self, name: str) -> Communicator:
        """The communicator that moves the tensors (default: the extended's own
        ``batch_reduce_to``, i.e. the cross-device ops `create_extended` chose)."""
        del name
        return StrategyCommunicator()

    @property
    def rank(self) -> int:
        """This process's index in the job: the chief first, then the workers."""
        cluster = self.strategy.cluster
        if cluster is None or cluster.task is None:
            return 0
        training = [t for t in cluster.tasks() if t.type in TRAINING_TASK_TYPES]
        return training.index(cluster.task)

    @property
    def size(self) -> int:
        """Processes that compute steps (the chief and the workers)."""
        cluster = self.strategy.cluster
        return 1 if cluster is None else cluster.num_workers

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and logs (TF's rule)."""
        cluster = self.strategy.cluster
        return True if cluster is None else cluster.is_chief()

    def peer_error(self, error):
        """``error``, or the same error type naming the peer(s) that stopped answering.

        Called with every `tf.errors.OpError` that ends ``fit``. Default: unchanged.
        """
        return error


def summary(message: str | None) -> str:
    """TF's message in one line: a graph error's last lines (the cause), else the first."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if lines and lines[0].startswith("Graph execution"):
        return " ".join(lines[-3:])
    return lines[0] if lines else ""


def models_differ(variable: str | None, where: str, said: str) -> ValueError:
    """The error for workers that built different models (any engine).

    Args:
        variable: The variable's name.
        where: ``": its shape is [3,4] on worker-0 and [3,3] on another worker"``, or "".
        said: The engine's own message.
    """
    return ValueError(
        f"the workers built different models: variable {variable!r} does not match "
        f"between workers{where}. Every worker must create the same variables, with the "
        f"same shapes, in the same order, in strategy.scope(). The engine said: "
        f"{said.strip().splitlines()[0]}")
