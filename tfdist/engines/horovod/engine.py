"""`HorovodEngine`: a multi-worker strategy's tensors moved by Horovod's ops over Gloo.

With this engine no TF cluster exists: each process's TensorFlow is local and only
Horovod spans processes. Horovod starts without ``horovodrun`` (the chief hosts Gloo's
rendezvous at its TF_CONFIG address, `tfdist.engines.horovod.rendezvous`), or under
``horovodrun``, or alone as a world of size 1.
"""

from __future__ import annotations

import contextlib
import math
import os

from tfdist.comm.communicator import StrategyCommunicator, check_in_group, replica_ids
from tfdist.comm.groups import mesh_groups
from tfdist.engines import peers as peer_probes
from tfdist.engines.base import Engine, summary
from tfdist.engines.horovod import elastic, membership, ops, rendezvous, watch

# Horovod's negotiation cycle (ms) under a strategy that exchanges rarely, unless set:
# Horovod's thread talks to its peers every cycle (default 1 ms: ~340 KB/s per idle
# worker on a link); model averaging needs none of it between averages.
QUIET_CYCLE_MS = "10"
CYCLE_TIME_ENV = "HOROVOD_CYCLE_TIME"
# In Horovod's errors when a peer froze or died; the line with the first one is quoted.
_HOROVOD_FAILURES = ("Horovod has been shut down", "Gloo", "gloo")


