"""Horovod as a communication engine: the only tfdist module that imports horovod.

Horovod is imported lazily, on the first call that needs it, so ``import tfdist`` and
every other mode work without it. Only Horovod's raw collective ops are used
(``allreduce``, ``broadcast``, ``allgather``); its Keras layer is broken under Keras 3.

Processes are started by ``horovodrun -np 2 -H localhost:2 --gloo python train.py``;
Gloo carries the tensors on CPU (NCCL on GPU builds). Outside ``horovodrun`` a process
is a world of size 1, so the same code runs alone.
"""

from __future__ import annotations

import itertools
import os

from tfdist.comm.compression import get_compression

INSTALL_HINT = (
    "Horovod is not installed in this environment. tfdist builds it from source for "
    "TensorFlow 2.21 (pip install horovod fails): run `make horovod` in the tfdist "
    "checkout, or `bash scripts/install_horovod.sh /path/to/python` (about 4 minutes "
    "on 2 cores). See docs/horovod.md.")

_OPS = {"average": "Average", "sum": "Sum"}
# dtypes Horovod's Gloo ops accept; others travel as a wider type (bit-exact for ints).
_WIRE_FOR = {"uint32": "int64", "uint16": "int32", "int16": "int32", "bfloat16": "float32"}

_hvd = None
_op_count = itertools.count()
# Task name -> TF_CONFIG address of every other task of a job `init_from_cluster` started.
_peers: dict[str, str] = {}


def _op_name(name: str | None, kind: str) -> str:
    """``name``, or the next name in call order: Horovod pairs ops across ranks by name.

    Its own default names come from the tensors, which follow Keras' layer names, so a
    rank that built one more model (a reference, say) would wait for names that never
    come. Call order is what every rank shares, as with TF's collective instance keys.
    """
    return name if name is not None else f"tfdist.{kind}.{next(_op_count)}"


def hvd():
    """Returns ``horovod.tensorflow``, imported and initialized on first use.

    Raises:
        ImportError: Horovod is missing; the message says how to install it.
    """
    global _hvd
    if _hvd is None:
        module = _import_horovod()
        if not module.is_initialized():
            module.init()
        _hvd = module
    return _hvd


def _import_horovod():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import horovod.tensorflow as module
    except ImportError as e:  # missing, or built against another TF
        raise ImportError(f"{INSTALL_HINT} (import error: {e})") from e
    return module


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
    if _hvd is not None or "HOROVOD_RANK" in os.environ:
        hvd()
        return
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    _import_horovod()  # before the hello: a task that said hello is ready for Gloo

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
        _wait_for_port(leader_host, leader_port, timeout_seconds, training[0].name)
        _say_hello(leader_host, leader_port, slot.rank)
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


def gloo_timeout_value(seconds: float) -> str:
    """``GLOO_TIMEOUT_ENV``'s value that `init_from_cluster` sets for ``seconds``."""
    return str(int(max(seconds, 1)))


def _task_of(slot, hosts: list[str]) -> int:
    """Index (in ``hosts``' task order) of the task a plan slot belongs to."""
    on_host = [i for i, host in enumerate(hosts) if host == slot.hostname]
    return on_host[slot.local_rank]


# Key scope of the start-up hellos in the rendezvous' key-value store (not Gloo's).
_HELLO_SCOPE = "tfdist-hello"


def _say_hello(host: str, port: int, rank: int) -> None:
    """Tells rank 0 that this rank is up, before Gloo's rendezvous (which would abort)."""
    import urllib.request

    request = urllib.request.Request(f"http://{host}:{port}/{_HELLO_SCOPE}/{rank}",
                                     data=b"1", method="PUT")
    urllib.request.urlopen(request, timeout=10).close()


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
    import threading

    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer((host, port), RendezvousHandler, 0)
    server.init(plan)
    threading.Thread(target=server.serve_forever, name="tfdist-gloo-rendezvous",
                     daemon=True).start()
    _rendezvous_servers.append(server)
    return server


def _serve_liveness(host: str, port: int):
    """Answers every HTTP request at ``host:port`` (this task's own TF_CONFIG address,
    unused under this engine), from a thread, so that peers can tell a live task from a
    frozen or dead one (`peer_addresses`).

    Returns:
        The server, or None (with a warning logged) if the port is taken.
    """
    import http.server
    import logging
    import threading

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
    threading.Thread(target=server.serve_forever, name="tfdist-horovod-liveness",
                     daemon=True).start()
    _rendezvous_servers.append(server)
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


