"""Elastic membership: which tasks form the Horovod job now, served by the launcher.

The launcher of an elastic job (``tfdist launch --min-workers``) hosts one HTTP server:
Horovod's own Gloo rendezvous server, which also answers ``GET /tfdist-elastic/state``
with the membership: a version number and the member tasks, oldest first. Each time a
task leaves or joins, the launcher re-initializes the rendezvous with a new plan (ranks
follow the members' order, host by host, so the oldest member is rank 0) and then
publishes the next version. A worker re-forms Horovod against that version
(`tfdist.engines.horovod.elastic`). The server lives in the launcher, not in a worker,
so the rendezvous survives the loss of any worker, the chief's too.

The server is `tfdist.engines.horovod.kv_server.KVServer`: the membership is read-only
to clients, and a member's lost report is signed with the job's token (``TFDIST_TOKEN``,
which the launcher gives every task), names this server's ``service`` id (published with
the membership) and the current version; anything else is refused, said once, quoted.
Gloo's own keys are taken only under the current formation's path (`gloo_element`:
the token's HMAC of the service and version), which every member computes and an
outsider cannot.

Once the members of a membership have formed Horovod together, they say so (a signed
report, `report_formed`), and every membership published from then on is ``formed``:
a task whose first membership is formed joins a running job (it takes the state in
``fit``); one whose first is not (the first formation, or one after a worker died
before any formation) starts the job with the others.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
import urllib.request

from tfdist._hooks import horovod_gloo
from tfdist.wire import MAX_PENDING, proof, quote, sign, verify

SCOPE = "tfdist-elastic"
# Members PUT their name here when Horovod failed under them (body: their version).
LOST_SCOPE = "tfdist-elastic-lost"
# Members PUT their name here once they formed Horovod (body: the version they formed).
FORMED_SCOPE = "tfdist-elastic-formed"
# A task PUTs its name here when it is about to form Horovod for the first time (body:
# the version it saw): a joiner is published to the members only then, so they never
# wait in Gloo's rendezvous for one still importing TensorFlow.
READY_SCOPE = "tfdist-elastic-ready"
# A joiner that finds no member holding the training state fails with these words
# (`tfdist.strategies.elastic.fit`), followed by the backup it could resume from, if any;
# the launcher reads them in its output and does not start it again.
NO_STATE_WORDS = "no member of the elastic job holds its training state"
HAS_BACKUP_WORDS = "fit has a backup in"


def gloo_element(token: str, service: str, version: int) -> str:
    """The path under which membership ``version`` of ``service`` forms Gloo: the token's
    HMAC of both, so only a task given the token (a member) can write Gloo's keys."""
    return "g" + proof(token, f"tfdist-gloo {service} {version}")[:32]


def plan_of(members: list[tuple[str, str]]) -> dict[str, dict]:
    """``{task name: slot}`` for ``members`` (``[(name, host), ...]``, oldest first).

    A slot holds Horovod's ``rank``, ``size``, ``local_rank``, ``local_size``,
    ``cross_rank``, ``cross_size`` and the ``host``. Hosts are ordered by their oldest
    member, and ranks run host by host (as Horovod's own host plan).
    """
    hosts: list[str] = []
    for _, host in members:
        if host not in hosts:
            hosts.append(host)
    on_host = {h: [n for n, host in members if host == h] for h in hosts}
    slots, rank = {}, 0
    for host in hosts:
        for local_rank, name in enumerate(on_host[host]):
            slots[name] = {"rank": rank, "size": len(members), "local_rank": local_rank,
                           "local_size": len(on_host[host]), "host": host}
            # Cross ranks: among the hosts that have this local rank.
            peers = [h for h in hosts if len(on_host[h]) > local_rank]
            slots[name].update(cross_rank=peers.index(host), cross_size=len(peers))
            rank += 1
    return slots


