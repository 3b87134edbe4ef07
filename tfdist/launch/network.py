"""Addresses for the tasks on this host: free ports, and a private network namespace."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess

from tfdist.cluster import ClusterSpec


def find_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports on ``host`` that were free a moment ago (all held open while choosing)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def make_local_cluster(workers: int, chief: bool = False, ps: int = 0,
                       host: str = "127.0.0.1", evaluator: bool = False) -> ClusterSpec:
    """A cluster of free ports on ``host`` (no task set)."""
    counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
    ports = find_free_ports(sum(counts.values()), host)
    by_type, start = {}, 0
    for task_type, count in counts.items():
        by_type[task_type] = ports[start:start + count]
        start += count
    return ClusterSpec.local(by_type, workers=workers, chief=chief, ps=ps, host=host,
                             evaluator=evaluator)


@contextlib.contextmanager
def private_network():
    """A fresh network namespace with only loopback up; yields the ``wrap`` prefix.

    TensorFlow's gRPC server listens on ``0.0.0.0`` whatever address the cluster names
    (hard-coded in TF's ``grpc_server_lib.cc``). Tasks run with this prefix share one
    namespace whose only interface is its own loopback, so nothing outside the job can
    reach their ports. The namespace has no name: this process holds it open by a file
    descriptor and the tasks by living in it, so the kernel frees it when they are all
    gone, even if this process is killed (a named ``ip netns`` would stay behind).
    Needs root (``unshare --net``, ``nsenter``).

    Raises:
        RuntimeError: namespaces cannot be created here (not root, no ``unshare``).
    """
    # A helper makes the namespace and brings loopback up; we keep a handle, it exits.
    command = ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && read _"]
    try:
        helper = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    except OSError as error:
        raise RuntimeError(f"isolate_network needs `unshare` (util-linux): {error}") from None
    ready = helper.stdout.readline().strip() == "up"
    handle = os.open(f"/proc/{helper.pid}/ns/net", os.O_RDONLY) if ready else None
    _, errors = helper.communicate("")
    if handle is None:
        raise RuntimeError(f"isolate_network needs root to create a network namespace; "
                           f"`{' '.join(command)}` failed with exit code "
                           f"{helper.returncode}: {errors.strip()}")
    try:
        yield ["nsenter", f"--net=/proc/{os.getpid()}/fd/{handle}", "--"]
    finally:
        os.close(handle)
