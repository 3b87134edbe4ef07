"""The membership service's HTTP server: Horovod's KV store, bounded, quiet, and signed
where tfdist's own messages go.

Horovod's Gloo rendezvous reads and writes this store from C++ (plain GET, PUT and
DELETE under the scopes ``global``, ``local_<host>`` and ``cross_<n>``) and cannot sign.
Its requests come under the current formation's path instead
(``/ELEMENT:PORT/scope/key``, `tfdist._hooks.horovod_gloo`; ELEMENT is the token's HMAC
of the service and membership version, `KVServer.open_formation`), and Gloo's scopes
are served only there: any other request for them (a plain ``/global/0``, a wrong
ELEMENT) is refused with 403, reads included. An older formation's ELEMENT (a member
still forming against it) finds nothing and changes nothing.
tfdist's own scopes (``tfdist-*``) are read-only to clients (the published membership,
node 0's answers; some computed: `KVServer.views`) or signed (`KVServer.signed`): a PUT
there is stored only when
its body is `tfdist.wire.sign`-ed with the job's token, names this server (its
``service`` id, new for each server, so nothing from another job or attempt is taken),
and passes the scope's freshness check (no replay).

Every connection is bounded as the multi-node rendezvous bounds a hello: at most
`tfdist.wire.MAX_PENDING` are open at once (one more closes the oldest), each has
`tfdist.wire.HELLO_SECONDS` for its whole request, a body holds at most `MAX_BODY`
bytes (a longer one is refused before it is read) and the store at most `MAX_STORED`.
A refused request or a broken one is said once per kind of problem, in one quoted line
(`tfdist.wire.quote`); nothing a peer sends reaches the log otherwise.
"""

from __future__ import annotations

import hmac
import re
import socket
import sys
import threading
import time
from typing import Callable

from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from tfdist._hooks import horovod_gloo, horovod_kv
from tfdist.wire import HELLO_SECONDS, MAX_PENDING, quote, verify

MAX_BODY = 1 << 20  # bytes of one PUT; Gloo's values and tfdist's messages are far smaller
MAX_STORED = 64 << 20  # bytes of every value stored
MAX_KEYS = 1 << 16  # keys stored
MAX_SAID = 32  # kinds of problem said; more are counted only
_NAME = re.compile(r"[!-.0-~]{1,256}")  # printable ASCII but space and "/"
_ELEMENT = re.compile(r"g[0-9a-f]{32}(:[0-9]{1,5})?")  # a formation's path (gloo_element)

# A signed scope's freshness check: (key, verified message) -> why it is refused, or None.
Check = Callable[[str, dict], "str | None"]


