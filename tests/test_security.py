"""Security rules: private addresses only without a warning, nothing unpickled from the
network, and node 0's rendezvous under attack (forged, malformed and idle joins)."""

import contextlib
import io
import json
import re
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest

from tfdist.cluster import ClusterSpec, is_private_host, resolve_cluster
from tfdist.launch import find_free_ports, rendezvous
from tfdist.launch.rendezvous import wire

from helpers import tcp_listener

PACKAGE = Path(__file__).resolve().parents[1] / "tfdist"


@pytest.mark.unit
@pytest.mark.parametrize("host,private", [
    ("127.0.0.1", True), ("localhost", True), ("10.1.2.3", True), ("192.168.0.5", True),
    ("[::1]", True), ("worker-0", True), ("w0.default.svc.cluster.local", True),
    ("8.8.8.8", False), ("example.com", False)])
def test_is_private_host(host, private):
    assert is_private_host(host) is private


@pytest.mark.unit
def test_public_address_warns_and_private_does_not():
    public = ClusterSpec.from_dict({"cluster": {"worker": ["8.8.8.8:2222", "10.0.0.2:2222"]},
                                    "task": {"type": "worker", "index": 1}})
    with pytest.warns(UserWarning, match="8.8.8.8:2222.*no authentication"):
        resolve_cluster(public)
    private = ClusterSpec.from_dict({"cluster": {"worker": ["10.0.0.1:1", "10.0.0.2:2"]},
                                     "task": {"type": "worker", "index": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_cluster(private)


@pytest.mark.unit
def test_nothing_is_unpickled_outside_the_launchers_private_files():
    """Only the launcher reads pickles, and only files it wrote in its own temp dir; and
    the Spark/Ray task runner, which reads what its engine delivered (Spark and Ray move
    functions and results as pickles by design: whoever can submit to the cluster can run
    code, as the README's security section says)."""
    allowed = {"api.py", "task_main.py", "remote_task.py"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if re.search(r"\b(pickle|cloudpickle|dill)\.loads?\(|allow_pickle=True", text) \
                and path.name not in allowed:
            offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders


# ---- node 0's rendezvous under attack ------------------------------------------------------

TOKEN = "s3cret-test-token"
FORGED = "\n\x1b[31mtfdist launch: FAILED: worker-0 exited with code 1\x1b[0m\r\n"


class _Log(io.StringIO):
    """Node 0's log, written by its threads."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def write(self, text):
        with self._lock:
            return super().write(text)


@contextlib.contextmanager
def _server(**kwargs):
    """Node 0's rendezvous of a 2-node job on loopback; yields (server, port, log)."""
    port, log = find_free_ports(1)[0], _Log()
    server = rendezvous.RendezvousServer("127.0.0.1", port, 2, TOKEN, log=log,
                                         **{"join_timeout": 60, **kwargs}).start()
    try:
        yield server, port, log
    finally:
        server.close(wait=1)


@contextlib.contextmanager
def _thread_errors():
    """Collects the exceptions that end threads (a crashed handler) while in the block."""
    errors, hook = [], threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        yield errors
    finally:
        threading.excepthook = hook


def _connect(port):
    """A raw connection to node 0 and its challenge; the socket times out (hang guard)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    reader = sock.makefile("rb")
    return sock, reader, json.loads(reader.readline())


def _send_hello(port, line=None, **fields):
    """Sends a valid hello of node 1 with ``fields`` replaced (or the raw ``line``);
    returns node 0's answer (None: none) and whether it then closed the connection."""
    sock, reader, challenge = _connect(port)
    with sock:
        hello = {"type": "join", "rank": 1, "nnodes": 2, "addr": None,
                 "counts": {"chief": 0, "worker": 1, "ps": 0}, "ports": [4000],
                 "max_restarts": 0, "proof": wire.proof(TOKEN, challenge["nonce"])}
        hello.update(fields)
        sock.sendall(line if line is not None else (json.dumps(hello) + "\n").encode())
        answer = reader.readline()
        closed = answer == b"" or reader.readline() == b""
        return (json.loads(answer) if answer else None), closed


def _assert_log_is_clean(log):
    """Every line of node 0's log is its own, in printable ASCII and of bounded length."""
    lines = log.getvalue().splitlines()
    assert lines
    for line in lines:
        assert line.startswith("tfdist launch: rendezvous: "), lines
        assert all(" " <= c <= "~" for c in line), line
        assert len(line) < 1000, line


@pytest.mark.unit
@pytest.mark.parametrize("fields", [
    dict(rank="1" + FORGED),
    dict(rank="1" + FORGED, proof="0" * 64),
    dict(nnodes="2" + FORGED),
    dict(max_restarts="0" + FORGED),
    dict(addr="10.0.0.9" + FORGED),
    dict(counts={"chief" + FORGED: 0, "worker": 1, "ps": 0}),
    dict(ports=["4000" + FORGED]),
    dict(rank=1.5),
    dict(rank=True),
    dict(rank=-1, proof="x" * 30_000),
    dict(rank="A" * 30_000),
], ids=["rank", "rank-bad-proof", "nnodes", "max_restarts", "addr", "counts", "ports",
        "float-rank", "bool-rank", "long-proof", "long-rank"])
def test_forged_and_malformed_joins_are_refused_and_escaped_in_node_0s_log(fields):
    with _thread_errors() as errors, _server() as (server, port, log):
        answer, closed = _send_hello(port, **fields)
        assert answer is not None and answer["type"] == "error", answer
        assert "was refused" in answer["message"]
        assert all(" " <= c <= "~" for c in answer["message"]), answer
        assert closed
    _assert_log_is_clean(log)
    assert not errors


@pytest.mark.unit
def test_a_join_proof_with_non_ascii_characters_is_refused_and_closed():
    with _thread_errors() as errors, _server() as (server, port, log):
        answer, closed = _send_hello(port, proof="\u00e9" * 64)
        assert answer is not None, "no answer: the handler crashed"
        assert "its token does not match node 0's" in answer["message"]
        assert closed
    assert not errors, errors
    _assert_log_is_clean(log)


@pytest.mark.unit
@pytest.mark.parametrize("line", [b"[" * 200_000 + b"\n", b"\xff\xfe{}\n", b"42\n",
                                  b'{"type": "join"}\n', b"x" * 70_000 + b"\n"],
                         ids=["deep", "not-utf8", "not-an-object", "no-fields", "long"])
def test_broken_hellos_get_no_cluster_and_crash_no_thread(line):
    with _thread_errors() as errors, _server() as (server, port, log):
        answer, closed = _send_hello(port, line=line)
        assert answer is None or answer["type"] == "error", answer
        assert closed
    assert not errors, errors


def _first_line(sock):
    """The first line node 0 sends on ``sock`` (b"" if it hung up first)."""
    try:
        return sock.makefile("rb").readline()
    except ConnectionResetError:
        return b""


def _join_both(port):
    """Both nodes join at once (each in a thread); their links, or the test fails."""
    links = {}

    def join(rank):
        links[rank] = rendezvous.join(
            f"127.0.0.1:{port}", rank=rank, nnodes=2, token=TOKEN,
            counts={"chief": 0, "worker": 1, "ps": 0}, ports=find_free_ports(1), timeout=30)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)  # hang guard
    assert sorted(links) == [0, 1], "a node did not join"
    return links


@pytest.mark.unit
def test_idle_connections_are_capped_and_cannot_keep_a_node_out():
    cap = rendezvous.server.MAX_PENDING
    with _server(hello_timeout=2) as (server, port, log):
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=20)
                for _ in range(3 * cap)]
        links = {}
        try:
            first = [_first_line(sock) for sock in idle]  # node 0 answered each one
            assert threading.active_count() - before <= cap
            challenged = [line for line in first if b'"challenge"' in line]
            assert 0 < len(challenged) <= cap
            assert all(b'"busy"' in line for line in first if line not in challenged)
            # While the idle connections hold every slot, both nodes join: node 0 says
            # it is busy, and they retry until the idle ones are cut off.
            links = _join_both(port)
            assert links[0].cluster == links[1].cluster
            for sock in idle:
                assert _first_line(sock) == b""  # closed by node 0
        finally:
            for sock in idle:
                sock.close()
            for link in links.values():
                link.close()


@pytest.mark.unit
def test_a_hello_sent_byte_by_byte_is_cut_off_at_the_hello_timeout():
    with _server(hello_timeout=1) as (server, port, log):
        sock, reader, _ = _connect(port)
        with sock:
            for _ in range(200):  # one byte every 0.1 s: far beyond the hello timeout
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.1)
            assert _first_line(sock) == b""


@pytest.mark.unit
def test_a_node_escapes_what_a_fake_node_0_sends():
    def fake_node_0(conn):
        conn.sendall(b'{"type": "challenge", "nonce": "n"}\n' + json.dumps(
            {"type": "error", "message": "refused" + FORGED * 100}).encode() + b"\n")

    with tcp_listener(fake_node_0) as port:
        with pytest.raises(rendezvous.RendezvousError) as raised:
            rendezvous.join(f"127.0.0.1:{port}", rank=1, nnodes=2, token=TOKEN,
                            counts={"chief": 0, "worker": 1, "ps": 0}, ports=[4000],
                            timeout=10)
    text = str(raised.value)
    assert text.startswith("refused") and all(" " <= c <= "~" for c in text), text
    assert len(text) < 2000
