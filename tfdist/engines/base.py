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
import contextlib
import dataclasses

from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec
from tfdist.comm.accounting import ByteCounter
from tfdist.comm.communicator import Accounted, Communicator, StrategyCommunicator


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """What an engine is built from: the job, this task and the timeouts, as data.

    Attributes:
        cluster: The `tfdist.ClusterSpec`, or None when the process is the whole job.
        task_name: This task's name, e.g. ``"worker-1"``.
        startup_timeout: Seconds every task has to join.
        heartbeat_timeout: Seconds without a sign of life before a peer is lost.
        collective_timeout: Seconds one collective may wait for its peers (None: no
            limit): ``CommunicationOptions.timeout_seconds`` when set, else the
            strategy's ``collective_timeout``.
        collective_timeout_name: The setting it came from, as errors name it
            (``"timeout_seconds"`` or ``"collective_timeout"``).
        exchanges_rarely: The strategy exchanges rarely (model averaging): an engine
            may trade a collective's latency for quiet links.
        devices: This process's replicas, or None for stock
            ``MultiWorkerMirroredStrategy``'s (its GPUs, else one CPU).
        model_parallel: The size m of the "model" axis of the data x model mesh the
            strategy forms (`tfdist.comm.groups`), or None. An engine whose groups must
            exist when it starts (Horovod's process sets) makes them from it.
    """

    cluster: ClusterSpec | None = None
    task_name: str = "worker-0"
    startup_timeout: float = 60.0
    heartbeat_timeout: float = 10.0
    collective_timeout: float | None = None
    collective_timeout_name: str = "collective_timeout"
    exchanges_rarely: bool = False
    devices: tuple[str, ...] | None = None
    model_parallel: int | None = None


class Engine(abc.ABC):
    """One strategy's engine; made by the strategy as ``engine_class(setup)``.

    An engine is built from data (`EngineSetup`: the cluster, this task, the
    timeouts), not from the strategy. Subclasses implement `create_extended`; the rest
    has defaults that follow the cluster (rank 0 is the chief, or worker-0 without a
    chief). An engine that can re-form its members inside running processes (an
    elastic job) says so with `supports_elastic` and answers `membership`.

    Args:
        setup: The `EngineSetup`.
    """

    #: The registered name (set by `tfdist.engines.register_engine`).
    name: str = ""
    #: Whether the engine runs elastic jobs (``tfdist launch --min-workers``).
    supports_elastic: bool = False
    #: Whether one process's replicas may go through TF's own ``MirroredExtended``
    #: (a strategy on one host then needs no engine of its own).
    serves_one_host: bool = False
    #: Whether its communicator runs collectives within groups of replicas
    #: (`tfdist.comm.communicator.Communicator.in_group`: a data x model mesh).
    supports_groups: bool = False

    def __init__(self, setup: EngineSetup):
        if not isinstance(setup, EngineSetup):
            raise ValueError("an engine is built from a tfdist.engines.EngineSetup. "
                             f"Received: setup={setup!r}")
        self.setup = setup

    @abc.abstractmethod
    def create_extended(self, strategy, cluster_resolver, options):
        """Joins the job and returns the strategy's ``tf.distribute.StrategyExtended``.

        Called once, from the strategy's constructor, before any TensorFlow op.

        Args:
            strategy: The strategy that will hold the extended (its container).
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
        cluster = self.setup.cluster
        if cluster is None or cluster.task is None:
            return 0
        training = [t for t in cluster.tasks() if t.type in TRAINING_TASK_TYPES]
        return training.index(cluster.task)

    @property
    def size(self) -> int:
        """Processes that compute steps (the chief and the workers)."""
        cluster = self.setup.cluster
        return 1 if cluster is None else cluster.num_workers

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and logs (TF's rule)."""
        cluster = self.setup.cluster
        return True if cluster is None else cluster.is_chief()

    def peer_error(self, error):
        """``error``, or the same error type naming the peer(s) that stopped answering.

        Called with every `tf.errors.OpError` that ends ``fit``. Default: unchanged.
        """
        return error

    def watch_peers(self):
        """A context manager ``fit`` runs in, in which the engine may watch its peers and
        name one that stops answering before its own error can (default: nothing)."""
        return contextlib.nullcontext()

    def membership(self):
        """The elastic membership this process is in, or None (not an elastic job, or
        an engine that does not offer one: `supports_elastic`).

        The object answers what `tfdist.strategies.elastic.fit` asks: ``name``,
        ``version``, ``members``, ``bounds``, ``synced``, ``training``,
        ``joined_running``, ``reform()``, ``changed()``, ``is_lost_peer(error)``,
        ``say(text)``, ``rank()``, ``broadcast(value, root_rank)``,
        ``allgather(value)`` and the words ``HAS_BACKUP_WORDS``/``NO_STATE_WORDS``.
        """
        return None


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