class MembershipServer:
    """The launcher's membership service and Gloo rendezvous, in a thread.

    Args:
        host: Address to listen on (every task must reach it).
        min_workers: Published with each membership (the strategy checks its batch).
        max_workers: Likewise.
        port: Port to listen on (0: any free one).
        token: The job's token: lost reports (and ``signed`` scopes) need its HMAC.
        log: Where the server says what it refused (default: stderr).
        signed: More signed scopes: ``{scope: check}``, a `kv_server.Check` of each
            message's freshness (node 0's heartbeats).
    """

    def __init__(self, host: str, min_workers: int, max_workers: int, port: int = 0, *,
                 token: str, log=None, signed: dict | None = None):
        from tfdist.engines.horovod.kv_server import KVServer

        self._lock = threading.Lock()
        self.service = secrets.token_hex(8)
        self._bounds = {"min_workers": min_workers, "max_workers": max_workers}
        self._state = json.dumps({"version": 0, "members": [],
                                  "service": self.service}).encode()
        self.version = 0
        self.formed = False  # some membership formed Horovod: a new task is a joiner
        self.members: list[tuple[str, str]] = []
        # The rendezvous' cap, or more for big jobs: each member's Gloo polls the store
        # with one connection at a time, and so does each launcher's thread.
        self._server = KVServer((host, port), token, self.service, log,
                                max_pending=max(MAX_PENDING, 4 * max_workers))
        self._server.views[SCOPE] = lambda key: self._state if key == "state" else None
        self._server.signed[LOST_SCOPE] = self._fresh_report
        self._server.signed[FORMED_SCOPE] = self._formed_report
        self._server.signed[READY_SCOPE] = self._ready_report
        self._server.signed.update(signed or {})
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="tfdist-elastic-membership", daemon=True)
        self._thread.start()

    def _fresh_report(self, key: str, report: dict) -> str | None:
        """Why a signed lost report at ``key`` is not taken, or None."""
        if report.get("name") != key:
            return f"it names {quote(report.get('name'), 40)}, not its key"
        if report.get("version") != self.version:
            return (f"it is for membership {quote(report.get('version'), 20)}, not the "
                    f"current {self.version} (stale or replayed)")
        return None

    def _formed_report(self, key: str, report: dict) -> str | None:
        """Why a signed formed report at ``key`` is not taken, or None (it is taken: the
        membership is ``formed`` from now on)."""
        version = report.get("version")
        if report.get("name") != key:
            return f"it names {quote(report.get('name'), 40)}, not its key"
        if not isinstance(version, int) or isinstance(version, bool) or \
                not 0 < version <= self.version:
            return (f"it is for membership {quote(version, 20)}, not one of 1.."
                    f"{self.version}")
        with self._lock:
            if not self.formed:
                self.formed = True
                self._state = json.dumps({**json.loads(self._state),
                                          "formed": True}).encode()
        return None

    @staticmethod
    def _ready_report(key: str, report: dict) -> str | None:
        """Why a signed ready report at ``key`` is not taken, or None."""
        if report.get("name") != key:
            return f"it names {quote(report.get('name'), 40)}, not its key"
        version = report.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            return f"its version {quote(version, 20)} is not a number"
        return None

    def ready(self, since: int) -> set[str]:
        """The tasks that said they are ready to form Horovod (`report_ready`) having
        seen membership ``since`` or a newer one."""
        with self._server.cache_lock:
            found = dict(self._server.cache.get(READY_SCOPE, {}))
        reports = [verify(self._server.token, raw) for raw in found.values()]
        return {r["name"] for r in reports if r is not None and r.get("service") ==
                self.service and r.get("version", -1) >= since}

    def forget_ready(self, name: str) -> None:
        """Drops ``name``'s ready report (a new task of that name starts)."""
        with self._server.cache_lock:
            self._server.cache.get(READY_SCOPE, {}).pop(name, None)

    def publish(self, members: list[tuple[str, str]]) -> int:
        """Makes ``members`` (``[(name, host)]``, oldest first) the job; returns its version.

        The rendezvous gets the new plan before the version is published, so a task that
        sees the version finds the plan.
        """
        from horovod.runner.common.util.hosts import SlotInfo

        slots = plan_of(members)
        plan = [SlotInfo(hostname=s["host"], rank=s["rank"], local_rank=s["local_rank"],
                         cross_rank=s["cross_rank"], size=s["size"],
                         local_size=s["local_size"], cross_size=s["cross_size"])
                for s in slots.values()]
        with self._lock:
            self._server.open_formation(  # and clears the last formation's Gloo keys
                gloo_element(self._server.token, self.service, self.version + 1), plan)
            self.version += 1
            self.members = list(members)
            self._state = json.dumps({**self._bounds, "version": self.version,
                                      "service": self.service, "formed": self.formed,
                                      "members": [
                {"name": name, **slots[name]} for name, _ in members]}).encode()
        return self.version

    def reports(self) -> set[str]:
        """The members that reported a lost peer in the current membership."""
        with self._server.cache_lock:
            found = dict(self._server.cache.get(LOST_SCOPE, {}))
        reports = [verify(self._server.token, raw) for raw in found.values()]
        return {r["name"] for r in reports if r is not None and r.get("version") == self.version
                and r.get("service") == self.service}

    def read(self, scope: str) -> dict[str, bytes]:
        """What was PUT under ``scope`` (by key): the elastic nodes' beats."""
        with self._server.cache_lock:
            return dict(self._server.cache.get(scope, {}))

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Serves ``value`` at ``GET /scope/key`` (node 0's word to a node)."""
        with self._server.cache_lock:
            self._server.cache.setdefault(scope, {})[key] = value

    def close(self) -> None:
        """Stops the server and closes every connection still open (waits for none)."""
        self._server.close()
        self._thread.join(timeout=5)


def fetch_state(address: str, timeout: float = 5.0) -> dict:
    """The membership the service at ``address`` publishes: ``{"version", "members"}``."""
    with urllib.request.urlopen(f"http://{address}/{SCOPE}/state", timeout=timeout) as reply:
        return json.loads(reply.read())


def report_lost(address: str, name: str, version: int) -> None:
    """Tells the launcher that Horovod failed under ``name`` in membership ``version``
    (a member it cannot see die may be frozen: `MembershipServer.reports`), signed with
    the job's token (``TFDIST_TOKEN``) for the service at ``address``."""
    _report(address, LOST_SCOPE, name, version)  # if lost, the launcher sees deaths itself


def report_formed(address: str, name: str, version: int) -> None:
    """Tells the launcher that ``name`` formed Horovod in membership ``version`` (every
    membership published from then on is ``formed``), signed as `report_lost`."""
    _report(address, FORMED_SCOPE, name, version)  # if lost, another member's says it


def report_ready(address: str, name: str, timeout: float = 30.0) -> bool:
    """Tells the launcher that ``name`` is about to form Horovod (a joiner is published
    only then: `MembershipServer.ready`), signed as `report_lost`, with the version it
    sees now. Tries again for up to ``timeout`` seconds; returns whether it got through
    (if not, the launcher never lists this task and its wait for a membership says so)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            version = fetch_state(address)["version"]
            if _report(address, READY_SCOPE, name, version):
                return True
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _report(address: str, scope: str, name: str, version: int) -> bool:
    """PUTs ``name``'s signed report for membership ``version`` at ``/scope/name``;
    returns whether it was taken. A failure is not raised (each kind of report has a
    fallback)."""
    from tfdist import env

    try:
        service = fetch_state(address)["service"]
        report = sign(os.environ.get(env.TOKEN, ""),
                      {"name": name, "version": version, "service": service})
        request = urllib.request.Request(f"http://{address}/{scope}/{name}",
                                         data=report, method="PUT")
        urllib.request.urlopen(request, timeout=5).close()
        return True
    except (OSError, ValueError, KeyError):
        return False


def wait_for_membership(address: str, name: str, above: int, timeout: float) -> dict:
    """Waits until the service publishes a version above ``above`` that lists ``name``.

    Returns:
        That state (``{"version", "members"}``).

    Raises:
        TimeoutError: none came within ``timeout`` seconds (says what was last seen).
    """
    deadline = time.monotonic() + timeout
    state: dict = {"version": None, "members": []}
    while True:
        try:
            state = fetch_state(address)
        except OSError:
            pass  # the launcher is busy or restarting its server: try again
        if state["version"] is not None and state["version"] > above and any(
                m["name"] == name for m in state["members"]):
            return state
        if time.monotonic() > deadline:
            names = ", ".join(m["name"] for m in state["members"]) or "none"
            raise TimeoutError(
                f"{name}: the elastic job's membership service at {address} published no "
                f"membership with this task after version {above} within {timeout:g}s "
                f"(last seen: version {state['version']}, members {names}).")
        time.sleep(0.05)


def slot_env(state: dict, name: str, address: str) -> dict[str, str]:
    """The ``HOROVOD_*`` variables that make task ``name`` a member of ``state``: its
    Gloo store writes under the formation's path (`gloo_element`, from the job's token
    in ``TFDIST_TOKEN``)."""
    from tfdist import env

    slot = next(m for m in state["members"] if m["name"] == name)
    token = os.environ.get(env.TOKEN)
    if not token:
        raise RuntimeError(
            f"{name}: {env.TOKEN} is not set, so this task cannot form Gloo against the "
            f"elastic job's membership service at {address} (the launcher gives every "
            f"task the job's token in {env.TOKEN}; keep it in the task's environment)")
    element = gloo_element(token, state["service"], state["version"])
    host, port = address.rsplit(":", 1)
    return {"HOROVOD_RANK": str(slot["rank"]), "HOROVOD_SIZE": str(slot["size"]),
            "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
            "HOROVOD_LOCAL_SIZE": str(slot["local_size"]),
            "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
            "HOROVOD_CROSS_SIZE": str(slot["cross_size"]),
            "HOROVOD_HOSTNAME": slot["host"], "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", **horovod_gloo.rendezvous_env(host, port, element)}


def elastic_address() -> str | None:
    """The membership service's ``HOST:PORT`` of an elastic job, or None."""
    from tfdist import env

    return os.environ.get(env.ELASTIC_ADDR) or None
