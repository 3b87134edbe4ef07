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

Extending it (e.g. model averaging on many workers): subclass and override

- `_create_extended(cluster_resolver, communication_options)` to return your own
  subclass of `MultiWorkerExtended` (itself TF's ``CollectiveAllReduceExtended``);
- `_make_communication_options(communication_options)` to change the collective
  options (implementation, timeout);
- `_configure_coordination()` to change the coordination service set-up.

The cluster is resolved before any of these run: ``self.cluster`` (a `ClusterSpec`,
or None when this process is the whole job) is available in all of them. Call ``super().__init__(...)`` from your ``__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets

import tensorflow as tf

from tfdist._hooks import tf as tf_hooks
from tfdist.checks import check_seconds
from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec, resolve_cluster
from tfdist.comm.engines import select_engine
from tfdist.comm.options import merge_options
from tfdist.strategies._fit import models_differ
from tfdist.strategies._sync import SyncGradientsMixin

DEFAULT_STARTUP_TIMEOUT = 60.0
# Seconds a collective may wait for its peers before failing; None: no limit. None by
# default because TF implements the timeout with one OS thread per collective that
# sleeps for the whole timeout (benchmarks/overhead.md: ~4 threads per step, each
# living that long). A frozen or dead peer is still caught by the heartbeat.
DEFAULT_COLLECTIVE_TIMEOUT = None
# Seconds without a heartbeat before the coordination service declares a task dead.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0

# Seconds a peer has to answer a liveness probe after Horovod stopped (engine="horovod").
PROBE_TIMEOUT = 2.0
# In Horovod's errors when a peer froze or died; the line with the first one is quoted.
_HOROVOD_FAILURES = ("Horovod has been shut down", "Gloo", "gloo")

# What tf.compat.v1.random.get_seed(op_seed) reports as the global seed when none was set.
_DEFAULT_GRAPH_SEED = 87654321

logger = logging.getLogger("tfdist")


class MultiWorkerExtended(tf_hooks.collective_all_reduce_extended_class()):
    """TF's ``CollectiveAllReduceExtended`` that names a model mismatch between workers.

    Every variable's initial value is broadcast from the chief when it is created. If the
    workers built different models, TF fails deep inside Keras' ``build`` with "Shape
    mismatch in the collective instance"; this turns that into a `ValueError`.
    """

    def _create_variable(self, next_creator, **kwargs):
        try:
            return super()._create_variable(next_creator, **kwargs)
        except tf.errors.InvalidArgumentError as error:
            if "Shape mismatch in the collective" not in (error.message or ""):
                raise
            import re

            shapes = re.search(r"Op at device /job:(\w+)/replica:\d+/task:(\d+)\S* expected "
                               r"shape (\[[^\]]*\]) but another member in the group expected "
                               r"shape (\[[^\]]*\])", error.message)
            seen = (f": its shape is {shapes.group(3)} on {shapes.group(1)}-{shapes.group(2)} "
                    f"and {shapes.group(4)} on another worker") if shapes else ""
            raise models_differ(kwargs.get("name"), seen, error.message) from None


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
            service declares a task dead and fails the others. With
            ``engine="horovod"``: Gloo's timeout (or ``collective_timeout`` when
            smaller), after which a frozen or dead peer stops the others; in ``fit``
            their error names the task(s) that then miss a liveness probe
            (`PROBE_TIMEOUT`) or are not running.
        compression: Shortcut for ``communication_options.compression``.
        accumulate_steps: Shortcut for ``communication_options.accumulate_steps``.
        engine: ``"tf"`` (TF collectives: the gRPC ring on CPU, NCCL on GPU),
            ``"horovod"`` (Horovod's ops: Gloo on CPU, NCCL on GPU builds; no
            ``horovodrun`` needed, the chief hosts the rendezvous at its TF_CONFIG
            address) or ``"auto"``: Horovod with several workers on CPUs where it is
            installed, else TF (see `tfdist.comm.engines.select_engine`). Replicas,
            metrics, the initial-variable broadcast, accumulation, compression and
            byte counting are the same with either engine.

    Raises:
        ValueError: the cluster is invalid (the message names the field and value).
        tf.errors.DeadlineExceededError: a worker did not join within
            ``startup_timeout``.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 startup_timeout=DEFAULT_STARTUP_TIMEOUT,
                 collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT,
                 heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT, compression=None,
                 accumulate_steps=None, engine="auto"):
        self.startup_timeout = check_seconds("startup_timeout", startup_timeout)
        self.collective_timeout = check_seconds("collective_timeout", collective_timeout,
                                                allow_none=True)
        self.heartbeat_timeout = check_seconds("heartbeat_timeout", heartbeat_timeout)
        self.cluster = self._resolve(cluster_resolver)
        options = merge_options(communication_options, compression=compression,
                                accumulate_steps=accumulate_steps)
        self.engine = select_engine(engine, self.num_workers,
                                    on_gpus=bool(tf.config.list_physical_devices("GPU")),
                                    is_chief=self.is_chief)
        if self.engine == "horovod":
            self._init_sync_gradients(options)
            tf.distribute.Strategy.__init__(self, self._create_horovod_extended())
            self.shared_seed = self._share_random_seed()
            return
        tf_resolver = self._make_cluster_resolver(cluster_resolver)
        communication_options = self._make_communication_options(options.to_tf())
        if self.num_workers > 1:
            self._configure_coordination()
        try:
            extended = self._create_extended(tf_resolver, communication_options)
        except tf.errors.DeadlineExceededError as error:
            raise self._startup_error(error) from error
        # Same as TF's CollectiveAllReduceStrategy.__init__, with the extended
        # object made by an overridable factory.
        tf.distribute.Strategy.__init__(self, extended)
        self._init_sync_gradients(options)
        self.shared_seed = self._share_random_seed()

    # ---- overridable set-up -----------------------------------------------------------

    def _resolve(self, source) -> ClusterSpec | None:
        """The cluster as a `ClusterSpec` (TF_CONFIG when ``source`` is None).

        None when ``source`` is None and TF_CONFIG is unset: this process is the whole
        job, one worker over the local devices, as `tf.distribute.MultiWorkerMirroredStrategy`.
        """
        if source is None and not os.environ.get("TF_CONFIG"):
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

    def _make_cluster_resolver(self, source):
        """The TF ``ClusterResolver`` handed to TF (the user's own when given).

        TF_CONFIG goes through TF's own resolver: TF special-cases it to use every local
        GPU. Other sources become a ``SimpleClusterResolver`` that counts local GPUs
        (listing physical devices does not start TF's runtime).
        """
        if source is not None and hasattr(source, "cluster_spec") and hasattr(
                source, "task_type") and not isinstance(source, ClusterSpec):
            return source
        if source is None or source == "env":
            return tf.distribute.cluster_resolver.TFConfigClusterResolver()
        task = self.cluster.task
        gpus = len(tf.config.list_physical_devices("GPU"))
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster.jobs()),
            task_type=task.type if task else "worker", task_id=task.index if task else 0,
            rpc_layer="grpc", num_accelerators={"GPU": gpus} if gpus else None)

    def _make_communication_options(self, options):
        """Collective options: the user's, with ``collective_timeout`` if they set none."""
        # The public name is a factory; its instances are of a private class.
        options_class = type(tf.distribute.experimental.CommunicationOptions())
        if options is None:
            options = options_class()
        if not isinstance(options, options_class):
            raise ValueError("communication_options must be a "
                             "tf.distribute.experimental.CommunicationOptions. "
                             f"Received: {options!r}")
        if options.timeout_seconds is None and self.collective_timeout is not None:
            options = options.merge(tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=self.collective_timeout))
        return options

    def _configure_coordination(self):
        """Starts TF's coordination service with a registration barrier and timeouts.

        Without the barrier, a worker that never starts makes the constructor block
        forever; with it, every task fails after ``startup_timeout``.
        """
        tf_hooks.configure_coordination_service(
            self.cluster.jobs(),
            register_timeout_seconds=self.startup_timeout,
            heartbeat_timeout_seconds=self.heartbeat_timeout)

    def _create_extended(self, cluster_resolver, communication_options):
        """The ``StrategyExtended`` object: override to return your own subclass."""
        return MultiWorkerExtended(self, cluster_resolver=cluster_resolver,
                                   communication_options=communication_options)

    def _create_horovod_extended(self):
        """The ``StrategyExtended`` of ``engine="horovod"``: replicas span every process
        and reductions go through Horovod's ops
        (`tfdist.strategies.horovod.HorovodExtended`). Gradients are compressed and
        counted by the strategy's communicator, as with ``engine="tf"``. Horovod starts
        without ``horovodrun``: the chief hosts Gloo's rendezvous at its TF_CONFIG
        address."""
        from tfdist.comm import horovod as comm
        from tfdist.strategies.horovod import HorovodExtended, rank_devices

        if self.cluster is not None and self.num_workers > 1:
            try:
                comm.init_from_cluster(self.cluster, self.startup_timeout,
                                       peer_timeout=min(self.heartbeat_timeout,
                                                        self.collective_timeout or math.inf))
            except TimeoutError as error:
                raise tf.errors.DeadlineExceededError(None, None, str(error)) from None
        else:
            comm.init()
        return HorovodExtended(self, rank_devices())

    def _share_random_seed(self):
        """Sets the chief's random global seed on every worker when the user set none.

        Why: Keras shuffles numpy inputs with an unseeded ``tf.random.shuffle``, and
        each worker then takes its part of every global batch from a different
        permutation: samples are seen twice or never in an epoch. With one global seed
        everywhere the permutations agree. A seed the user set is left alone.

        Returns:
            The seed that was set, or None when the user had set one.
        """
        if not self.extended._in_multi_worker_mode() or (
                tf.compat.v1.random.get_seed(0)[0] != _DEFAULT_GRAPH_SEED):
            return None
        contribution = float(secrets.randbelow(2**31 - 1)) if self.is_chief else 0.0

        def value_fn(context):
            return tf.constant(contribution if context.replica_id_in_sync_group == 0
                               else 0.0, tf.float64)

        total = self.reduce("SUM", self.experimental_distribute_values_from_function(
            value_fn), axis=None)
        seed = int(total.numpy())
        tf.random.set_seed(seed)
        return seed

    def _startup_error(self, error):
        """The start-up timeout as an error that names the missing task(s)."""
        me = self.cluster.task.name if self.cluster.task else "this task"
        others = [t.name for t in self.cluster.tasks()
                  if t.type in TRAINING_TASK_TYPES and t != self.cluster.task]
        missing = _missing_tasks(error.message, self.cluster) or (
            "one or more of " + ", ".join(others))
        first_line = error.message.strip().splitlines()[0] if error.message else ""
        return tf.errors.DeadlineExceededError(
            None, None,
            f"{me}: task(s) {missing} did not join the cluster within "
            f"startup_timeout={self.startup_timeout:g}s. Check that every task was "
            f"started with the same cluster and can reach the others. TensorFlow said: "
            f"{first_line}")

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
        """Keras ``fit`` runs in this: a peer that stopped answering is named."""
        with super().keras_fit_context(model, arguments):
            try:
                yield
            except tf.errors.OpError as error:
                raise self._peer_error(error) from error

    def _peer_error(self, error):
        """``error``, or the same error type naming the peer(s) that stopped answering.

        ``engine="tf"``: every task sends heartbeats to the coordination service on the
        leader (the chief, else worker-0). When the leader is frozen, the others only
        see "Deadline Exceeded, RPC: .../CoordinationService/Heartbeat".
        ``engine="horovod"``: see `_horovod_peer_error`.
        """
        if getattr(self, "engine", "tf") == "horovod":
            return self._horovod_peer_error(error)
        leader = _coordination_leader(self.cluster)
        if leader is None or leader == self.task_name or (
                "CoordinationService/Heartbeat" not in (error.message or "")):
            return error
        return type(error)(
            error.node_def, error.op,
            f"{self.task_name}: {leader}, the coordination service leader, did not answer "
            f"heartbeats within heartbeat_timeout={self.heartbeat_timeout:g}s: it is frozen "
            f"(e.g. SIGSTOP), overloaded or unreachable. TensorFlow said: "
            f"{_summary(error.message)}")

    def _horovod_peer_error(self, error):
        """``error``, or the same error type naming the tasks that stopped answering.

        When a peer freezes or dies, Horovod says only "Horovod has been shut down"
        (after Gloo's timeout, or at once). Then every other task is probed where it
        answers while it runs (`tfdist.comm.horovod.peer_addresses`), all at once, for
        at most `PROBE_TIMEOUT` seconds each (connect, then answer): silent ones are
        named as frozen, refused ones as not running. Unchanged if all answer.
        """
        from tfdist.comm import horovod as comm

        message = error.message or ""
        peers = comm.peer_addresses()
        if not peers or not any(m in message for m in _HOROVOD_FAILURES):
            return error
        timeout_text, seconds = self._horovod_timeout()
        probe_timeout = min(PROBE_TIMEOUT, seconds)
        silent, gone = _probe(peers, probe_timeout)
        if not silent and not gone:
            return error
        what = []
        if silent:
            what.append(f"{_tasks(silent)} did not answer Horovod within {timeout_text}, nor "
                        f"a liveness probe within {probe_timeout:g}s: "
                        f"{'it is' if len(silent) == 1 else 'they are'} frozen (e.g. "
                        "SIGSTOP), overloaded or unreachable")
        if gone:
            addresses = ", ".join(peers[name] for name in gone)
            what.append(f"{_tasks(gone)} {'is' if len(gone) == 1 else 'are'} not running "
                        f"(nothing listens at {addresses}): killed or exited")
        said = next((line.strip() for line in message.splitlines()
                     if _HOROVOD_FAILURES[0] in line), _summary(message))
        return type(error)(error.node_def, error.op,
                           f"{self.task_name}: {'; '.join(what)}. Horovod said: {said}")

    def _horovod_timeout(self) -> tuple[str, float]:
        """Gloo's timeout as set, e.g. ``("heartbeat_timeout=5s", 5.0)``."""
        from tfdist.comm import horovod as comm

        ours = min(self.heartbeat_timeout, self.collective_timeout or math.inf)
        name = "heartbeat_timeout" if ours == self.heartbeat_timeout else "collective_timeout"
        seconds = os.environ.get(comm.GLOO_TIMEOUT_ENV)
        if seconds is not None and seconds != comm.gloo_timeout_value(ours):
            return f"{comm.GLOO_TIMEOUT_ENV}={seconds}", float(seconds)
        return f"{name}={ours:g}s", ours

    # ---- conveniences --------------------------------------------------------------------

    @property
    def is_chief(self) -> bool:
        """True on the task that writes checkpoints and logs (TF's rule)."""
        if self.cluster is None:
            return self._horovod_rank() == 0
        return self.cluster.is_chief()

    @property
    def num_workers(self) -> int:
        """Tasks that compute steps: the chief plus the workers."""
        if self.cluster is None:
            return self._horovod_size()
        return self.cluster.num_workers

    @property
    def task_name(self) -> str:
        """This task's name, e.g. ``worker-1``."""
        task = self.cluster and self.cluster.task
        return task.name if task else f"worker-{self._horovod_rank()}"

    def _horovod_rank(self) -> int:
        """This process's rank under ``horovodrun`` (engine="horovod"), else 0."""
        if getattr(self, "engine", "tf") != "horovod":
            return 0
        from tfdist.comm import horovod as comm

        return comm.rank()

    def _horovod_size(self) -> int:
        if getattr(self, "engine", "tf") != "horovod":
            return 1
        from tfdist.comm import horovod as comm

        return comm.size()