class KVServer(RendezvousHTTPServer):
    """Horovod's rendezvous store with tfdist's bounds and signed scopes.

    Args:
        address: ``(host, port)`` to listen on.
        token: The job's token; signed scopes need its HMAC.
        service: This server's id, which signed messages must name.
        log: Where the few lines about refused requests go.
        max_pending: Connections open at once; one more closes the oldest.
        deadline: Seconds a connection has for its whole request.
    """

    daemon_threads = True
    block_on_close = False  # closing never waits for a peer

    def __init__(self, address, token: str, service: str, log=None, *,
                 max_pending: int = MAX_PENDING, deadline: float = HELLO_SECONDS):
        super().__init__(address, _Handler, 0)
        self.token, self.service, self.log = token, service, log or sys.stderr
        self.max_pending, self.deadline = max_pending, deadline
        self.views: dict[str, Callable[[str], bytes | None]] = {}
        self.signed: dict[str, Check] = {}
        self.refused = 0  # requests refused or broken, all kinds
        self.formation: str | None = None  # the ELEMENT Gloo's keys are served under
        self.formed: set[str] = set()  # older formations' ELEMENTs
        self.served = 0  # requests of Gloo's store under the current formation
        self._open: dict[socket.socket, float] = {}  # connection -> deadline, oldest first
        self._lock = threading.Lock()
        self._check_lock = threading.Lock()  # one signed scope's check at a time
        self._said: set[str] = set()

    # ---- connections -----------------------------------------------------------------
    def process_request(self, request, client_address):
        with self._lock:
            self._open[request] = time.monotonic() + self.deadline
            oldest = next(iter(self._open)) if len(self._open) > self.max_pending else None
        if oldest is not None:
            self.note("cap", f"more than {self.max_pending} connections were open at once: "
                             "the oldest was closed")
            _cut(oldest)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self):
        """Closes the connections past their deadline (each poll of serve_forever)."""
        now = time.monotonic()
        with self._lock:
            overdue = [sock for sock, deadline in self._open.items() if deadline < now]
        if overdue:
            self.note("deadline", f"closed {len(overdue)} connection(s) that did not send "
                                  f"a whole request within {self.deadline:g}s")
        for sock in overdue:
            _cut(sock)

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            return  # the peer hung up, or was cut off: its own business
        self.note(f"error {type(error).__name__}", f"a request from {client_address[0]} "
                                                   f"failed: {quote(str(error))}")

    def note(self, kind: str, text: str) -> None:
        """Says ``text`` once per ``kind`` (at most `MAX_SAID` kinds), one line."""
        with self._lock:
            self.refused += 1
            if kind in self._said or len(self._said) >= MAX_SAID:
                return
            self._said.add(kind)
        print(f"tfdist launch: membership service: {text}\n", end="", file=self.log,
              flush=True)

    # ---- the store -------------------------------------------------------------------
    def open_formation(self, element: str, plan=None) -> None:
        """Serves Gloo's scopes under ``element`` from now on (a new membership's path);
        the last one's requests are then answered as an empty store's, and ignored.

        Args:
            element: The new formation's path element (`membership.gloo_element`).
            plan: Horovod's host plan of the new formation: the store is emptied and
                its scopes sized for it (``RendezvousHTTPServer.init``) in the same step,
                so that no PUT of the last formation lands in the new one's store.
        """
        with self._lock:
            if plan is not None:
                self.init(plan)
            if self.formation is not None:
                self.formed.add(self.formation)
            self.formation = element

    def store_gloo(self, element: str | None, scope: str, key: str, value: bytes,
                   handler) -> bool:
        """Stores a Gloo PUT made under ``element`` if that is still the current
        formation (checked again here: the PUT's path was checked before its body was
        read, and a new formation may have opened since). Returns whether it was."""
        with self._lock:
            if not _same(element, self.formation):
                return False
            horovod_kv.store_value(handler, scope, key, value)
            return True

    def gloo_path(self, part: str | None) -> str | None:
        """Whether a request for Gloo's scopes under path part ``part`` (None: a plain
        ``/scope/key``) is served: "current", "older" (a past formation's), or None."""
        element = None if part is None else horovod_gloo.path_element(part)
        with self._lock:
            current, formed = self.formation, set(self.formed)
        if _same(element, current):
            return "current"
        return "older" if element in formed else None

    def admit(self, scope: str, key: str, body: bytes) -> str | None:
        """Why a PUT of ``body`` at ``/scope/key`` is refused, or None."""
        if scope.startswith("tfdist-") and scope not in self.signed:
            return "this scope is not written by clients"
        if scope in self.signed:
            message = verify(self.token, body)
            if message is None:
                return "it is not signed with the job's token"
            if message.get("service") != self.service:
                return ("it names another service (a replay from another job or attempt?). "
                        f"Received: service={quote(message.get('service'), 40)}")
            with self._check_lock:  # not _lock: a check may take its owner's lock,
                return self.signed[scope](key, message)  # which holds _lock to publish
        with self.cache_lock:
            values = [v for d in self.cache.values() for v in d.values()]
        if len(values) >= MAX_KEYS or sum(map(len, values)) + len(body) > MAX_STORED:
            return f"the store is full ({len(values)} keys)"
        return None

    def close(self) -> None:
        """Stops serving and closes every open connection (waits for none)."""
        self.shutdown()
        self.server_close()
        with self._lock:
            still = list(self._open)
        for sock in still:
            _cut(sock)


def _same(element: str | None, formation: str | None) -> bool:
    """Whether a request's ``element`` is the ``formation``'s (in constant time)."""
    return element is not None and formation is not None and \
        hmac.compare_digest(element.encode(), formation.encode())


