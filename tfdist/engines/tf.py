"""`TFEngine`: TF's own collectives (the gRPC ring on CPU, NCCL on GPU) under a strategy.

The extended is TF's ``CollectiveAllReduceExtended`` (through the strategy's
overridable ``_create_extended``), the job is joined through TF's coordination service
with a registration barrier (so a missing task is named), and a frozen coordination
leader is named when the others see only a heartbeat timeout.
"""

from __future__ import annotations

import re

from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec
from tfdist.comm.communicator import StrategyCommunicator
from tfdist.engines import peers
from tfdist.engines.base import Engine, summary


class TFEngine(Engine):
    """TF's collectives, as `tf.distribute.MultiWorkerMirroredStrategy` runs them.

    A collective that waits longer than the setup's ``collective_timeout`` (TF's
    ``CommunicationOptions.timeout_seconds``) fails; `peer_error` then names the peers
    that stopped answering.

    From its setup it makes TF's cluster resolver (`tf_cluster_resolver`), the collective
    options (`communication_options`) and the coordination service
    (`configure_coordination`); the strategy makes its extended from them (its
    ``_create_extended``, the one set-up step a strategy subclass overrides).
    """

    def communication_options(self, options):
        """TF's ``CommunicationOptions`` for the collectives, from the strategy's
        `tfdist.CommunicationOptions`, with the setup's collective timeout when the
        options set none."""
        import tensorflow as tf

        tf_options = options.to_tf()
        if tf_options.timeout_seconds is None and self.setup.collective_timeout is not None:
            tf_options = tf_options.merge(tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=self.setup.collective_timeout))
        return tf_options

    serves_one_host = True
    supports_groups = True

    def create_extended(self, strategy, cluster_resolver, options):
        import tensorflow as tf

        tf_resolver = tf_cluster_resolver(cluster_resolver, self.setup.cluster)
        tf_options = self.communication_options(options)
        if self.size > 1:
            configure_coordination(self.setup)
        try:
            return strategy._create_extended(tf_resolver, tf_options)  # its extension point
        except tf.errors.DeadlineExceededError as error:
            raise self.startup_error(error) from error

    def make_inner_communicator(self, name):
        del name
        return TFCommunicator()

    def startup_error(self, error):
        """The start-up timeout as an error that names the missing task(s)."""
        import tensorflow as tf

        cluster = self.setup.cluster
        me = cluster.task.name if cluster.task else "this task"
        others = [t.name for t in cluster.tasks()
                  if t.type in TRAINING_TASK_TYPES and t != cluster.task]
        missing = missing_tasks(error.message, cluster) or (
            "one or more of " + ", ".join(others))
        first_line = error.message.strip().splitlines()[0] if error.message else ""
        return tf.errors.DeadlineExceededError(
            None, None,
            f"{me}: task(s) {missing} did not join the cluster within "
            f"startup_timeout={self.setup.startup_timeout:g}s. Check that every task "
            f"was started with the same cluster and can reach the others. TensorFlow "
            f"said: {first_line}")

    def peer_error(self, error):
        """``error``, or the same error naming the peer(s) that stopped answering.

        Every task sends heartbeats to the coordination service on the leader (the
        chief, else worker-0). When the leader is frozen, the others only see
        "Deadline Exceeded, RPC: .../CoordinationService/Heartbeat". When a collective
        timed out (``collective_timeout``), every other training task's server is
        probed (`tfdist.engines.peers`) and the silent or gone ones are named.
        """
        setup = self.setup
        message = error.message or ""
        leader = coordination_leader(setup.cluster)
        if (leader is not None and leader != setup.task_name
                and "CoordinationService/Heartbeat" in message):
            return type(error)(
                error.node_def, error.op,
                f"{setup.task_name}: {leader}, the coordination service leader, did not "
                f"answer heartbeats within heartbeat_timeout={setup.heartbeat_timeout:g}s: "
                f"it is frozen (e.g. SIGSTOP), overloaded or unreachable. TensorFlow said: "
                f"{summary(message)}")
        if setup.collective_timeout is None or "Collective has timed out" not in message:
            return error
        cluster = setup.cluster
        addresses = {f"{kind}-{index}": address for kind, index, address in
                     (cluster.addresses() if cluster else ())
                     if kind in TRAINING_TASK_TYPES and f"{kind}-{index}" != setup.task_name}
        timeout_text = f"{setup.collective_timeout_name}={setup.collective_timeout:g}s"
        named = peers.name_failed_peers(addresses, "a collective", timeout_text,
                                        min(peers.PROBE_TIMEOUT, setup.collective_timeout))
        if named is None:
            return error
        return type(error)(error.node_def, error.op,
                           f"{setup.task_name}: {named}. TensorFlow said: {summary(message)}")


class TFCommunicator(StrategyCommunicator):
    """The extended's reductions, and a reduce-scatter across workers: TF's collective
    reduce-scatter on GPU (NCCL), an all-to-all of the blocks and a local sum on CPU."""

    def reduce_scatter_workers(self, distribution, tensor):
        import tensorflow as tf

        from tfdist._hooks.zero import collective_all_to_all, collective_reduce_scatter

        scattered = collective_reduce_scatter(distribution, tensor)
        if scattered is not None:
            return scattered
        blocks = collective_all_to_all(distribution, tensor)
        return None if blocks is None else tf.reduce_sum(blocks, axis=0)


def tf_cluster_resolver(source, cluster):
    """The TF ``ClusterResolver`` handed to TF: ``source`` when it is one (the user's).

    TF_CONFIG (``source`` None or ``"env"``) goes through TF's own resolver: TF
    special-cases it to use every local GPU. Other sources become a
    ``SimpleClusterResolver`` of ``cluster`` (a `tfdist.ClusterSpec`) that counts local
    GPUs (listing physical devices does not start TF's runtime).
    """
    import tensorflow as tf

    if source is not None and hasattr(source, "cluster_spec") and hasattr(
            source, "task_type") and not isinstance(source, ClusterSpec):
        return source
    if source is None or source == "env":
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    task = cluster.task
    gpus = len(tf.config.list_physical_devices("GPU"))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.jobs()),
        task_type=task.type if task else "worker", task_id=task.index if task else 0,
        rpc_layer="grpc", num_accelerators={"GPU": gpus} if gpus else None)


def configure_coordination(setup) -> None:
    """Starts TF's coordination service with a registration barrier and timeouts.

    Without the barrier, a worker that never starts makes the strategy's constructor
    block forever; with it, every task fails after ``setup.startup_timeout``.
    """
    from tfdist._hooks import tf as tf_hooks

    tf_hooks.configure_coordination_service(
        setup.cluster.jobs(), register_timeout_seconds=setup.startup_timeout,
        heartbeat_timeout_seconds=setup.heartbeat_timeout)


def coordination_leader(cluster) -> str | None:
    """The task that hosts the coordination service (see
    `_hooks.tf.configure_coordination_service`), or None with fewer than 2 workers."""
    if cluster is None or cluster.num_workers < 2:
        return None
    return "chief-0" if cluster.chief else "worker-0"


def missing_tasks(message: str, cluster) -> str:
    """Task names like ``worker-1`` for every ``/job:worker/.../task:1`` in ``message``."""
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
