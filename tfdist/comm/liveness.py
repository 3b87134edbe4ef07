"""Probing a peer task's server: tells a live task from a frozen, dead or cut-off one."""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

# An HTTP/2 client preface and an empty SETTINGS frame: a live gRPC server answers with
# its own SETTINGS at once; a frozen process never does (its kernel still accepts TCP).
# An HTTP/1 server (the Horovod engine's liveness server) answers with an error.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])

# What a probe found (`Probe.state`).
ANSWERS = "answers"  # the server answered: the task runs
SILENT = "silent"  # its host accepted the connection, the server never answered: frozen
REFUSED = "refused"  # its host answered that nothing listens: the task is not running
UNREACHABLE = "unreachable"  # no answer from its host at all: network down, no route,
#                              blackholed, or the host is off; the task may still run

# Errors of a connection refused by a host that is up: nothing listens there.
_REFUSALS = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError)


class Probe(NamedTuple):
    """What probing one address found.

    Attributes:
        state: `ANSWERS`, `SILENT`, `REFUSED` or `UNREACHABLE`.
        detail: Why, in a few words, e.g. ``"no route to host"`` or ``"connection
            refused"``; empty when it answered.
    """

    state: str
    detail: str = ""


def probe(address: str, timeout: float) -> Probe:
    """Connects to ``address`` (``host:port``) and waits ``timeout`` seconds for an answer.

    A refused connection (the host is up, nothing listens) and an unreachable host
    (network unreachable, no route, or no reply to the connection at all within
    ``timeout``) are different diagnoses: only the first means the task is not running.
    """
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except socket.timeout:
        return Probe(UNREACHABLE, f"no reply to the connection within {timeout:g}s")
    except _REFUSALS as error:
        return Probe(REFUSED, _reason(error))
    except OSError as error:  # ENETUNREACH, EHOSTUNREACH, ENETDOWN, a name not found...
        return Probe(UNREACHABLE, _reason(error))
    with sock:
        try:
            sock.settimeout(timeout)
            sock.sendall(_HTTP2_HELLO)
            answered = len(sock.recv(9)) > 0
        except socket.timeout:
            return Probe(SILENT, f"no answer within {timeout:g}s")
        except OSError as error:
            return Probe(REFUSED, _reason(error))
    return Probe(ANSWERS) if answered else Probe(SILENT, "closed without answering")


def is_responsive(address: str, timeout: float) -> bool | None:
    """Whether the gRPC server at ``address`` answers within ``timeout`` seconds.

    Returns:
        True if it answered, False if it stayed silent or its host could not be reached
        (frozen, stopped, or cut off), None if nothing listens (dead or restarting).
    """
    return {ANSWERS: True, SILENT: False, UNREACHABLE: False,
            REFUSED: None}[probe(address, timeout).state]


def _reason(error: OSError) -> str:
    """``"no route to host"``: the OS's words for ``error``."""
    if isinstance(error, socket.gaierror):
        return f"name not resolved ({error.strerror})"
    code = error.errno or 0
    return os.strerror(code).lower() if code else (str(error) or type(error).__name__)

