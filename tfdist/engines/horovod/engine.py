"""`HorovodEngine`: a multi-worker strategy's tensors moved by Horovod's ops over Gloo.

With this engine no TF cluster exists: each process's TensorFlow is local and only
Horovod spans processes. Horovod starts without ``horovodrun`` (the chief hosts Gloo's
rendezvous at its TF_CONFIG address, `tfdist.engines.horovod.rendezvous`), or under
``horovodrun``, or alone as a world of size 1.
"""

from __future__ import annotations

import math
import os

from tfdist.comm import liveness
from tfdist.comm.communicator import StrategyCommunicator
from tfdist.engines.base import Engine, summary
from tfdist.engines.horovod import elastic, membership, ops, rendezvous

# Seconds a peer has to answer a liveness probe after Horovod stopped.
PROBE_TIMEOUT = 2.0
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
    reductions go through Horovod's ops. Gloo's timeout is the strategy's
    ``heartbeat_timeout`` (or ``collective_timeout`` when smaller).
    """

    def create_extended(self, cluster_resolver, options):
        import tensorflow as tf

        from tfdist.devices import multi_worker_devices
        from tfdist.engines.horovod.extended import HorovodExtended

        del options  # timeouts are Gloo's
        strategy = self.strategy
        if getattr(strategy, "exchanges_rarely", False) and not ops.is_initialized():
            os.environ.setdefault(CYCLE_TIME_ENV, QUIET_CYCLE_MS)
        # An elastic job forms from the launcher's membership, whatever TF_CONFIG lists
        # (it starts with this worker alone when the others join later, or elsewhere).
        if strategy.cluster is not None and (strategy.cluster.num_workers > 1 or
                                             membership.elastic_address()):
            try:
                rendezvous.init_from_cluster(strategy.cluster, strategy.startup_timeout,
                                             peer_timeout=self._gloo_timeout())
            except TimeoutError as error:
                raise tf.errors.DeadlineExceededError(None, None, str(error)) from None
        else:
            ops.init()
        # The replicas of stock MultiWorkerMirroredStrategy (and of engine="tf"): every
        # local GPU, else one CPU per worker, logical CPUs or not.
        extended = HorovodExtended(strategy, multi_worker_devices())
        # The resolver TF's engine would hand to TF: stock code reads it.
        extended.set_cluster_resolver(strategy._make_cluster_resolver(cluster_resolver))
        return extended

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
        cluster = self.strategy.cluster
        if cluster is None or elastic.member() is not None:
            return ops.rank() == 0
        return cluster.is_chief()

    def peer_error(self, error):
        """``error``, or the same error type naming the tasks that stopped answering.

        When a peer freezes or dies, Horovod says only "Horovod has been shut down"
        (after Gloo's timeout, or at once). Then every other task is probed where it
        answers while it runs (`rendezvous.peer_addresses`), all at once, for at most
        `PROBE_TIMEOUT` seconds each (connect, then answer): silent ones are named as
        frozen, refused ones as not running, and ones whose host cannot be reached (a
        network outage: no route, network unreachable, no reply to the connection) as
        cut off, maybe still running. Unchanged if all answer.
        """
        message = error.message or ""
        peers = rendezvous.peer_addresses()
        if not peers or not any(m in message for m in _HOROVOD_FAILURES):
            return error
        timeout_text, seconds = self._timeout_as_set()
        probe_timeout = min(PROBE_TIMEOUT, seconds)
        found = _probe(peers, probe_timeout)
        silent, gone, cut_off = (found[state] for state in (
            liveness.SILENT, liveness.REFUSED, liveness.UNREACHABLE))
        if not silent and not gone and not cut_off:
            return error
        what = []
        if silent:
            what.append(f"{_tasks(silent)} did not answer Horovod within {timeout_text}, nor "
                        f"a liveness probe within {probe_timeout:g}s: "
                        f"{'it is' if len(silent) == 1 else 'they are'} frozen (e.g. "
                        "SIGSTOP), overloaded or unreachable")
        if gone:
            addresses = ", ".join(peers[name] for name, _ in gone)
            what.append(f"{_tasks(gone)} {'is' if len(gone) == 1 else 'are'} not running "
                        f"(nothing listens at {addresses}): killed or exited")
        if cut_off:
            reasons = ", ".join(f"{peers[name]}: {detail}" for name, detail in cut_off)
            what.append(f"{_tasks(cut_off)} could not be reached ({reasons}): a network "
                        "outage (link down, no route, firewall), not a task known to "
                        f"have exited; {'it' if len(cut_off) == 1 else 'they'} may still run")
        said = next((line.strip() for line in message.splitlines()
                     if _HOROVOD_FAILURES[0] in line), summary(message))
        return type(error)(error.node_def, error.op,
                           f"{self.strategy.task_name}: {'; '.join(what)}. Horovod said: "
                           f"{said}")

    def _gloo_timeout(self) -> float:
        return min(self.strategy.heartbeat_timeout,
                   self.strategy.collective_timeout or math.inf)

    def _timeout_as_set(self) -> tuple[str, float]:
        """Gloo's timeout as set, e.g. ``("heartbeat_timeout=5s", 5.0)``."""
        ours = self._gloo_timeout()
        name = ("heartbeat_timeout" if ours == self.strategy.heartbeat_timeout
                else "collective_timeout")
        seconds = os.environ.get(rendezvous.GLOO_TIMEOUT_ENV)
        if seconds is not None and seconds != rendezvous.gloo_timeout_value(ours):
            return f"{rendezvous.GLOO_TIMEOUT_ENV}={seconds}", float(seconds)
        return f"{name}={ours:g}s", ours


class HorovodCommunicator(StrategyCommunicator):
    """The extended's reductions, and Horovod's own reduce-scatter across processes."""

    def reduce_scatter_workers(self, distribution, tensor):
        del distribution
        return ops.reducescatter(tensor)


def _tasks(found: list[tuple[str, str]]) -> str:
    names = [name for name, _ in found]
    return names[0] if len(names) == 1 else "task(s) " + ", ".join(names)


def _probe(peers: dict[str, str], timeout: float) -> dict[str, list[tuple[str, str]]]:
    """``{state: [(task name, detail), ...]}`` for ``peers`` (``{name: address}``), probed
    at once with `tfdist.comm.liveness.probe` (an HTTP/2 preface: any server that runs
    answers, and the servers of `tfdist.engines.horovod.rendezvous` do)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(peers), 64),
                            thread_name_prefix="tfdist-probe") as pool:
        probes = list(pool.map(lambda address: liveness.probe(address, timeout),
                               peers.values()))
    found = {state: [] for state in (liveness.ANSWERS, liveness.SILENT, liveness.REFUSED,
                                     liveness.UNREACHABLE)}
    for name, result in zip(peers, probes):
        found[result.state].append((name, result.detail))
    return found
