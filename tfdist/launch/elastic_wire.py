"""What the nodes of a multi-node elastic job say to node 0, and node 0 to them.

Node 0's launcher hosts the membership service (`tfdist.engines.horovod.membership`) at
``--master``. Every other node's launcher PUTs a signed heartbeat there every
`BEAT_SECONDS` (``/tfdist-elastic-node/<rank>``: its launcher's incarnation, address,
free ports, worker count, and how its workers exited) and reads node 0's signed answer
(``/tfdist-elastic-assign/<rank>``: the names and cluster of its workers, the
replacements and kills node 0 orders, and whether the job is done). A signature is the
HMAC of the shared token (``--token``/``TFDIST_TOKEN``) over the text, as in the
multi-node rendezvous (`tfdist.wire`). Node 0's service refuses a beat that is not
signed, that names another service id (the ``service`` of its published membership,
new for each server) or that is not fresh (`FreshBeats`); clients cannot write the
answers. A launcher that ends sends a last beat with ``ended`` set, so node 0 stops
expecting it at once.
"""

from __future__ import annotations

import socket
import urllib.request

from tfdist.launch.rendezvous.hello import is_int
from tfdist.wire import sign, verify  # noqa: F401 (re-exported: the nodes' messages)

NODE_SCOPE = "tfdist-elastic-node"
ASSIGN_SCOPE = "tfdist-elastic-assign"
BEAT_SECONDS = 0.5
# A node whose launcher sent no heartbeat for this long is lost, with its workers.
NODE_TIMEOUT = 5.0


class FreshBeats:
    """The freshness check of node 0's heartbeat scope (`kv_server.Check`): per rank, a
    beat is taken only when it is newer than the last one taken from its launcher
    (its ``incarnation``), and never from a launcher that a newer one replaced. A beat
    read off the network and sent again is refused, so it cannot re-form the job."""

    def __init__(self):
        self.newest: dict[str, tuple[str, int]] = {}  # rank -> (incarnation, beat)
        self.retired: dict[str, set[str]] = {}  # rank -> incarnations replaced

    def __call__(self, key: str, beat: dict) -> str | None:
        incarnation, count = beat.get("incarnation"), beat.get("beat")
        if not isinstance(incarnation, str) or not is_int(count, 0, 1 << 62):
            return "it needs an incarnation and a beat count"
        if incarnation in self.retired.get(key, ()):
            return "its launcher was replaced by a newer one (a replayed heartbeat?)"
        last = self.newest.get(key)
        if last is not None and last[0] == incarnation and count <= last[1]:
            return f"beat {count} is not newer than beat {last[1]} (a replayed heartbeat?)"
        if last is not None and last[0] != incarnation:
            self.retired.setdefault(key, set()).add(last[0])
        self.newest[key] = (incarnation, count)
        return None


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
