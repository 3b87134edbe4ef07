"""Parameter-server training: variables on ``ps`` tasks, steps computed by workers.

The same script runs on every task. On ``worker`` and ``ps`` tasks the constructor
starts TensorFlow's gRPC server and blocks until the chief has finished, then exits the
process with code 0. On the chief it connects to the cluster, creates a
`tf.distribute.coordinator.ClusterCoordinator`, and routes Keras' ``fit``, ``evaluate``
and ``predict`` of models built in its scope to `tfdist.keras.ps_fit`, which dispatches
the steps to the workers.

Modes:
    ``"async"``: every scheduled step runs on whichever worker is free and applies its
        own update to the variables on the ps tasks as soon as it is done.
    ``"sync"``: a step takes one gradient from each of the K workers (each on its own
        batch), sums them on the ps tasks and applies them once. This equals one
        single-device step on the K-times-larger batch.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import tensorflow as tf

from tfdist import env
from tfdist._hooks.sharded import (embedding, gradients, initialization, optimizer_state,
                                   row_blocks, saving)
from tfdist.cluster import ClusterSpec, resolve_cluster
from tfdist.comm.accounting import ByteCounter
from tfdist.keras import handoff
from tfdist.strategies._ps_watchdog import StepTimeoutError, _StepWatchdog  # noqa: F401
from tfdist.strategies.options.arguments import DEFAULT_STEP_TIMEOUT, PS_MODES, check_parameter_server

MODES = PS_MODES
# Dotted path of the module with fit/evaluate/predict for models of this strategy: a name,
# so that the PS driver (and Keras' training code it imports) loads only when a model fits.
FIT_DRIVER = "tfdist.keras.ps_fit"  # its fit/evaluate/predict replace Keras' own


def validate_ps_cluster(spec: ClusterSpec) -> None:
    """Raises ValueError unless ``spec`` can run parameter-server training."""
    problems = []
    if not spec.chief:
        problems.append("no 'chief' task (the chief runs fit and dispatches the steps)")
    if not spec.ps:
        problems.append("no 'ps' task (the parameter servers hold the variables)")
    if not spec.worker:
        problems.append("no 'worker' task (the workers compute the steps)")
    if problems:
        raise ValueError("ParameterServerStrategy needs a cluster with a chief, at least one "
                         "ps and at least one worker; this one has " + "; ".join(problems) +
                         f". Received: cluster={spec.jobs()}")
    if spec.task is None:
        raise ValueError("ParameterServerStrategy needs to know which task this process is: "
                         "the cluster has no 'task'. Received: task=None")
    if spec.task.type == "evaluator":
        raise ValueError("ParameterServerStrategy does not run an 'evaluator' task; run "
                         "evaluate() on the chief instead. Received: task=evaluator-"
                         f"{spec.task.index}")


COME_UP_POLL_SECONDS = 0.05


def _is_listening(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            # A TCP connection to itself (source port == the polled port) succeeds with
            # nobody listening.
            return sock.getsockname() != sock.getpeername()
    except OSError:
        return False


def wait_for_chief(address: str, poll_seconds: float = 1.0, misses: int = 3,
                   startup_timeout: float | None = None, seen: bool = False) -> None:
    """Blocks until the chief at ``address`` has come up and then gone away.

    The chief's gRPC server listens while the chief process lives. Its port being
    closed ``misses`` polls in a row means the chief has finished (or died; with
    `tfdist launch` a failed chief stops the whole job anyway). Until the chief is seen
    the port is polled every `COME_UP_POLL_SECONDS` at most: a short job's chief
    listens for little more than a second, and a task that missed it would wait for a
    chief that never comes.

    Args:
        address: The chief's ``host:port``.
        poll_seconds: Seconds between two connection attempts.
        misses: Closed polls in a row that mean the chief is gone.
        startup_timeout: Seconds to wait for the chief to listen at all; None: forever.
        seen: The chief is known to have been up already (a restarted task): do not
            wait for it to come up, only for it to be gone.

    Raises:
        TimeoutError: the chief did not listen within ``startup_timeout``.
    """
    deadline = None if startup_timeout is None else time.monotonic() + startup_timeout
    while not seen and not _is_listening(address):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {address} after {startup_timeout:g}s")
        time.sleep(min(poll_seconds, COME_UP_POLL_SECONDS))
    missed = 0
    while missed < misses:
        time.sleep(poll_seconds)
        missed = 0 if _is_listening(address) else missed + 1


def _without_evaluator(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` as TF's servers and coordinator see it: an evaluator task (a side-car
    reading checkpoints, `tfdist.keras.SidecarEvaluator`) runs no TF server, and TF
    would wait for one."""
    return dataclasses.replace(spec, evaluator=())


