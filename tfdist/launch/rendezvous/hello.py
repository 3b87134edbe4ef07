"""A node's hello to node 0: its proof of the token, and the type, range and length of
every field, checked before node 0 uses or logs any of it.

Anyone who can reach ``--master`` can send a hello. What node 0 logs of a refused one
is quoted with `tfdist.launch.rendezvous.wire.quote` (printable ASCII, bounded), so a
hello cannot write lines of its own into node 0's log.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from tfdist.launch.rendezvous.wire import proof, quote

TASK_TYPES = ("chief", "worker", "ps")
HELLO_MAX_BYTES = 1 << 16  # a longer hello is not read
MAX_NODES = 1 << 16
MAX_TASKS = 1 << 10  # per node
MAX_RESTARTS = 1 << 20
_PROOF = re.compile(r"[0-9a-f]{64}")
# A host name, or an IPv4 or IPv6 address (with a zone, e.g. fe80::1%eth0).
_ADDR = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")


def is_int(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) in ``low..high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def has_proof(hello: dict, token: str, nonce: str) -> bool:
    """Whether ``hello`` proves it knows ``token``: the HMAC of ``nonce``, in hex."""
    given = hello.get("proof")
    return isinstance(given, str) and _PROOF.fullmatch(given) is not None and \
        hmac.compare_digest(given.encode("ascii"), proof(token, nonce).encode("ascii"))


def field_problem(hello: dict) -> str | None:
    """What is wrong with a field of ``hello`` (its type, range or length), or None.

    Checks each field on its own; whether they agree with node 0's job (its
    ``--nnodes``, the port count) is node 0's to check.
    """
    problems = [
        ("rank", is_int(hello.get("rank"), 0, MAX_NODES - 1), f"an int in 0..{MAX_NODES - 1}"),
        ("nnodes", is_int(hello.get("nnodes"), 1, MAX_NODES), f"an int in 1..{MAX_NODES}"),
        ("max_restarts", is_int(hello.get("max_restarts", 0), 0, MAX_RESTARTS),
         f"an int in 0..{MAX_RESTARTS}"),
        ("addr", _is_addr(hello.get("addr")), "a host name or an IP address (or null)"),
        ("counts", _is_counts(hello.get("counts")),
         f"{{'chief': C, 'worker': W, 'ps': P}} of ints in 0..{MAX_TASKS}"),
        ("ports", _is_ports(hello.get("ports")), "a list of ports (ints in 1..65535)"),
    ]
    for name, valid, expected in problems:
        if not valid:
            return f"{name} must be {expected}. Received: {name}={quote(hello.get(name))}"
    return None


def port_problem(ports: Any, counts: dict[str, int]) -> str | None:
    """Why ``ports`` are not one valid port per task of ``counts``, or None."""
    if not _is_ports(ports) or len(ports) != sum(counts.values()):
        return f"needs one port per task. Received: ports={quote(ports)}"
    return None


def describe_node(hello: dict) -> str:
    """``node 1``, or ``a node`` when its rank is not a valid one."""
    rank = hello.get("rank")
    return f"node {rank}" if is_int(rank, 0, MAX_NODES - 1) else "a node"


def _is_addr(addr: Any) -> bool:
    return addr is None or isinstance(addr, str) and _ADDR.fullmatch(addr) is not None


def _is_counts(counts: Any) -> bool:
    return isinstance(counts, dict) and set(counts) == set(TASK_TYPES) and all(
        is_int(counts[t], 0, MAX_TASKS) for t in TASK_TYPES)


def _is_ports(ports: Any) -> bool:
    return isinstance(ports, list) and len(ports) <= len(TASK_TYPES) * MAX_TASKS and all(
        is_int(p, 1, 65535) for p in ports)
