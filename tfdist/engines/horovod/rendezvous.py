"""Starting Horovod over Gloo for a TF_CONFIG job, without ``horovodrun``.

The chief hosts Gloo's HTTP rendezvous (Horovod's own server) at its TF_CONFIG address;
every task answers liveness probes there while it runs, so that a survivor can name a
frozen or dead peer (`peer_addresses`).
"""

from __future__ import annotations

import os

from tfdist.engines.horovod.ops import hvd, import_horovod, is_initialized

# Task name -> TF_CONFIG address of every other task of a job `init_from_cluster` started.
_peers: dict[str, str] = {}


def init_from_cluster(cluster, timeout_seconds: float = 60.0,
                      peer_timeout: float | None = None) -> None:
    """Starts Horovod over Gloo for a TF_CONFIG cluster, without ``horovodrun``.

    Ranks follow Horovod's own host plan over the training tasks (chief first, then
    the workers), so the chief is rank 0. The chief hosts Gloo's rendezvous at its own
    TF_CONFIG address: with this engine TF's gRPC server does not run, so the port is
    free. Every other task waits (up to ``timeout_seconds``) for that port to open,
    then all call ``hvd.init()``. Does nothing when Horovod's variables are already set
    (``horovodrun``) or Horovod is initialized.

    While the process runs, every task answers liveness probes at its TF_CONFIG
    address (rank 0 with the rendezvous, the others with `_serve_liveness`): see
    `peer_addresses`.

    Gloo's timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``, unless set) is ``peer_timeout``:
    Horovod's background thread negotiates with every rank all the time, so a frozen
    or dead rank stops the others after that long, like TF's heartbeat.

    Args:
        cluster: A `tfdist.ClusterSpec` with this process's ``task``.
        timeout_seconds: How long to wait for the chief and the other tasks.
        peer_timeout: Gloo's timeout; default ``timeout_seconds``.

    Raises:
        TimeoutError: the chief's rendezvous did not open in time (names the chief).
    """
    if is_initialized() or "HOROVOD_RANK" in os.environ:
        hvd()
        return
    from tfdist.engines.horovod import elastic, membership

    if membership.elastic_address():
        host = _split(getattr(cluster, cluster.task.type)[cluster.task.index])[0]
        elastic.join(cluster.task.name, _interface_of(host), _elastic_timeout(),
                     timeout_seconds if peer_timeout is None else peer_timeout)
        return
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    import_horovod()  # before the hello: a task that said hello is ready for Gloo

    from tfdist.cluster import TRAINING_TASK_TYPES

    training = [t for t in cluster.tasks() if t.type in TRAINING_TASK_TYPES]
    hosts = [_split(getattr(cluster, t.type)[t.index])[0] for t in training]
    counts = {host: hosts.count(host) for host in hosts}  # in order of first appearance
    plan = get_host_assignments(parse_hosts(",".join(f"{h}:{n}" for h, n in counts.items())),
                                len(training))
    me = training.index(cluster.task)
    host = hosts[me]
    local_rank = hosts[:me].count(host)
    slot = next(s for s in plan if s.hostname == host and s.local_rank == local_rank)
    leader_host, leader_port = _split(getattr(cluster, training[0].type)[training[0].index])
    names = {s.rank: training[_task_of(s, hosts)].name for s in plan}
    if slot.rank == 0:
        server = _serve_rendezvous(leader_host, leader_port, plan)
        _wait_for_hellos(server, names, timeout_seconds)
    else:
        _serve_liveness(*_split(getattr(cluster, cluster.task.type)[cluster.task.index]))
        _say_hello(leader_host, leader_port, slot.rank, timeout_seconds, training[0].name)
    _peers.clear()
    _peers.update({t.name: getattr(cluster, t.type)[t.index] for t in training
                   if t != cluster.task})
    os.environ.update({
        "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_HOSTNAME": host, "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": _interface_of(host),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": leader_host,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(leader_port)})
    gloo_timeout = timeout_seconds if peer_timeout is None else peer_timeout
    os.environ.setdefault(GLOO_TIMEOUT_ENV, gloo_timeout_value(gloo_timeout))
    hvd()


GLOO_TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"
ELASTIC_TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"  # Horovod's name; the launcher sets it


def _elastic_timeout() -> float:
    """How long a member waits for a membership: the launcher's ``--elastic-timeout``
    plus a margin, so that the launcher, which knows who is missing, decides first."""
    return float(os.environ.get(ELASTIC_TIMEOUT_ENV, "600")) + 30.0


def gloo_timeout_value(seconds: float) -> str:
    """``GLOO_TIMEOUT_ENV``'s value that `init_from_cluster` sets for ``seconds``."""
    return str(int(max(seconds, 1)))


def _task_of(slot, hosts: list[str]) -> int:
    """Index (in ``hosts``' task order) of the task a plan slot belongs to."""
    on_host = [i for i, host in enumerate(hosts) if host == slot.hostname]
    return on_host[slot.local_rank]


# Key scope of the start-up hellos in the rendezvous' key-value store (not Gloo's).
_HELLO_SCOPE = "tfdist-hello"


def _say_hello(host: str, port: int, rank: int, timeout_seconds: float,
               owner: str) -> None:
    """Tells rank 0 (``owner``, at ``host:port``) that this rank is up, before Gloo's
    rendezvous (which would abort), retrying until ``timeout_seconds`` pass.

    Every failure is retried, not only a refused connection: until rank 0 listens, the
    port may answer for something else (a job that held it a moment ago, or, rarely, a
    TCP connection to itself), and a rank 0 that cannot bind it is restarted on new
    ports by the launcher.

    Raises:
        TimeoutError: rank 0 did not take the hello in time (names it).
    """
    import http.client
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_seconds
    request = urllib.request.Request(f"http://{host}:{port}/{_HELLO_SCOPE}/{rank}",
                                     data=b"1", method="PUT")
    while True:
        try:
            urllib.request.urlopen(request, timeout=10).close()
            return
        except (OSError, http.client.HTTPException) as error:  # a non-HTTP answer (a
            # self-connect reads its own request back) is BadStatusLine, not an OSError
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{owner} did not open Horovod's rendezvous at {host}:{port} within "
                    f"{timeout_seconds:g}s ({error}): is it running, and reachable from "
                    "here?") from None
            time.sleep(0.2)


def _wait_for_hellos(server, names: dict, timeout_seconds: float) -> None:
    """On rank 0: waits until every other rank said hello; names the missing ones.

    Without it a rank that never starts makes Gloo's rendezvous abort the process
    (exit 134) after its timeout, naming nobody.
    """
    import time

    deadline = time.monotonic() + timeout_seconds
    while True:
        with server.cache_lock:
            seen = {int(k) for k in server.cache.get(_HELLO_SCOPE, {})}
        missing = [names[r] for r in sorted(names) if r != 0 and r not in seen]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{names[0]}: task(s) {', '.join(missing)} did not join the "
                               f"cluster within startup_timeout={timeout_seconds:g}s. Check "
                               "that every task was started with the same cluster and can "
                               "reach the others.")
        time.sleep(0.1)


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