def serve_until_chief_done(spec: ClusterSpec, poll_seconds: float = 1.0,
                           startup_timeout: float | None = None) -> None:
    """Runs this worker or ps task's TF server; exits the process (code 0) after the chief.

    TF's in-process server cannot be shut down, so the process ends with `os._exit`
    once the output is flushed. A task restarted alone by `tfdist launch`
    (``TFDIST_TASK_RESTART`` > 0) joins a chief that was already up, so a closed port
    means the chief has finished.

    Raises:
        tf.errors.DeadlineExceededError: the chief did not start within
            ``startup_timeout`` seconds (the message names it).
    """
    # The chief itself listens only once every worker and ps does, after up to
    # its own startup_timeout: give it that long too.
    server = tf.distribute.Server(
        tf.train.ClusterSpec(_without_evaluator(spec).jobs()), job_name=spec.task.type,
        task_index=spec.task.index, protocol="grpc", start=True)
    print(f"tfdist: {spec.task.name} serving on {spec.task_address}; waiting for the chief "
          f"at {spec.chief[0]} to finish", flush=True)
    restarted = os.environ.get(env.TASK_RESTART, "0") not in ("", "0")
    try:
        wait_for_chief(spec.chief[0], poll_seconds, seen=restarted,
                       startup_timeout=None if startup_timeout is None else 2 * startup_timeout)
    except TimeoutError:
        raise tf.errors.DeadlineExceededError(
            None, None, f"{spec.task.name}: the chief (chief-0 at {spec.chief[0]}) did not "
            f"start within 2 x startup_timeout={startup_timeout:g}s (nothing listens there); "
            "without a chief nothing runs, so this task gives up. Check that the chief "
            "was started with the same cluster, and its output.") from None
    print(f"tfdist: the chief has finished; {spec.task.name} exits", flush=True)
    del server
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wait_for_servers(spec: ClusterSpec, timeout: float) -> None:
    """Waits until every worker and ps server accepts connections (the chief's check).

    Raises:
        tf.errors.DeadlineExceededError: some did not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    waiting = [t for t in spec.tasks() if t.type in ("worker", "ps")]
    while waiting:
        waiting = [t for t in waiting if not _is_listening(spec.with_task(t).task_address)]
        if waiting and time.monotonic() > deadline:
            names = ", ".join(t.name for t in waiting)
            raise tf.errors.DeadlineExceededError(
                None, None, f"{spec.task.name}: task(s) {names} did not start within "
                f"startup_timeout={timeout:g}s (nothing listens on "
                f"{', '.join(spec.with_task(t).task_address for t in waiting)}). Check that "
                "every task was started with the same cluster.")
        if waiting:
            time.sleep(0.2)


class ParameterServerStrategy(handoff.KerasHandoff, tf.distribute.ParameterServerStrategy):
    """`tf.distribute.ParameterServerStrategy` that works with Keras 3 ``model.fit``.

    Create it at the top of the script, before any other TensorFlow work, on every task.

    Args:
        cluster_resolver: None (read TF_CONFIG), a `tfdist.ClusterSpec`, a TF_CONFIG
            dict, ``"slurm"``, or a TF `ClusterResolver`. The cluster needs a chief, at
            least one ps and at least one worker.
        mode: ``"async"`` (each step's update applied when it arrives) or ``"sync"``
            (each step sums one gradient from each worker, then applies it once).
        variable_partitioner: A `tf.distribute.experimental.partitioners.Partitioner`
            to shard large variables across the ps tasks, or None. Sharded models
            save and restore like others (Keras files hold full tables; a
            `tf.train.Checkpoint` restores into any number of shards). As under every
            tfdist strategy, ``model.save``/``save_weights`` (so Keras' checkpoint
            callbacks too) write atomically and refuse weights with NaN or infinity.
        steps_per_dispatch: Steps scheduled between two fetches of the logs (callbacks
            see one ``on_train_batch_end`` per dispatch). Default: the model's
            ``steps_per_execution`` if above 1, else ``4 * workers`` in async mode and 1
            in sync mode.
        chief_poll_seconds: How often worker and ps tasks check that the chief is alive.
        startup_timeout: Seconds the chief waits for every worker and ps server to
            listen; a worker or ps waits twice as long for the chief (which listens
            only after that). TF itself would wait forever for a task that never starts.
        exactly_once: Apply each requested step's update once even when its worker
            dies and TF's coordinator runs it again (a ledger of applied step ids on a
            ps; see docs/parameter_server.md). False: TF's own at-least-once, about
            10% faster in async mode (measured, a 400K-parameter MLP).
        update_block_bytes: A shard of a sharded variable larger than this is updated
            by the optimizer in blocks of rows of at most this many bytes, one after the
            other (the same values): Keras' dense updates (Adam's moments decay on every
            row) otherwise make several shard-sized temporaries on its ps. None: one
            update per shard, about 2x faster, with those temporaries (measured on a
            1M x 64 shard with Adam: 144 ms and +784 MiB against 295 ms and +118 MiB).
        step_timeout: Seconds a step (one closure: a training step, a sync apply, an
            evaluate or predict batch) may run on a worker, or None for no limit. TF's
            coordinator has none: a frozen worker or ps hangs ``fit``. Past it, the chief
            names the worker and, under `tfdist launch`, has it killed and restarted: its
            step runs again on another worker. Without `tfdist launch`, or when no worker
            is back in time, ``fit`` raises `StepTimeoutError` naming the workers. A
            worker or ps whose server does not answer a probe for ``step_timeout / 2``
            (at most 30 s) is frozen; a frozen ps ends the job at once, named in a
            `StepTimeoutError` (under `tfdist launch` the launcher kills it and names it).
            Default 600 s: far above a healthy step, including the first (which builds the
            worker's function); a frozen task is found after 30 s. None: no watchdog.

    Raises:
        ValueError: bad ``mode``, or a cluster without chief, ps or worker.
        tf.errors.DeadlineExceededError: on the chief, a worker or ps did not start
            within ``startup_timeout``; on a worker or ps, the chief did not (the message
            names the task).
    """

    # The Keras hand-off (tfdist.keras.handoff.KerasHandoff).
    keras_fit_driver = FIT_DRIVER
    keras_atomic_updates = True  # asynchronous steps update ps variables at once
    keras_safe_saves = True  # atomic saves that refuse NaN/inf weights, sharded or not

    def __init__(self, cluster_resolver=None, mode="async", variable_partitioner=None, *,
                 steps_per_dispatch=None, chief_poll_seconds=1.0, startup_timeout=60.0,
                 step_timeout=DEFAULT_STEP_TIMEOUT, exactly_once=True,
                 update_block_bytes=row_blocks.UPDATE_BLOCK_BYTES):
        check_parameter_server(mode, steps_per_dispatch=steps_per_dispatch,
                               chief_poll_seconds=chief_poll_seconds,
                               startup_timeout=startup_timeout, step_timeout=step_timeout,
                               exactly_once=exactly_once,
                               update_block_bytes=update_block_bytes)
        spec = resolve_cluster(cluster_resolver)
        validate_ps_cluster(spec)
        # Fail fast on a dead peer instead of retrying forever; the coordinator reschedules.
        os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
        if spec.task.type in ("worker", "ps"):
            serve_until_chief_done(spec, chief_poll_seconds, startup_timeout)  # no return
        _wait_for_servers(spec, startup_timeout)
        self._spec = spec
        self._mode = mode
        self._steps_per_dispatch = steps_per_dispatch
        super().__init__(_without_evaluator(spec).to_cluster_resolver(),
                         variable_partitioner=variable_partitioner)
        optimizer_state.allow_sharded_updates(self.extended)
        # tape.gradient and optimizer slots for sharded variables, in fit and custom loops
        gradients.install_shard_aware_gradients()
        optimizer_state.install_sharded_optimizer_state()
        embedding.install_sharded_embedding_lookup()
        initialization.install_shard_sized_initialization()
        self._coordinator = tf.distribute.coordinator.ClusterCoordinator(self)
        self._step_timeout = step_timeout
        self._exactly_once = exactly_once
        self.update_block_bytes = update_block_bytes
        self._watchdog = None if step_timeout is None else _StepWatchdog(
            self._coordinator, spec.worker, step_timeout, startup_timeout,
            os.environ.get(env.CONTROL_DIR) or None, ps_addresses=spec.ps)
        self.push_counter = ByteCounter("tfdist_ps_bytes_pushed")  # the step driver adds
        handoff.install_keras_hooks()
        saving.install_sharded_saving()  # save/restore models with sharded variables

    @property
    def mode(self) -> str:
        """``"async"`` or ``"sync"``."""
        return self._mode

    @property
    def coordinator(self) -> tf.distribute.coordinator.ClusterCoordinator:
        """The `ClusterCoordinator` that dispatches steps to the workers."""
        return self._coordinator

    @property
    def cluster(self) -> ClusterSpec:
        """The job's cluster, as `tfdist.MultiWorkerMirroredStrategy.cluster`."""
        return self._spec

    @property
    def num_workers(self) -> int:
        """Tasks that compute steps: the worker tasks (K in sync mode); the chief only
        dispatches them (in `tfdist.MultiWorkerMirroredStrategy` it computes too)."""
        return len(self._spec.worker)

    @property
    def steps_per_dispatch(self):
        return self._steps_per_dispatch

    @property
    def exactly_once(self) -> bool:
        """Whether a step run again after its worker died is applied only once."""
        return self._exactly_once

    @property
    def step_timeout(self):
        """Seconds a step may run on a worker (None: no limit)."""
        return self._step_timeout

    def raise_if_steps_timed_out(self, error=None) -> None:
        """Raises `StepTimeoutError` if the step watchdog gave up (see ``step_timeout``).

        Args:
            error: A TF error the chief received; if it names a ps the watchdog finds
                not answering, waits for the watchdog to name that ps (at most
                ``step_timeout / 2``, 30 s) and raises its error instead.
        """
        if self._watchdog is None:
            return
        if error is not None:
            self._watchdog.settle(error)
        self._watchdog.raise_if_failed()

    @property
    def bytes_communicated(self) -> int:
        """Gradient bytes the workers pushed to the ps tasks (dense size, once per step
        and worker gradient)."""
        return self.push_counter.total
