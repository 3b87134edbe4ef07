"""Whether a peer task's server answers: tells a live task from a frozen or dead one."""

from __future__ import annotations

import socket

# An HTTP/2 client preface and an empty SETTINGS frame: a live gRPC server answers with
# its own SETTINGS at once; a frozen process never does (its kernel still accepts TCP).
# An HTTP/1 server (the Horovod engine's liveness server) answers with an error.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def is_responsive(address: str, timeout: float) -> bool | None:
    """Whether the gRPC server at ``address`` answers within ``timeout`` seconds.

    Returns:
        True if it answered, False if it accepted the connection but stayed silent
        (a frozen or stopped process), None if nothing listens (dead or restarting).
    """
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(_HTTP2_HELLO)
            return len(sock.recv(9)) > 0
    except socket.timeout:
        return False
    except OSError:
        return None