def _tasks(names: list[str]) -> str:
    return names[0] if len(names) == 1 else "task(s) " + ", ".join(names)


def _probe(peers: dict[str, str], timeout: float) -> tuple[list[str], list[str]]:
    """``(silent, not running)`` task names of ``peers`` (``{name: address}``), probed at
    once with the parameter-server strategy's probe (an HTTP/2 preface: any server
    that runs answers, and the servers of `tfdist.comm.horovod` do)."""
    from concurrent.futures import ThreadPoolExecutor

    from tfdist.strategies.parameter_server import is_responsive

    with ThreadPoolExecutor(max_workers=min(len(peers), 64),
                            thread_name_prefix="tfdist-probe") as pool:
        answers = list(pool.map(lambda address: is_responsive(address, timeout),
                                peers.values()))
    silent = [name for name, answer in zip(peers, answers) if answer is False]
    gone = [name for name, answer in zip(peers, answers) if answer is None]
    return silent, gone


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


def _coordination_leader(cluster: ClusterSpec | None) -> str | None:
    """The task that hosts the coordination service (`_hooks.tf.configure_coordination_service`)."""
    if cluster is None or cluster.num_workers < 2:
        return None
    return "chief-0" if cluster.chief else "worker-0"


def _summary(message: str | None) -> str:
    """TF's message in one line: a graph error's last lines (the cause), else the first."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if lines and lines[0].startswith("Graph execution"):
        return " ".join(lines[-3:])
    return lines[0] if lines else ""


def _missing_tasks(message: str, cluster: ClusterSpec) -> str:
    """Task names like ``worker-1`` for every ``/job:worker/.../task:1`` in ``message``."""
    import re

    # The registration barrier lists the late tasks after this marker; other errors
    # (the leader itself unreachable) name the remote task anywhere in the text.
    marker = "timed out task names:"
    if marker in message:
        message = message.split(marker, 1)[1].split("\n\n", 1)[0]
    names = []
    for job, index in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", message):
        name = f"{job}-{index}"
        if name not in names and (cluster.task is None or name != cluster.task.name):
            names.append(name)
    return ", ".join(names)