def _cut(sock: socket.socket) -> None:
    try:  # wakes the handler's thread, which then closes it
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(RendezvousHandler):
    """One request: ``/scope/key`` (Gloo's: ``/ELEMENT:PORT/scope/key``), checked before
    anything is read, stored or said."""

    server: KVServer

    def log_message(self, format, *args):  # noqa: A002 - http.server's name
        pass  # quiet: what is worth saying goes through KVServer.note

    def _parts(self) -> tuple[str, str, str | None] | None:
        """``(scope, key, whose)``, or None (refused: answered). ``whose`` is "tfdist"
        for tfdist's scopes; for Gloo's, `KVServer.gloo_path`'s word (None: refused)."""
        parts, element = self.path.split("/"), None
        if len(parts) == 4 and parts[0] == "" and _ELEMENT.fullmatch(parts[1]):
            element = parts.pop(1)
        self.element = None if element is None else horovod_gloo.path_element(element)
        if len(parts) == 3 and parts[0] == "" and all(_NAME.fullmatch(p) for p in parts[1:]):
            scope, key = parts[1:]
            if scope.startswith("tfdist-"):
                if element is None:
                    return scope, key, "tfdist"
            else:
                whose = self.server.gloo_path(element)
                if whose == "current":
                    with self.server._lock:
                        self.server.served += 1
                return scope, key, whose
        self._refuse(400, "path", f"refused a request for {quote(self.path, 60)}: not "
                                  "/SCOPE/KEY")
        return None

    def _refuse(self, status: int, kind: str, text: str) -> None:
        self.server.note(kind, f"{text} (from {self.client_address[0]})")
        self.close_connection = True
        self.send_status_code(status)

    def _refuse_gloo(self, method: str, scope: str, key: str) -> None:
        self._refuse(403, f"gloo {method}", f"refused a {method} of /{quote(scope, 40)}/"
                                            f"{quote(key, 40)}: Gloo's keys are served "
                                            "only under the current formation's path "
                                            "(a member's)")

    def do_GET(self):
        parts = self._parts()
        if parts is None:
            return
        scope, key, whose = parts
        if whose is None:
            self._refuse_gloo("GET", scope, key)
            return
        view = self.server.views.get(scope)
        value = None if whose == "older" else view(key) if view is not None else \
            horovod_kv.stored_value(self, scope, key)
        if value is None:
            self.send_status_code(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(value)))
        self.end_headers()
        self.wfile.write(value)

    def do_PUT(self):
        parts = self._parts()
        if parts is None:
            return
        scope, key, whose = parts
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._refuse(411, "length", f"refused a PUT to /{quote(scope, 40)}/"
                                        f"{quote(key, 40)}: no valid Content-Length")
            return
        if int(length) > MAX_BODY:
            self._refuse(413, "size", f"refused a PUT of {int(length)} bytes to "
                                      f"/{quote(scope, 40)}/{quote(key, 40)}: more than "
                                      f"{MAX_BODY} bytes")
            return
        if whose is None:  # refused before the body is read
            self._refuse_gloo("PUT", scope, key)
            return
        body = self.rfile.read(int(length))
        if len(body) < int(length):
            return  # cut off, or the peer hung up
        if whose == "older":  # a member still forming an older membership: dropped
            self.send_status_code(200)
            return
        problem = self.server.admit(scope, key, body)
        if problem is not None:
            self._refuse(403, f"{scope[:40]} {problem[:20]}",
                         f"refused a PUT to /{quote(scope, 40)}/{quote(key, 40)}: {problem}")
            return
        if whose == "tfdist":
            horovod_kv.store_value(self, scope, key, body)
        else:  # dropped, as an older formation's, if a new one opened meanwhile
            self.server.store_gloo(self.element, scope, key, body, self)
        self.send_status_code(200)

    def do_DELETE(self):
        parts = self._parts()
        if parts is None:
            return
        scope, key, whose = parts
        if whose == "tfdist":
            self._refuse(403, "delete", f"refused a DELETE of /{quote(scope, 40)}/"
                                        f"{quote(key, 40)}: tfdist's scopes are not "
                                        "deleted by clients")
        elif whose is None:
            self._refuse_gloo("DELETE", scope, key)
        elif whose == "older":
            self.send_status_code(200)  # an older formation's end: nothing of it is left
        else:
            self.path = f"/{scope}/{key}"  # Horovod's handler reads /scope/key
            super().do_DELETE()
