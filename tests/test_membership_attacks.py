"""The elastic membership service under attack (docs/elastic.md, "Security").

In-process: the service's signing, freshness and bounds, against a `MembershipServer`
on loopback (no TensorFlow). Launched: one clean two-host elastic job (network
namespaces, as tests/test_multi_node.py makes them) that tests/membership_attacks.py
attacks from node 1's host while it trains: each attack's test reads the same job. The
job must end equal to one process, both launchers must exit on time (a slowloris still
holds sockets open), and neither log may hold a raw escape or a traceback.
"""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from helpers import TESTS_DIR, assert_weights_close, require_horovod
from test_multi_node import REPO, _env, _port, _wait_for, hosts  # noqa: F401 (fixture)

TOKEN = "attack-test-token"


# ---- in-process: the service ---------------------------------------------------------

@pytest.fixture()
def service():
    """A membership service on loopback with node heartbeats, its log, and one
    membership published."""
    require_horovod()
    from tfdist.engines.horovod.membership import MembershipServer
    from tfdist.launch.elastic_wire import NODE_SCOPE, FreshBeats

    log = io.StringIO()
    server = MembershipServer("127.0.0.1", 1, 2, token=TOKEN, log=log,
                              signed={NODE_SCOPE: FreshBeats()})
    server.publish([("worker-0", "127.0.0.1"), ("worker-1", "127.0.0.1")])
    server.log = log
    yield server
    server.close()


