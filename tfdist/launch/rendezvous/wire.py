"""The rendezvous wire: JSON lines on a socket, the token's proof, node 0's address.

The wire format is JSON, one object per line. Nothing is unpickled. Whatever comes from
the wire is shown only through `quote` or `printable`: printable ASCII, bounded.
"""

from __future__ import annotations

import json
import os
import socket
import threading

from tfdist import env
from tfdist.wire import new_token, printable, proof, quote  # noqa: F401 (re-exported)

TOKEN_ENV = env.TOKEN
MAX_LINE = 1 << 20  # a longer message is refused


class RendezvousError(RuntimeError):
    """The nodes could not form a job: refused, missing, or node 0 went away."""


class Channel:
    """One socket, JSON objects one per line, each way.

    Attributes:
        problem: Why the last `receive` returned None: ``"timed out"``, ``"closed"``,
            or what was received instead of a JSON object.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()
        self.problem: str | None = None

    def send(self, message: dict) -> bool:
        """Sends ``message``; False if the peer is gone."""
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def receive(self, limit: int = MAX_LINE) -> dict | None:
        """The next message, or None (see `problem`) at EOF, on a timeout, or on a line
        that is broken, longer than ``limit`` bytes or not a JSON object."""
        message, self.problem = None, None
        try:
            line = self._reader.readline(limit)
        except socket.timeout:
            self.problem = "timed out"
            return None
        except (OSError, ValueError):
            self.problem = "closed"
            return None
        if not line:
            self.problem = "closed"
        elif not line.endswith(b"\n"):
            self.problem = f"sent {quote(line)} (not a line of at most {limit} bytes)"
        else:
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                pass
            if not isinstance(message, dict):
                self.problem = f"sent {quote(line)} (not a JSON object)"
                message = None
        return message

    def close(self) -> None:
        try:  # wakes a thread blocked reading (closing the reader first would wait for it)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for close in (self.sock.close, self._reader.close):
            try:
                close()
            except OSError:
                pass


def describe_stop(stop: dict) -> str:
    """A "stop" message in words: ``worker-1 exited with code 3 on node 1``."""
    if stop.get("task"):  # the reason starts with the task's name
        return f"{stop['reason']} on node {stop['node']}"
    return f"node {stop['node']}: {stop['reason']}"


def parse_master(master: str) -> tuple[str, int]:
    """``"10.0.0.1:29400"`` -> ``("10.0.0.1", 29400)``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in 1..65535.
    """
    host, _, port = str(master).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master must be HOST:PORT, e.g. 10.0.0.1:29400. "
                         f"Received: master={master!r}")
    return host, int(port)


def resolve_token(token: str | None, node_rank: int, log) -> str:
    """The shared token: ``token``, else $TFDIST_TOKEN, else (node 0) a new one, printed.

    Raises:
        ValueError: a node other than 0 has no token.
    """
    token = token or os.environ.get(TOKEN_ENV)
    if token:
        return token
    if node_rank != 0:
        raise ValueError(f"node {node_rank} needs the rendezvous token that node 0 printed: "
                         f"pass --token or set {TOKEN_ENV}. Received: no token")
    token = new_token()
    print(f"tfdist launch: rendezvous token: {token}  (give every other node --token "
          f"{token}, or set {TOKEN_ENV})", file=log, flush=True)
    return token
