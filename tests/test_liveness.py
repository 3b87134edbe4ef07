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