class HorovodEngine(Engine):
    """Horovod's collectives (Gloo on CPU, NCCL on GPU builds) under a strategy.

    Replicas span every process (`tfdist.engines.horovod.extended.HorovodExtended`),
    as many per process as stock ``MultiWorkerMirroredStrategy`` makes: its GPUs, else
    one CPU (`tfdist.devices.multi_worker_devices`);
    reductions go through Horovod's ops. Gloo's timeout is the setup's
    ``heartbeat_timeout``, or its ``collective_timeout`` (the strategy's, or
    ``CommunicationOptions.timeout_seconds``) when smaller: a peer frozen that long
    fails every collective, as under TF's engine.
    """

    supports_elastic = True
    supports_groups = True

    def create_extended(self, strategy, cluster_resolver, options):
        import tensorflow as tf

        from tfdist._hooks import tf as tf_hooks
        from tfdist.devices import multi_worker_devices
        from tfdist.engines.horovod.extended import HorovodExtended
        from tfdist.engines.tf import tf_cluster_resolver

        del options  # its timeout is in the setup (Gloo's timeout)
        setup = self.setup
        devices = list(setup.devices or multi_worker_devices())
        if setup.model_parallel is not None:
            self._declare_mesh(len(devices))
        if setup.exchanges_rarely and not ops.is_initialized():
            os.environ.setdefault(CYCLE_TIME_ENV, QUIET_CYCLE_MS)
        # An elastic job forms from the launcher's membership, whatever TF_CONFIG lists
        # (it starts with this worker alone when the others join later, or elsewhere).
        if setup.cluster is not None and (setup.cluster.num_workers > 1 or
                                          membership.elastic_address()):
            try:
                rendezvous.init_from_cluster(setup.cluster, setup.startup_timeout,
                                             peer_timeout=self._gloo_timeout())
            except TimeoutError as error:
                raise tf.errors.DeadlineExceededError(None, None, str(error)) from None
        else:
            ops.init()
        # The replicas of stock MultiWorkerMirroredStrategy (and of engine="tf"): every
        # local GPU, else one CPU per worker, logical CPUs or not; or the setup's.
        tf_hooks.assign_collective_key_base(strategy)
        extended = HorovodExtended(strategy, devices)
        # The resolver TF's engine would hand to TF: stock code reads it.
        extended.set_cluster_resolver(tf_cluster_resolver(cluster_resolver, setup.cluster))
        return extended

    def _declare_mesh(self, local_replicas: int) -> None:
        """Declares the process sets of the data x model mesh (every group of both axes),
        which Horovod makes when it starts. One replica per process: a group of
        replicas is then a set of processes."""
        setup = self.setup
        if local_replicas > 1:
            raise ValueError(
                "A data x model mesh under engine='horovod' needs one replica per process "
                "(Horovod's process sets group processes): use engine='tf'. Received: "
                f"model_parallel={setup.model_parallel}, {local_replicas} local replicas")
        size = int(os.environ.get("HOROVOD_SIZE") or (
            setup.cluster.num_workers if setup.cluster is not None else 1))
        # The strategy's rule (`is_mesh`): an m that does not divide is refused here,
        # before Horovod starts, in the strategy's words; m = n declares none.
        ops.declare_process_sets(mesh_groups(size, setup.model_parallel))

    def make_inner_communicator(self, name):
        del name
        return HorovodCommunicator()

    @property
    def rank(self) -> int:
        return ops.rank()

    @property
    def size(self) -> int:
        return ops.size()

    @property
    def is_chief(self) -> bool:
        """Rank 0 (in an elastic job the oldest member: it takes the lost chief's role),
        else TF's rule over the cluster."""
        cluster = self.setup.cluster
        if cluster is None or elastic.member() is not None:
            return ops.rank() == 0
        return cluster.is_chief()

    def membership(self):
        """This process's `tfdist.engines.horovod.elastic.ElasticMember`, or None
        outside an elastic job."""
        return elastic.member()

    def peer_error(self, error):
        """``error``, or the same error type naming the tasks that stopped answering.

        When a peer freezes or dies, Horovod says only "Horovod has been shut down"
        (after Gloo's timeout, or at once). Then every other task is probed where it
        answers while it runs (`rendezvous.peer_addresses`), all at once
        (`tfdist.engines.peers.name_failed_peers`). Unchanged if all answer.
        """
        message = error.message or ""
        peers = rendezvous.peer_addresses()
        if not peers or not any(m in message for m in _HOROVOD_FAILURES):
            return error
        timeout_text, seconds = self._timeout_as_set()
        named = peer_probes.name_failed_peers(peers, "Horovod", timeout_text,
                                              min(peer_probes.PROBE_TIMEOUT, seconds))
        if named is None:
            return error
        said = next((line.strip() for line in message.splitlines()
                     if _HOROVOD_FAILURES[0] in line), summary(message))
        return type(error)(error.node_def, error.op,
                           f"{self.setup.task_name}: {named}. Horovod said: {said}")

    def watch_peers(self):
        """On a data x model mesh (process sets), a `watch.PeerWatch` of every peer:
        there Horovod aborts the process when a peer freezes, so no error of
        `peer_error` would name it. Else nothing."""
        peers = rendezvous.peer_addresses()
        if not ops.process_sets() or not peers:
            return contextlib.nullcontext()
        timeout_text, seconds = self._timeout_as_set()
        return watch.PeerWatch(self.setup.task_name, peers, timeout_text, seconds)

    def _gloo_timeout(self) -> float:
        return min(self.setup.heartbeat_timeout, self.setup.collective_timeout or math.inf)

    def _timeout_as_set(self) -> tuple[str, float]:
        """Gloo's timeout as set, e.g. ``("heartbeat_timeout=5s", 5.0)``."""
        ours = self._gloo_timeout()
        name = ("heartbeat_timeout" if ours == self.setup.heartbeat_timeout
                else self.setup.collective_timeout_name)
        seconds = os.environ.get(rendezvous.GLOO_TIMEOUT_ENV)
        if seconds is not None and seconds != rendezvous.gloo_timeout_value(ours):
            return f"{rendezvous.GLOO_TIMEOUT_ENV}={seconds}", float(seconds)
        return f"{name}={ours:g}s", ours


class HorovodCommunicator(StrategyCommunicator):
    """The extended's reductions, a reduce-scatter across processes
    (`ops.reducescatter`), and collectives within the groups of a data x model mesh:
    Horovod's allgather, allreduce and that reduce-scatter within the group's process
    set (declared when Horovod started: `HorovodEngine`), one replica per process."""

    supports_groups = True

    def in_group(self, group, kind, distribution, value, op="sum"):
        check_in_group(kind, op)
        import tensorflow as tf

        (part,) = distribution.experimental_local_results(value)  # one replica
        ranks = group.members(replica_ids(distribution)[0])  # replica r is rank r
        with tf.device(part.device):
            part = tf.convert_to_tensor(part)
            if len(ranks) == 1:
                return tf.identity(part)
            within = ops.process_set(ranks)
            if kind == "all_gather":
                return ops.allgather(part, process_set=within)
            if kind == "all_reduce":
                return ops.allreduce([part], op="average" if op == "mean" else "sum",
                                     process_set=within)[0]
            scattered = ops.reducescatter(part, process_set=within)
            return scattered / len(ranks) if op == "mean" else scattered

    def reduce_scatter_workers(self, distribution, tensor):
        del distribution
        return ops.reducescatter(tensor)
