"""Many hosts, TF_CONFIG: gradients summed every step across workers, that never hangs.

`MultiWorkerMirroredStrategy` subclasses `tf.distribute.MultiWorkerMirroredStrategy`
(Keras special-cases that class with ``isinstance``) and adds:

- Keras 3 ``fit``/``evaluate``/``predict`` work: `reduce` accepts nested structures and
  scalar metrics (keras-team/keras#20585, tensorflow/tensorflow#72388).
- Any cluster source: None (TF_CONFIG), a TF ``ClusterResolver`` (Slurm, Kubernetes,
  ...), a `tfdist.ClusterSpec`, a TF_CONFIG dict or ``"slurm"``.
- No hangs: a peer that never starts is an error naming it after ``startup_timeout``;
  a frozen peer is an error after ``collective_timeout``; a killed peer is an error
  within seconds (see docs/multi_worker.md).

Its tensors move through an engine object (`tfdist.engines.Engine`, chosen by
``engine=``): the engine makes the ``extended``, the gradient communicator, answers
rank/size/chief and names a failed peer; this class has no engine-specific code.

Extending it (e.g. model averaging on many workers): subclass and override
`_create_extended(cluster_resolver, communication_options)` to return your own
subclass of `MultiWorkerExtended` (itself TF's ``CollectiveAllReduceExtended``) under
TF's engine. The TF engine makes the cluster resolver, the collective options and the
coordination service from its `EngineSetup` (`tfdist.engines.tf`). The cluster is
resolved before: ``self.cluster`` (a `ClusterSpec`, or None when this process is the
whole job) is available. Call ``super().__init__(...)`` from your ``__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets

import tensorflow as tf

from tfdist._hooks import tf as tf_hooks
from tfdist import env
from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec, resolve_cluster
from tfdist.comm.accounting import ByteCounter
from tfdist.engines.base import EngineSetup, models_differ
from tfdist.engines.registry import available, engine_class, select_engine
from tfdist.strategies.elastic.fit import DEFAULT_COMMIT_EVERY_STEPS
from tfdist.strategies._sync import SyncGradientsMixin
from tfdist.strategies.options.arguments import (DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT,
                                         DEFAULT_STARTUP_TIMEOUT, MIN_SHARD_ELEMENTS,
                                         check_multi_worker)


# What tf.compat.v1.random.get_seed(op_seed) reports as the global seed when none was set.
_DEFAULT_GRAPH_SEED = 87654321

logger = logging.getLogger("tfdist")


class MultiWorkerExtended(tf_hooks.checked_collective_extended_class()):
    """TF's ``CollectiveAllReduceExtended`` that names a model mismatch between workers.

    Every variable's initial value is broadcast from the chief when it is created. If the
    workers built different models, TF fails deep inside Keras' ``build`` with "Shape
    mismatch in the collective instance"; this turns that into a `ValueError`.
    """

    def tfdist_create_variable(self, create, name):
        try:
            return create()
        except tf.errors.InvalidArgumentError as error:
            if "Shape mismatch in the collective" not in (error.message or ""):
                raise
            import re

            shapes = re.search(r"Op at device /job:(\w+)/replica:\d+/task:(\d+)\S* expected "
                               r"shape (\[[^\]]*\]) but another member in the group expected "
                               r"shape (\[[^\]]*\])", error.message)
            seen = (f": its shape is {shapes.group(3)} on {shapes.group(1)}-{shapes.group(2)} "
                    f"and {shapes.group(4)} on another worker") if shapes else ""
            raise models_differ(name, seen, error.message) from None


class MultiWorkerMirroredStrategy(SyncGradientsMixin, tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` for Keras 3 that never hangs.

    Every worker runs the same program; gradients are summed across all replicas of
    all workers every step, and loss/metrics are reduced across workers, so every
    worker reports the same global values.

    Args:
        cluster_resolver: None (TF_CONFIG, the default; without TF_CONFIG one worker
            over the local devices, as in TF), ``"env"`` (TF_CONFIG, required), a TF
            ``ClusterResolver`` (Slurm, Kubernetes, ...), a `tfdist.ClusterSpec`, a
            TF_CONFIG-shaped dict, or ``"slurm"``.
        communication_options: A `tfdist.CommunicationOptions` (compression, gradient
            accumulation, timeout, implementation) or TF's
            ``tf.distribute.experimental.CommunicationOptions``. Its
            ``timeout_seconds``, when set, wins over ``collective_timeout``.
        startup_timeout: Seconds to wait for every worker to join; after that the
            constructor raises `tf.errors.DeadlineExceededError` naming the missing
            task(s).
        collective_timeout: Seconds any one collective (all-reduce, broadcast) may wait
            for its peers, e.g. a deadlocked peer; None (the default) for no limit.
            Each timed collective costs TF one sleeping OS thread for that long.
            Frozen (SIGSTOPped) or dead peers are caught by ``heartbeat_timeout``.
        heartbeat_timeout: Seconds without a heartbeat before the coordination
            service declares a task dead and fails the others. Other engines use it
            (or ``collective_timeout`` when smaller) as their peer timeout; in ``fit``
            the error names the peer that stopped answering (see the engine's
            ``peer_error``).
        compression: Shortcut for ``communication_options.compression``.
        accumulate_steps: Shortcut for ``communication_options.accumulate_steps``.
        shard_optimizer_state: Each worker keeps 1/N of the optimizer state (ZeRO-2:
            gradients reduce-scattered, slices updated, weights all-gathered; see
            docs/zero.md). Element-wise Keras optimizers only.
        shard_parameters: Each worker stores 1/N of every large trainable variable and
            of its optimizer state (ZeRO-3 / FSDP, docs/fsdp.md); not in elastic jobs.
        min_shard_elements: With ``shard_parameters``: smaller variables stay whole.
        shard_filter: With ``shard_parameters``: None, or ``f(path)`` returning True
            (shard), False (keep whole) or None (the ``min_shard_elements`` rule).
        reshard_after_forward: With ``shard_parameters``: True (gathered again for the
            backward pass) or False (kept from the forward pass to the backward pass).
        engine: A registered engine name (`tfdist.engines.available`): ``"tf"``
            (TF collectives: the gRPC ring on CPU, NCCL on GPU), the Horovod engine
            (Gloo on CPU; no launcher of its own needed, see docs/horovod.md), one
            added with `tfdist.engines.register_engine`, or ``"auto"`` (the rule of
            `tfdist.engines.select_engine`). Replicas, metrics, the initial-variable
            broadcast, accumulation, compression and byte counting are the same with
            every engine.
        commit_every_steps: In an elastic job (``tfdist launch --min-workers``,
            docs/elastic.md): train steps between in-memory commits of the training
            state; a lost member costs at most this many steps. 1 (the default)
            commits after every step.

    Attributes:
        engine: The engine's name (``"auto"`` resolved).
        rank, size: This process's index in the job and the number of processes.
        num_workers: Tasks that compute steps (the chief and the workers; = ``size``).
        is_chief: Whether this task writes checkpoints and logs.

    Raises:
        ValueError: the cluster is invalid (the message names the field and value).
        tf.errors.DeadlineExceededError: a worker did not join within
            ``startup_timeout``.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 startup_timeout=DEFAULT_STARTUP_TIMEOUT,
                 collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT,
                 heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT, compression=None,
                 accumulate_steps=None, engine="auto", shard_optimizer_state=False,
                 commit_every_steps=DEFAULT_COMMIT_EVERY_STEPS, shard_parameters=False,
                 min_shard_elements=MIN_SHARD_ELEMENTS, shard_filter=None,
                 reshard_after_forward=True):
        checked = check_multi_worker(
            communication_options, startup_timeout, collective_timeout, heartbeat_timeout,
            compression, accumulate_steps, engine, shard_optimizer_state, commit_every_steps,
            shard_parameters, min_shard_elements, shard_filter, reshard_after_forward)
        options = checked.pop("options")
        self._sharding = checked.pop("sharding")
        self.commit_every_steps = checked["commit_every_steps"]
        self.startup_timeout = checked["startup_timeout"]
        self.collective_timeout = checked["collective_timeout"]
        self.heartbeat_timeout = checked["heartbeat_timeout"]
        self.cluster = self._resolve(cluster_resolver)
        cluster = self.cluster
        self.engine = select_engine(engine, cluster.num_workers if cluster else 1,
                                    on_gpus=bool(tf.config.list_physical_devices("GPU")),
                                    is_chief=cluster.is_chief() if cluster else True)
        chosen = engine_class(self.engine)
        if os.environ.get(env.ELASTIC_ADDR) and not chosen.supports_elastic:
            elastic = [name for name in available() if engine_class(name).supports_elastic]
            raise ValueError(
                f"an elastic job (tfdist launch --min-workers) needs engine="
                f"{' or '.join(map(repr, elastic))}: engine={self.engine!r} cannot re-form "
                f"its cluster inside a running process (TF's collectives and coordination "
                f"service are fixed at start). Received: engine={engine!r}")
        self._start_engine(chosen(self._engine_setup(options)), cluster_resolver, options,
                    shard_optimizer_state)

    def _start_engine(self, engine, cluster_resolver, options, shard_optimizer_state=False):
        """Joins the job through ``engine`` (an `tfdist.engines.Engine`) and sets the
        communication up: the constructor's part every subclass shares."""
        self._engine = engine
        # Same as TF's CollectiveAllReduceStrategy.__init__, with the extended object
        # made by the engine.
        tf.distribute.Strategy.__init__(
            self, engine.create_extended(self, cluster_resolver, options))
        self._shard_optimizer_state = shard_optimizer_state
        self._init_communication(options)
        self.shared_seed = self._share_random_seed()

    # ---- overridable set-up -----------------------------------------------------------

    def _engine_setup(self, options, **more) -> EngineSetup:
        """What the engine is built from: the cluster, this task and the timeouts
        (``options.timeout_seconds``, when set, is the collective timeout); ``more``:
        other `EngineSetup` fields."""
        from_options = options.timeout_seconds is not None
        task = self.cluster and self.cluster.task
        more.setdefault("task_name", task.name if task else "worker-0")
        return EngineSetup(
            cluster=self.cluster,
            startup_timeout=self.startup_timeout, heartbeat_timeout=self.heartbeat_timeout,
            collective_timeout=(options.timeout_seconds if from_options
                                else self.collective_timeout),
            collective_timeout_name="timeout_seconds" if from_options
            else "collective_timeout",
            exchanges_rarely=bool(getattr(self, "exchanges_rarely", False)), **more)

    def _resolve(self, source) -> ClusterSpec | None:
        """The cluster as a `ClusterSpec` (TF_CONFIG when ``source`` is None).

        None when ``source`` is None and TF_CONFIG is unset: this process is the whole
        job, one worker over the local devices, as `tf.distribute.MultiWorkerMirroredStrategy`.
        """
        if source is None and not os.environ.get(env.TF_CONFIG):
            logger.info("%s: TF_CONFIG is not set, so this process is the only worker "
                        "(replicas: its local devices).", type(self).__name__)
            return None
        cluster = resolve_cluster(source)
        if cluster.task is None and cluster.num_workers > 1:
            raise ValueError("the cluster has several workers but does not say which one "
                             f"this process is. Received: cluster={cluster.jobs()}, task=None")
        if cluster.task is not None and cluster.task.type not in TRAINING_TASK_TYPES:
            raise ValueError("MultiWorkerMirroredStrategy runs on 'chief' and 'worker' "
                             f"tasks only. Received: task={cluster.task.name!r}")
        return cluster

    def _create_extended(self, cluster_resolver, communication_options):
        """The ``StrategyExtended`` object: override to return your own subclass."""
        return MultiWorkerExtended(self, cluster_resolver=cluster_resolver,
                                   communication_options=communication_options)

    def _init_communication(self, options):
        """Sets ``communication`` and the gradient ``communicator`` (the engine's)."""
        self._init_sync_gradients(options, self._engine.make_communicator(
            options.compression_policy, ByteCounter()),
            shard_optimizer_state=getattr(self, "_shard_optimizer_state", False),
            sharding=getattr(self, "_sharding", None))

    def _share_random_seed(self):
        """Sets the chief's random global seed on every worker when the user set none.

        Why: Keras shuffles numpy inputs with an unseeded ``tf.random.shuffle``, and
        each worker then takes its part of every global batch from a different
        permutation: samples are seen twice or never in an epoch. With one global seed
        everywhere the permutations agree. A seed the user set is left alone.

        Returns:
            The seed that was set, or None when the user had set one.
        """
        if not tf_hooks.in_multi_worker_mode(self.extended) or (
                tf.compat.v1.random.get_seed(0)[0] != _DEFAULT_GRAPH_SEED):
            return None
        member = self._engine.membership()
        if member is not None and member.joined_running:
            return None  # the members train: no collective before fit syncs (docs/elastic.md)
        contribution = float(secrets.randbelow(2**31 - 1)) if self.is_chief else 0.0

        def value_fn(context):
            return tf.constant(contribution if context.replica_id_in_sync_group == 0
                               else 0.0, tf.float64)

        total = self.reduce("SUM", self.experimental_distribute_values_from_function(
            value_fn), axis=None)
        seed = int(total.numpy())
        tf.random.set_seed(seed)
        return seed

    # ---- Keras 3 fixes ------------------------------------------------------------------

    def reduce(self, reduce_op, value, axis):
        """`tf.distribute.Strategy.reduce` that also takes nested structures and scalars.

        Keras 3 calls ``reduce("MEAN", (x, y), axis=None)`` on a whole batch and
        ``reduce("MEAN", scalar_metric, axis=0)``; TF's class fails on both
        (keras-team/keras#20585). Scalars are reduced across replicas with
        ``axis=None``.
        """
        flat = tf.nest.flatten(value, expand_composites=False)
        if len(flat) != 1 or flat[0] is not value:
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        if axis is not None and _rank(value) == 0:
            axis = None
        return super().reduce(reduce_op, value, axis)

    @contextlib.contextmanager
    def keras_fit_context(self, model, arguments):
        """Keras ``fit`` runs in this: a peer that stopped answering is named (and
        watched meanwhile, where the engine does: `Engine.watch_peers`)."""
        with super().keras_fit_context(model, arguments), self._engine.watch_peers(), \
                self._elastic_fit(model, arguments):
            try:
                yield
            except tf.errors.OpError as error:
                raise self._engine.peer_error(error) from error

    @contextlib.contextmanager
    def _elastic_fit(self, model, arguments):
        """In an elastic job, ``fit`` commits, and survives a lost or joining member
        (`tfdist.strategies.elastic.fit`); elsewhere nothing changes."""
        member = self._engine.membership()
        if member is None:
            yield
            return
        from tfdist.strategies.elastic.fit import ElasticFit
        from tfdist.strategies.elastic.data import ElasticDataset, check_elastic_batch
        from tfdist.strategies._fit import global_batch_sizes

        check_elastic_batch(global_batch_sizes("fit", arguments)["batch_size"],
                            len(self.extended.worker_devices), member.bounds)

        def training_data(dataset):  # fit's first distributed dataset is its training data
            del self._elastic_dataset
            return ElasticDataset(dataset, self)

        self._elastic_dataset = training_data
        fitting = ElasticFit(self, model, self.commit_every_steps)
        fitting.backups = _backup_dirs(arguments)
        if not member.synced:
            self._elastic_initial_epoch = fitting.join()
        fitting.install()
        self.elastic_fit = fitting
        try:
            yield
        finally:
            self.__dict__.pop("_elastic_dataset", None)
            self.__dict__.pop("_elastic_initial_epoch", None)
            model.train_function = None
            fitting.uninstall()

    def membership(self):
        """The engine's elastic membership of this process, or None (not elastic)."""
        return self._engine.membership()

    def keras_fit_initial_epoch(self, model):
        """A worker that joined a running elastic job starts at the job's epoch."""
        del model
        return getattr(self, "_elastic_initial_epoch", None)

    # ---- conveniences --------------------------------------------------------------------

    @property
    def is_chief(self) -> bool:
        """True on the task that writes checkpoints and logs (TF's rule)."""
        return self._engine.is_chief

    @property
    def rank(self) -> int:
        """This process's index in the job (the chief first, then the workers)."""
        return self._engine.rank

    @property
    def size(self) -> int:
        """Processes in the job: the chief plus the workers."""
        return self._engine.size

    @property
    def num_workers(self) -> int:
        """Tasks that compute steps: the chief plus the workers (= `size`)."""
        return self._engine.size

    @property
    def task_name(self) -> str:
        """This task's name, e.g. ``worker-1``."""
        task = self.cluster and self.cluster.task
        return task.name if task else f"worker-{self.rank}"


def _backup_dirs(arguments) -> list[str]:
    """The ``backup_dir`` of each ``keras.callbacks.BackupAndRestore`` given to ``fit``."""
    import keras

    callbacks = (arguments or {}).get("callbacks") or []
    callbacks = getattr(callbacks, "callbacks", callbacks)
    return [c.backup_dir for c in callbacks
            if isinstance(c, keras.callbacks.BackupAndRestore)]


def _rank(value):
    """Static rank of a tensor or of the first component of a distributed value."""
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        return tf.TensorShape(shape).rank
    except (TypeError, ValueError):
        return None