_rendezvous_servers = []  # rendezvous and liveness servers, kept for the life of the process


def _serve_rendezvous(host: str, port: int, plan) -> None:
    """Gloo's HTTP rendezvous (Horovod's own server) on ``host:port``, in a thread."""
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer((host, port), RendezvousHandler, 0)
    server.init(plan)
    _serve(server, "tfdist-gloo-rendezvous")
    return server


def _serve(server, name: str) -> None:
    """Serves ``server`` from a daemon thread until the process exits, and closes it
    then, after Horovod's own shutdown (an exit handler registered before Horovod's).

    Why: once exit handlers have run, Python's daemon threads stop for good while the
    process may take seconds more to end (TensorFlow's teardown); a port still open
    then would accept probes and never answer, so a peer would call this task frozen.
    Closed, it refuses them: the peer says this task is not running.
    """
    import atexit
    import threading

    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    _rendezvous_servers.append(server)

    def close():
        if thread.is_alive():
            server.shutdown()
        server.server_close()

    atexit.register(close)


def _serve_liveness(host: str, port: int):
    """Answers every HTTP request at ``host:port`` (this task's own TF_CONFIG address,
    unused under this engine), from a thread, so that peers can tell a live task from a
    frozen or dead one (`peer_addresses`).

    Returns:
        The server, or None (with a warning logged) if the port is taken.
    """
    import http.server
    import logging

    class Alive(http.server.BaseHTTPRequestHandler):
        timeout = 10  # seconds a client may take to send its request

        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format, *args):  # noqa: A002 - http.server's signature
            pass

    try:
        server = http.server.ThreadingHTTPServer((host, port), Alive)
    except OSError as error:
        logging.getLogger("tfdist").warning(
            "engine='horovod': cannot answer liveness probes at %s:%d (%s); if this task "
            "freezes, its peers cannot name it.", host, port, error)
        return None
    server.daemon_threads = True
    _serve(server, "tfdist-horovod-liveness")
    return server


def peer_addresses() -> dict[str, str]:
    """Where each other task of this job answers liveness probes: ``{name: "host:port"}``.

    Each task answers any HTTP request (an HTTP/2 preface too: an HTTP/1 error comes
    back) at its TF_CONFIG address while its process runs: rank 0 with Gloo's
    rendezvous server, every other rank with `_serve_liveness`. Both are threads of the
    task's process, so a frozen (SIGSTOPped) task stays silent, although its kernel
    still accepts the connection, and a dead task refuses it. Empty unless
    `init_from_cluster` started Horovod (under ``horovodrun`` nothing answers).
    """
    return dict(_peers)


def _interface_of(host: str) -> str:
    """The network interface that holds ``host``'s address (Gloo binds to it)."""
    import ipaddress
    import socket

    address = socket.gethostbyname(host)
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    raise ValueError(f"no local network interface has the address {address} of this task "
                     f"({host}). Received: TF_CONFIG address host {host!r}")
