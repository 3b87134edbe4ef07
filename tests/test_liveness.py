"""A peer's probe tells a running, frozen, exited and cut-off task apart.

A network outage is not a dead peer: "connection refused" (the host is up, nothing
listens) says the task is not running; "network unreachable", "no route to host" or no
reply to the connection at all say the network is down and the task may still run.
"""

import errno
import socket
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.fixture
def servers():
    """``{"answers": addr, "silent": addr, "refused": addr}`` on 127.0.0.1."""
    from tfdist.engines.horovod import rendezvous
    from tfdist.launch import find_free_ports

    alive = rendezvous._serve_liveness("127.0.0.1", find_free_ports(1)[0])
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # the kernel accepts connections; nobody answers (as under SIGSTOP)
    try:
        yield {"answers": f"127.0.0.1:{alive.server_address[1]}",
               "silent": f"127.0.0.1:{silent.getsockname()[1]}",
               "refused": f"127.0.0.1:{find_free_ports(1)[0]}"}
    finally:
        alive.shutdown()
        alive.server_close()
        silent.close()


def _cut_off(monkeypatch, addresses, failure):
    """Connections to ``addresses`` fail as ``failure`` (an OSError or a timeout)."""
    from tfdist.comm import liveness

    connect = socket.create_connection

    def create_connection(address, *args, **kwargs):
        if f"{address[0]}:{address[1]}" in addresses:
            raise failure
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(liveness.socket, "create_connection", create_connection)


@pytest.mark.unit
def test_probe_names_each_state(servers, monkeypatch):
    from tfdist.comm import liveness

    assert liveness.probe(servers["answers"], 2) == liveness.Probe(liveness.ANSWERS)
    assert liveness.probe(servers["silent"], 0.5) == liveness.Probe(liveness.SILENT,
                                                                     "no answer within 0.5s")
    assert liveness.probe(servers["refused"], 2) == liveness.Probe(liveness.REFUSED,
                                                                   "connection refused")
    down = "10.9.8.7:4000"
    for failure, detail in [
            (OSError(errno.ENETUNREACH, "Network is unreachable"), "network is unreachable"),
            (OSError(errno.EHOSTUNREACH, "No route to host"), "no route to host"),
            (socket.timeout("timed out"), "no reply to the connection within 0.5s")]:
        _cut_off(monkeypatch, {down}, failure)
        assert liveness.probe(down, 0.5) == liveness.Probe(liveness.UNREACHABLE, detail)
    # is_responsive keeps its meaning: None only when nothing listens.
    assert [liveness.is_responsive(servers[s], 0.5) for s in ("answers", "silent", "refused")
            ] == [True, False, None]
    assert liveness.is_responsive(down, 0.5) is False


@pytest.mark.multiprocess
def test_probe_with_the_link_down():
    """In a network namespace of its own, every link is down (even loopback): a probe
    finds the network unreachable, not a peer that exited."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tfdist.comm import liveness; "
            "print(liveness.probe('10.9.8.7:4000', 2)); print(liveness.probe('127.0.0.1:9', 2))")
    try:
        out = subprocess.run(["unshare", "--net", sys.executable, "-c", code, ROOT],
                             capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"cannot make a network namespace: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "Probe(state='unreachable', detail='network is unreachable')"] * 2, out.stdout


def test_horovod_peer_error_names_an_outage_as_an_outage(servers, monkeypatch):
    """With worker-2's link down, worker-0 says it could not be reached and may still
    run, not that it is not running; a refused peer is still named as not running."""
    import tensorflow as tf

    from tfdist.engines.horovod import rendezvous
    from tfdist.engines.base import EngineSetup
    from tfdist.engines.horovod.engine import HorovodEngine

    down = "10.9.8.7:4000"
    _cut_off(monkeypatch, {down}, OSError(errno.ENETUNREACH, "Network is unreachable"))
    monkeypatch.setattr(rendezvous, "_peers", {"worker-1": servers["refused"],
                                               "worker-2": down})
    monkeypatch.delenv(rendezvous.GLOO_TIMEOUT_ENV, raising=False)
    engine = HorovodEngine(EngineSetup(
        heartbeat_timeout=5.0, collective_timeout=None, task_name="worker-0"))
    shut_down = tf.errors.UnknownError(None, None, "Horovod has been shut down. This was "
                                       "caused by an exception on one of the ranks.")
    error = engine.peer_error(shut_down)
    assert type(error) is tf.errors.UnknownError
    assert error.message == (
        f"worker-0: worker-1 is not running (nothing listens at {servers['refused']}): "
        f"killed or exited; worker-2 could not be reached ({down}: network is "
        "unreachable): a network outage (link down, no route, firewall), not a task known "
        "to have exited; it may still run. Horovod said: Horovod has been shut down. This "
        "was caused by an exception on one of the ranks."), error.message
    assert "worker-2 is not running" not in error.message


class _FlakyRendezvous:
    """An HTTP server at a port that fails its first ``failures`` hellos (as a port
    still held by another job would), then takes them."""

    def __init__(self, failures: int, port: int = 0):
        import http.server
        import threading

        outer, self.puts = self, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802 - http.server's name
                outer.puts.append(self.path)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(500 if len(outer.puts) <= failures else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format, *args):  # noqa: A002
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]


@pytest.mark.unit
def test_a_hello_that_fails_at_first_is_retried_until_rank_0_takes_it():
    from tfdist.engines.horovod import rendezvous

    flaky = _FlakyRendezvous(failures=2)
    try:
        rendezvous._say_hello("127.0.0.1", flaky.port, 1, 30.0, "worker-0")
    finally:
        flaky.server.shutdown()
    assert flaky.puts == ["/tfdist-hello/1"] * 3


@pytest.mark.unit
def test_a_hello_nobody_takes_times_out_naming_rank_0():
    from tfdist.engines.horovod import rendezvous
    from tfdist.launch import find_free_ports

    port = find_free_ports(1)[0]
    with pytest.raises(TimeoutError, match=rf"worker-0 did not open Horovod's rendezvous "
                                           rf"at 127.0.0.1:{port} within 0.5s"):
        rendezvous._say_hello("127.0.0.1", port, 1, 0.5, "worker-0")


@pytest.mark.unit
def test_a_hello_answered_by_a_non_http_peer_is_retried():
    import threading

    from tfdist.engines.horovod import rendezvous

    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stranger.bind(("127.0.0.1", 0))
    stranger.listen()
    port, started = stranger.getsockname()[1], []

    def answer_garbage_then_become_rank_0():
        connection, _ = stranger.accept()
        connection.recv(4096)
        connection.sendall(b"not http\r\n\r\n")
        connection.close()
        stranger.close()
        started.append(_FlakyRendezvous(failures=0, port=port))

    thread = threading.Thread(target=answer_garbage_then_become_rank_0)
    thread.start()
    try:
        rendezvous._say_hello("127.0.0.1", port, 1, 30.0, "worker-0")
    finally:
        thread.join()
        started[0].server.shutdown()
    assert started[0].puts == ["/tfdist-hello/1"]