def _wait_for_port(host: str, port: int, timeout_seconds: float, owner: str) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{owner} did not open Horovod's rendezvous at {host}:{port} within "
                    f"{timeout_seconds:g}s: is it running, and reachable from here?") from None
            time.sleep(0.2)


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


def is_available() -> bool:
    """True if ``horovod.tensorflow`` can be imported (does not initialize it)."""
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


def init() -> None:
    """Initializes Horovod (idempotent). Every rank must call it."""
    hvd()


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return hvd().rank()


def size() -> int:
    """Number of Horovod processes."""
    return hvd().size()


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return hvd().local_rank()


def _check_op(op: str) -> str:
    if op not in _OPS:
        raise ValueError(f"op must be 'average' or 'sum'. Received: op={op!r}")
    return op


def _to_wire(tensor, compression):
    """Returns ``(wire, restore)``: the tensor as sent, and a function undoing that.

    Compresses floating tensors and widens dtypes Horovod's ops lack (bit-exact).
    """
    import tensorflow as tf

    wire, dtype = compression.compress(tf.convert_to_tensor(tensor))
    compressed = wire.dtype
    if compressed == tf.bool:
        wire = tf.cast(wire, tf.uint8)
    elif compressed.name in _WIRE_FOR:
        wire = tf.cast(wire, _WIRE_FOR[compressed.name])

    def restore(result):
        if result.dtype != compressed:
            result = tf.cast(result, compressed)
        return compression.decompress(result, dtype)

    return wire, restore


def allreduce(tensors: list, op: str = "average", compression=None, name: str | None = None) -> list:
    """All-reduces each tensor across all Horovod processes.

    Works eagerly and inside ``tf.function``. Every rank must call it with tensors of
    the same shapes and dtypes in the same order.

    Args:
        tensors: A list of dense tensors (IndexedSlices are densified).
        op: ``"average"`` (divide by `size()`) or ``"sum"``.
        compression: None, ``"fp16"``, ``"bf16"`` or a `Compression`: floating tensors
            travel in that dtype and come back in their own.
        name: Optional name prefix for the Horovod ops (default: one from call order,
            the same on every rank).

    Returns:
        A list of reduced tensors, same dtypes and order as ``tensors``.
    """
    import tensorflow as tf

    _check_op(op)
    policy = get_compression(compression)
    h = hvd()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    wires, restores = zip(*(_to_wire(t, policy) for t in tensors))
    # Integers are summed and divided here: Horovod's Average on ints truncates.
    name = _op_name(name, "allreduce")
    results = []
    hop = h.Sum if op == "sum" or not all(w.dtype.is_floating for w in wires) else h.Average
    for i, wire in enumerate(wires):
        results.append(h.allreduce(wire, op=hop, name=f"{name}_{i}"))
    out = []
    for wire, restore, tensor in zip(results, restores, tensors):
        value = restore(wire)
        dtype = tensor.dtype
        if op == "average" and hop == h.Sum:
            if dtype.is_floating:
                value = value / tf.cast(h.size(), dtype)
            else:
                value = tf.cast(tf.math.floordiv(tf.cast(value, tf.int64), h.size()), dtype)
        out.append(value)
    return out


def broadcast(tensor, root_rank: int = 0, name: str | None = None):
    """Returns ``root_rank``'s value of ``tensor`` on every rank (eager or graph)."""
    wire, restore = _to_wire(tensor, get_compression(None))
    return restore(hvd().broadcast(wire, root_rank=root_rank,
                                   name=_op_name(name, "broadcast")))


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    Args:
        variables: An iterable of variables (plain or distributed: every local copy
            of a mirrored variable gets the value).
        root_rank: The rank whose values win.
    """
    for v in variables:
        v.assign(broadcast(v.read_value() if hasattr(v, "read_value") else v, root_rank))


def allgather(tensor, name: str | None = None):
    """Concatenates ``tensor`` from every rank along axis 0 (dims > 0 must agree)."""
    wire, restore = _to_wire(tensor, get_compression(None))
    return restore(hvd().allgather(wire, name=_op_name(name, "allgather")))
