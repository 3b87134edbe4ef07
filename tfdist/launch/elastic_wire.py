"""What the nodes of a multi-node elastic job say to node 0, and node 0 to them.

Node 0's launcher hosts the membership service (`tfdist.engines.horovod.membership`) at
``--master``. Every other node's launcher PUTs a signed heartbeat there every
`BEAT_SECONDS` (``/tfdist-elastic-node/<rank>``: its launcher's incarnation, address,
free ports, worker count, and how its workers exited) and reads node 0's signed answer
(``/tfdist-elastic-assign/<rank>``: the names and cluster of its workers, the
replacements and kills node 0 orders, and whether the job is done). A signature is the
HMAC of the shared token (``--token``/``TFDIST_TOKEN``) over the text, as in the
multi-node rendezvous; a message without a valid one is ignored.
"""

from __future__ import annotations

import hmac
import json
import socket
import urllib.request

from tfdist.launch.rendezvous.wire import proof

NODE_SCOPE = "tfdist-elastic-node"
ASSIGN_SCOPE = "tfdist-elastic-assign"
BEAT_SECONDS = 0.5
# A node whose launcher sent no heartbeat for this long is lost, with its workers.
NODE_TIMEOUT = 5.0


def sign(token: str, message: dict) -> bytes:
    """``message`` as JSON with the token's HMAC over it."""
    text = json.dumps(message, sort_keys=True)
    return json.dumps({"body": text, "mac": proof(token, text)}).encode()


def verify(token: str, raw: bytes) -> dict | None:
    """The message of a `sign`-ed ``raw``, or None if its signature is not the token's."""
    try:
        wrapped = json.loads(raw)
        text, mac = wrapped["body"], wrapped["mac"]
        if not (isinstance(text, str) and isinstance(mac, str)) or not hmac.compare_digest(
                mac.encode("ascii", "replace"), proof(token, text).encode("ascii")):
            return None
        message = json.loads(text)
    except (ValueError, TypeError, KeyError):
        return None
    return message if isinstance(message, dict) else None


def put(master: str, scope: str, key: str, data: bytes, timeout: float = 2.0) -> None:
    """PUTs ``data`` at ``http://master/scope/key`` (raises OSError on failure)."""
    request = urllib.request.Request(f"http://{master}/{scope}/{key}", data=data,
                                     method="PUT")
    urllib.request.urlopen(request, timeout=timeout).close()


def get(master: str, scope: str, key: str, timeout: float = 2.0) -> bytes:
    """GETs ``http://master/scope/key`` (raises OSError, 404 included, on failure)."""
    with urllib.request.urlopen(f"http://{master}/{scope}/{key}", timeout=timeout) as reply:
        return reply.read()


def outward_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (what node 0 sees it connect from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
