"""`TFEngine`: TF's own collectives (the gRPC ring on CPU, NCCL on GPU) under a strategy.

The extended is TF's ``CollectiveAllReduceExtended`` (through the strategy's
overridable ``_create_extended``), the job is joined through TF's coordination service
with a registration barrier (so a missing task is named), and a frozen coordination
leader is named when the others see only a heartbeat timeout.
"""

from __future__ import annotations

import re

from tfdist.cluster import TRAINING_TASK_TYPES
from tfdist.comm.communicator import StrategyCommunicator
from tfdist.engines import peers
from tfdist.engines.base import Engine, summary


class TFEngine(Engine):
    """TF's collectives, as `tf.distribute.MultiWorkerMirroredStrategy` runs them.

    A collective that waits longer than the setup's ``collective_timeout`` (TF's
    ``CommunicationOptions.timeout_seconds``) fails; `peer_error` then names the peers
    that stopped answering.

    The strategy's overridable set-up (``_make_cluster_resolver``,
    ``_make_communication_options``, ``_configure_coordination``, ``_create_extended``)
    is called in that order; a subclass changes the collective
    options in `communication_options`.
    """

    def communication_options(self, options):
        """TF's ``CommunicationOptions`` for the collectives, from the strategy's
        `tfdist.CommunicationOptions`."""
        return options.to_tf()

    serves_one_host = True

    def create_extended(self, strategy, cluster_resolver, options):
        import tensorflow as tf

        tf_resolver = strategy._make_cluster_resolver(cluster_resolver)
        tf_options = strategy._make_communication_options(self.communication_options(options))
        if self.size > 1:
            strategy._configure_coordination()
        try:
            return strategy._create_extended(tf_resolver, tf_options)
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
    """The extended's reductions, and TF's collective reduce-scatter across workers."""

    def reduce_scatter_workers(self, distribution, tensor):
        from tfdist._hooks.zero import collective_reduce_scatter

        return collective_reduce_scatter(distribution, tensor)


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