def _put(server, path, body):
    request = urllib.request.Request(f"http://{server.address}{path}", data=body,
                                     method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def _raw(server, data, read=True):
    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(data)
    if not read:
        return sock
    with sock:
        return sock.recv(200).split(b"\r\n")[0].decode()


def _report(name, version, service, token=TOKEN):
    from tfdist.wire import sign

    return sign(token, {"name": name, "version": version, "service": service})


def _assert_quiet(text):
    assert "\x1b" not in text and "Traceback" not in text, text
    assert all(" " <= c <= "~" for line in text.splitlines() for c in line), text


def test_a_lost_report_counts_only_signed_for_this_service_and_membership(service):
    lost = "/tfdist-elastic-lost/worker-0"
    assert _put(service, lost, b"1") == 403  # the old, unsigned form
    assert _put(service, lost, _report("worker-0", 1, service.service, "other")) == 403
    assert _put(service, lost, _report("worker-0", 1, "0" * 16)) == 403  # another attempt
    assert _put(service, lost, _report("worker-1", 1, service.service)) == 403  # its key
    assert service.reports() == set()
    assert _put(service, lost, _report("worker-0", 1, service.service)) == 200
    assert service.reports() == {"worker-0"}
    service.publish([("worker-0", "127.0.0.1")])
    assert _put(service, lost, _report("worker-0", 1, service.service)) == 403  # replayed
    assert service.reports() == set()
    said = service.log.getvalue()
    assert "refused a PUT to /'tfdist-elastic-lost'/'worker-0': it is not signed with " \
           "the job's token" in said
    assert "not the current 2 (stale or replayed)" in said
    _assert_quiet(said)


def test_a_heartbeat_is_taken_once_and_never_from_a_replaced_launcher(service):
    from tfdist.launch.elastic_wire import sign

    def beat(incarnation, count):
        return sign(TOKEN, {"rank": 1, "incarnation": incarnation, "beat": count,
                            "service": service.service})

    path = "/tfdist-elastic-node/1"
    assert _put(service, path, beat("a", 1)) == 200
    assert _put(service, path, beat("a", 1)) == 403  # replayed
    assert _put(service, path, beat("a", 2)) == 200
    assert _put(service, path, beat("b", 1)) == 200  # a new launcher of node 1
    assert _put(service, path, beat("a", 3)) == 403  # the replaced one, replayed
    for _ in range(50):  # a flood of garbage never replaces the real beat
        assert _put(service, path, b'{"rank": 1, "beat": 99}') == 403
    assert json.loads(json.loads(service.read("tfdist-elastic-node")["1"])["body"])[
        "incarnation"] == "b"
    assert service.log.getvalue().count("\n") <= 4  # said once per kind, not per request
    assert _put(service, "/tfdist-elastic-assign/1", beat("b", 5)) == 403
    assert _put(service, "/tfdist-elastic/state", b"{}") == 403


def test_oversized_and_broken_requests_are_refused_before_being_read(service):
    assert _raw(service, b"PUT /global/x HTTP/1.1\r\nContent-Length: 1500000000\r\n\r\n") \
        == "HTTP/1.0 413 Request Entity Too Large"
    assert _raw(service, b"PUT /global/x HTTP/1.0\r\n\r\n").startswith("HTTP/1.0 411")
    assert _raw(service, b"PUT /global/x HTTP/1.0\r\nContent-Length: x1\r\n\r\n") \
        .startswith("HTTP/1.0 411")
    for path in (b"/\x1b[31mred/x", b"/a/b/c", b"/a", b"/tfdist-elastic-lost/\x1b]0;t\x07"):
        assert _raw(service, b"GET " + path + b" HTTP/1.0\r\n\r\n").startswith(
            "HTTP/1.0 400"), path
    assert _raw(service, b"DELETE /tfdist-elastic/state HTTP/1.0\r\n\r\n").startswith(
        "HTTP/1.0 403")
    _raw(service, b"\x1b[2J garbage\r\n\r\n")
    said = service.log.getvalue()
    assert "refused a PUT of 1500000000 bytes to /'global'/'x'" in said
    assert "refused a request for '/\\x1b[31mred/x'" in said
    _assert_quiet(said)


def _request(server, path, method, body=None):
    request = urllib.request.Request(f"http://{server.address}{path}", data=body,
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


def _member_path(server, version=None):
    """Where a member's Gloo store sends its requests (Horovod's URL, `slot_env`'s)."""
    from tfdist.engines.horovod.membership import gloo_element

    port = server.address.rsplit(":", 1)[1]
    return f"/{gloo_element(TOKEN, server.service, version or server.version)}:{port}"


def test_gloo_scopes_still_work_for_members(service, monkeypatch):
    from tfdist import env
    from tfdist.engines.horovod import membership

    monkeypatch.setenv(env.TOKEN, TOKEN)
    state = membership.fetch_state(service.address)
    slot = membership.slot_env(state, "worker-0", service.address)
    port = service.address.rsplit(":", 1)[1]
    assert slot["HOROVOD_GLOO_RENDEZVOUS_ADDR"] + ":" + slot[
        "HOROVOD_GLOO_RENDEZVOUS_PORT"] == f"127.0.0.1:{port}{_member_path(service)}"
    path = _member_path(service)
    assert _request(service, f"{path}/global/0", "PUT", b"addr-of-rank-0")[0] == 200
    monkeypatch.delenv(env.TOKEN)
    with pytest.raises(RuntimeError, match=r"^worker-0: TFDIST_TOKEN is not set, so this "
                                           "task cannot form Gloo against"):
        membership.slot_env(state, "worker-0", service.address)
    assert _request(service, f"{path}/global/0", "GET") == (200, b"addr-of-rank-0")
    assert _request(service, f"{path}/global/0", "DELETE")[0] == 200


def test_an_outsider_cannot_touch_gloo_keys_during_a_formation(service):
    """Item 15 of issue 39: an outsider's DELETE, PUT (and GET) of Gloo's keys while
    the members form is refused with 403 and changes nothing; the formation completes
    (both members' keys read back, both Finalize DELETEs clear the scope)."""
    member = _member_path(service)
    scopes = ["global", "local_127.0.0.1", "cross_0"]
    for scope in scopes:  # the members' own writes: each rank's address
        for rank in (0, 1):
            assert _request(service, f"{member}/{scope}/{rank}", "PUT",
                            f"{scope}-{rank}".encode())[0] == 200
    wrong = f"/g{'0' * 32}:{service.address.rsplit(':', 1)[1]}"
    for prefix in ("", wrong):
        for scope in scopes:
            for rank in (0, 1, 0, 1):  # twice each: Horovod clears a scope at size DELETEs
                assert _request(service, f"{prefix}/{scope}/{rank}", "DELETE")[0] == 403
            assert _request(service, f"{prefix}/{scope}/0", "PUT", b"garbage")[0] == 403
            assert _request(service, f"{prefix}/{scope}/9", "PUT", b"garbage")[0] == 403
            assert _request(service, f"{prefix}/{scope}/0", "GET")[0] == 403  # no leak
    for scope in scopes:  # the formation completes: every key as its member wrote it
        for rank in (0, 1):
            assert _request(service, f"{member}/{scope}/{rank}", "GET") == (
                200, f"{scope}-{rank}".encode())
        assert _request(service, f"{member}/{scope}/9", "GET")[0] == 404
    for scope in scopes:  # each member's Finalize
        for rank in (0, 1):
            assert _request(service, f"{member}/{scope}/{rank}", "DELETE")[0] == 200
    with service._server.cache_lock:
        assert not any(service._server.cache.get(scope) for scope in scopes)
    said = service.log.getvalue()
    assert "refused a DELETE of /'global'/'0': Gloo's keys are served only under the " \
           "current formation's path (a member's) (from 127.0.0.1)" in said
    assert "refused a PUT of /'global'/'0'" in said and "refused a GET of" in said
    _assert_quiet(said)


def test_an_older_formation_finds_nothing_and_changes_nothing(service):
    """A member still forming the last membership after a new one is published: its
    requests are answered as an empty store's and touch the new formation's keys."""
    old = _member_path(service)
    service.publish([("worker-0", "127.0.0.1"), ("worker-1", "127.0.0.1")])
    new = _member_path(service)
    assert new != old
    assert _request(service, f"{new}/global/0", "PUT", b"new-0")[0] == 200
    assert _request(service, f"{old}/global/0", "PUT", b"old-0")[0] == 200  # dropped
    assert _request(service, f"{old}/global/0", "GET")[0] == 404
    for _ in range(2):  # would clear the new formation's scope if counted
        assert _request(service, f"{old}/global/1", "DELETE")[0] == 200
    assert _request(service, f"{new}/global/0", "GET") == (200, b"new-0")
    assert service._server.refused == 0


def test_a_put_checked_before_a_new_formation_opened_is_not_stored(service):
    """The path of a PUT is checked before its body is read; if a membership is
    published meanwhile, its value must not land in the new formation's emptied store
    (a joiner would read a peer address of the wrong formation's size)."""
    from tfdist.engines.horovod.membership import gloo_element

    old = gloo_element(TOKEN, service.service, service.version)
    arrived, release = threading.Event(), threading.Event()
    store = service._server.store_gloo

    def slow_store(*args):  # the body "arrives" only after the new membership is out
        arrived.set()
        release.wait(10)
        return store(*args)

    service._server.store_gloo = slow_store
    putting = threading.Thread(target=_request, args=(
        service, f"{_member_path(service)}/global/0", "PUT", b"old-size-address"))
    putting.start()
    assert arrived.wait(10)
    service.publish([("worker-0", "127.0.0.1"), ("worker-1", "127.0.0.1"),
                     ("worker-2", "127.0.0.1")])
    release.set()
    putting.join(10)
    assert _request(service, f"{_member_path(service)}/global/0", "GET")[0] == 404
    assert store(old, "global", "0", b"x", None) is False
    with service._server.cache_lock:
        assert not service._server.cache.get("global")


def test_slow_sockets_are_capped_cut_at_their_deadline_and_never_hold_the_close():
    require_horovod()
    from tfdist.engines.horovod.kv_server import KVServer

    log = io.StringIO()
    server = KVServer(("127.0.0.1", 0), TOKEN, "s", log, max_pending=4, deadline=1.0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.server_address[1]}"

    class Stub:
        pass

    stub = Stub()
    stub.address = address
    slow = [_raw(stub, b"PUT /global/slow HTTP/1.0\r\n", read=False) for _ in range(8)]
    server.open_formation("g" + "0" * 32)  # Gloo's keys: a member's path
    assert _put(stub, f"/g{'0' * 32}:1/global/0", b"v") == 200  # the oldest made room
    for sock in slow:  # each is closed (by the cap, or at its deadline): EOF, no hang
        sock.settimeout(30)
        while sock.recv(100):
            pass
    late = [_raw(stub, b"PUT /global/slow HTTP/1.0\r\n", read=False) for _ in range(3)]
    closer = threading.Thread(target=server.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()  # close() waited for none of the slow sockets
    thread.join(timeout=10)
    assert not thread.is_alive()
    for sock in slow + late:
        sock.close()
    said = log.getvalue()
    assert "more than 4 connections were open at once: the oldest was closed" in said
    assert "did not send a whole request within 1s" in said
    _assert_quiet(said)


@pytest.mark.unit
def test_sigusr1_is_ignored_and_said_outside_an_elastic_node_0():
    from tfdist.launch.usr1 import IgnoredUsr1

    log = io.StringIO()
    with IgnoredUsr1(log) as usr1:
        os.kill(os.getpid(), signal.SIGUSR1)
        usr1.say()
        usr1.say()
    assert log.getvalue() == ("tfdist launch: SIGUSR1 ignored: only node 0's launcher of "
                              "an elastic job (--min-workers) adds a worker on it\n")


# ---- launched: one two-host elastic job under attack -----------------------------------

EPOCHS = 3


@pytest.fixture(scope="module")
def attacked(hosts, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """A clean two-host elastic job that tests/membership_attacks.py attacks from node
    1's host while worker-0 holds in epoch 1 (SIGUSR1 to node 1's launcher too): the
    attacks' answers, both launchers' logs and exit codes, the workers' results and
    the single-process reference."""
    import elastic_job

    require_horovod()
    out = tmp_path_factory.mktemp("attacked")
    net = elastic_job.model()
    elastic_job.fit(net, EPOCHS)
    reference = net.get_weights()
    env = _env({"JOB_HEARTBEAT": "60", "TFDIST_TOKEN": TOKEN})
    logs = [out / "node0.log", out / "node1.log"]
    master = f"{hosts.addrs[0]}:{_port()}"

    def start(rank):
        argv = ["ip", "netns", "exec", hosts.names[rank], sys.executable, "-m", "tfdist.cli",
                "launch", "--nnodes", "2", "--node-rank", str(rank), "--master", master,
                "--workers", "1", "--min-workers", "1", "--timeout", "240",
                os.path.join(TESTS_DIR, "elastic_job.py"), str(out), str(EPOCHS),
                "worker-0:1:3:HOLD"]
        with open(logs[rank], "w") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO, start_new_session=True)

    node0, node1 = start(0), start(1)
    attacker, said = None, out / "attacks.json"
    exits = {}
    # from node 1's host, from the start: Gloo's keys DELETEd and overwritten as an
    # outsider, through the first formation, until worker-0 holds in epoch 1
    gloo, gloo_said, gloo_stop = None, out / "gloo.json", out / "gloo-stop"
    try:
        gloo = subprocess.Popen(
            ["ip", "netns", "exec", hosts.names[1], sys.executable,
             os.path.join(TESTS_DIR, "membership_attacks.py"), "--gloo", master,
             str(gloo_said), str(gloo_stop)], env=env, cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        _wait_for((out / "hold-1-3").exists, [node0, node1], "worker-0 at epoch 1")
        gloo_stop.touch()
        _wait_for(gloo_said.exists, [gloo], "the Gloo attacks")
        node1.send_signal(signal.SIGUSR1)
        attacker = subprocess.Popen(
            ["ip", "netns", "exec", hosts.names[1], sys.executable,
             os.path.join(TESTS_DIR, "membership_attacks.py"), master, str(said), TOKEN],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for(said.exists, [node0, node1, attacker], "the attacks")
        (out / "release-1-3").touch()  # the slow sockets stay open until the end
        _wait_for(lambda: all((out / f"worker-{i}.json").exists() for i in (0, 1)),
                  [], "both workers' results", seconds=200)
        # on time: the launchers end within seconds of their workers, slow sockets or not
        exits = {"node0": node0.wait(timeout=40), "node1": node1.wait(timeout=40)}
    finally:
        for process in (node0, node1, attacker, gloo):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL) if process in (node0, node1) \
                    else process.kill()
    return {"said": json.loads(said.read_text()), "exits": exits,
            "gloo": json.loads(gloo_said.read_text()),
            "logs": [log.read_text(errors="replace") for log in logs],
            "results": {i: json.loads((out / f"worker-{i}.json").read_text())
                        for i in (0, 1)}, "reference": reference}


def _assert_job_intact(attacked):
    """Both launchers exited 0 on time, and the job ended equal to one process, with no
    re-form, no host dropped, and no raw escape or traceback in any log."""
    assert attacked["exits"] == {"node0": 0, "node1": 0}, attacked["logs"][0][-3000:]
    for result in attacked["results"].values():
        assert result["size"] == 2 and result["iterations"] == EPOCHS * 10
        assert result["recoveries"] == 0, result
        assert_weights_close([np.array(w) for w in result["weights"]],
                             attacked["reference"], atol=1e-5)
    for log in attacked["logs"]:
        assert "\x1b" not in log and "Traceback" not in log, log[-3000:]
        assert "re-forms Horovod" not in log and "host is lost" not in log, log[-3000:]
        assert "stopped answering Horovod" not in log


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_forged_lost_reports_kill_no_worker(attacked):
    assert attacked["said"]["forged"] == [403, 403, 403]
    assert "refused a PUT to /'tfdist-elastic-lost'/'worker-0': it is not signed with the " \
           "job's token" in attacked["logs"][0]
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_an_outsiders_gloo_deletes_and_puts_break_no_formation(attacked):
    """Issue 39, item 15: from the job's start through its first formation, an
    outsider's DELETE and PUT of Gloo's keys are refused (403) and the job forms,
    trains and ends as one process would."""
    gloo = attacked["gloo"]
    assert gloo["codes"] == ["403"] and gloo["published"] > 20, gloo
    assert "refused a DELETE of /'global'/'0': Gloo's keys are served only under the " \
           "current formation's path" in attacked["logs"][0]
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_replayed_lost_reports_and_heartbeats_are_refused(attacked):
    said = attacked["said"]
    assert said["replayed_lost"] == [403, 403]
    assert said["replayed_beat"] == 403 and said["answer_written"] == 403
    assert "(a replayed heartbeat?)" in attacked["logs"][0]
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_a_heartbeat_flood_drops_no_host(attacked):
    assert attacked["said"]["flood"] == ["403"] and attacked["said"]["flood_count"] > 20
    assert attacked["logs"][0].count("tfdist-elastic-node") <= 3  # said once per kind
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_slow_sockets_do_not_hold_node_0s_launcher(attacked):
    assert attacked["said"]["slow_sockets"] >= 24
    _assert_job_intact(attacked)  # exited within 40 s of the workers, sockets still open


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_an_oversized_body_is_refused_unread(attacked):
    assert attacked["said"]["oversized"] == "HTTP/1.0 413 Request Entity Too Large"
    assert "refused a PUT of 1500000000 bytes" in attacked["logs"][0]
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_escapes_in_a_path_reach_no_log(attacked):
    # (a request line with no version gets http.server's HTTP/0.9 answer: no status line)
    codes = [status.split(" ")[1] if status.startswith("HTTP/") else
             status.split("Error code: ")[-1][:3] for status in attacked["said"]["escapes"]]
    assert codes == ["400", "400", "400", "411", "400", "403"], attacked["said"]["escapes"]
    assert "refused a request for '/\\x1b[31mred\\x1b[0m/x'" in attacked["logs"][0]
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.horovod
def test_a_clean_two_host_run_ends_cleanly_and_node_1_ignores_sigusr1(attacked):
    """No false "host is lost" at the end (node 1's last beat says it ended), and
    SIGUSR1 to node 1's launcher is ignored with one line."""
    assert "SIGUSR1 ignored" in attacked["logs"][1]
    assert "sent no heartbeat" not in attacked["logs"][0]
    _assert_job_intact(attacked)


@pytest.mark.multiprocess
def test_sigusr1_does_not_kill_a_non_elastic_launcher(tmp_path):
    """A non-elastic job (no TensorFlow): SIGUSR1 to its launcher while the task waits
    is ignored with one line, and the job ends 0."""
    script = tmp_path / "wait.py"
    script.write_text("import os, sys, time\n"
                      "out = sys.argv[1]\n"
                      "open(os.path.join(out, 'ready'), 'w').close()\n"
                      "while not os.path.exists(os.path.join(out, 'release')):\n"
                      "    time.sleep(0.05)\n")
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "1", "--timeout",
             "120", str(script), str(tmp_path)], stdout=out, stderr=subprocess.STDOUT,
            env=_env(), cwd=REPO, start_new_session=True)
    try:
        _wait_for((tmp_path / "ready").exists, [launcher], "the task", seconds=100)
        launcher.send_signal(signal.SIGUSR1)
        _wait_for(lambda: "SIGUSR1 ignored" in log.read_text(), [launcher],
                  "the launcher's word", seconds=100)
        (tmp_path / "release").touch()
        assert launcher.wait(timeout=100) == 0, log.read_text()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert log.read_text().count("SIGUSR1 ignored") == 1
