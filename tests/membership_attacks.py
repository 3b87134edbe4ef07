"""Attacks on an elastic job's membership service, run by tests/test_membership_attacks.py.

    python membership_attacks.py HOST:PORT OUT.json TOKEN
    python membership_attacks.py --gloo HOST:PORT OUT.json STOP

The first sends, against the service at HOST:PORT while the job trains: forged lost reports,
stale (replayed) signed lost reports, a replayed heartbeat, a flood of garbage
heartbeats, an oversized PUT, and requests with terminal escapes in their paths. It
writes what the service answered to OUT.json, then keeps slow sockets open (a
slowloris, more than the service's connection cap) until it is killed. The second
(``--gloo``), from the job's start until the file STOP exists, DELETEs and PUTs
garbage at Gloo's keys (``/global/K``, ``/local_<host>/K``, ``/cross_<n>/K``) as an
outsider, through the first formation, and writes what the service answered to OUT.json.
"""

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

from tfdist.wire import sign


def raw(host, port, data: bytes, read=True) -> str:
    """Sends ``data`` on a new connection; the status line answered (or what happened)."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(data)
        if not read:
            return ""
        try:
            return sock.recv(200).split(b"\r\n")[0].decode("ascii", "replace")
        except OSError as error:
            return type(error).__name__


def put(master, path, body: bytes) -> int:
    request = urllib.request.Request(f"http://{master}{path}", data=body, method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def get(master, path) -> bytes:
    with urllib.request.urlopen(f"http://{master}{path}", timeout=10) as reply:
        return reply.read()


def slowloris(host, port, sockets: list, opened: list) -> None:
    """Connections that send a header line now and then and never end their request
    (4 more every 0.5 s, as the service closes some)."""
    while True:
        for _ in range(4):
            try:
                sock = socket.create_connection((host, port), timeout=5)
                sock.sendall(b"PUT /global/slow HTTP/1.1\r\nHost: x\r\n")
                sockets.append(sock)
                opened.append(1)
            except OSError:
                pass
        for sock in list(sockets):
            try:
                sock.sendall(b"X-a: b\r\n")
            except OSError:
                sockets.remove(sock)
        time.sleep(0.5)


def main(master, out, token):
    host, port = master.rsplit(":", 1)
    port = int(port)
    said = {}
    state = json.loads(get(master, "/tfdist-elastic/state"))
    version, service = state["version"], state["service"]
    said["version"] = version
    # forged lost reports: unsigned, and signed with another token
    said["forged"] = [put(master, f"/tfdist-elastic-lost/{name}", str(version).encode())
                      for name in ("worker-0", "worker-1")]
    said["forged"].append(put(master, "/tfdist-elastic-lost/worker-0", sign(
        "not-the-token", {"name": "worker-0", "version": version, "service": service})))
    # replayed lost reports: an older membership's, another service's (another attempt)
    said["replayed_lost"] = [
        put(master, "/tfdist-elastic-lost/worker-0", sign(
            token, {"name": "worker-0", "version": version - 1, "service": service})),
        put(master, "/tfdist-elastic-lost/worker-1", sign(
            token, {"name": "worker-1", "version": version, "service": "0" * 16}))]
    # a replayed heartbeat: node 1's, read off the service, sent again later
    beat = get(master, "/tfdist-elastic-node/1")
    time.sleep(2)
    said["replayed_beat"] = put(master, "/tfdist-elastic-node/1", beat)
    said["answer_written"] = put(master, "/tfdist-elastic-assign/1", beat)
    # a flood of garbage heartbeats, longer than node 0's 5 s heartbeat timeout
    codes = []

    def flood():
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                codes.append(put(master, "/tfdist-elastic-node/1", b'{"rank": 1}' * 20))
            except OSError as error:
                codes.append(type(error).__name__)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    said["flood"] = sorted(set(map(str, codes)))
    said["flood_count"] = len(codes)
    # oversized: 1.5 GB announced; the answer comes before the body is sent
    said["oversized"] = raw(host, port, b"PUT /global/big HTTP/1.1\r\nHost: x\r\n"
                                        b"Content-Length: 1500000000\r\n\r\n" + b"x" * 65536)
    # escapes and broken requests
    said["escapes"] = [
        raw(host, port, b"GET /\x1b[31mred\x1b[0m/x HTTP/1.0\r\n\r\n"),
        raw(host, port, b"PUT /tfdist-elastic-lost/\x1b]0;pwned\x07 HTTP/1.0\r\n"
                        b"Content-Length: 1\r\n\r\n1"),
        raw(host, port, b"GET /a/b/c/\x1b[2J HTTP/1.0\r\n\r\n"),
        raw(host, port, b"PUT /global/x HTTP/1.0\r\n\r\n"),
        raw(host, port, b"\x1b[2J\x1b[H garbage\r\n\r\n"),
        raw(host, port, b"DELETE /tfdist-elastic/state HTTP/1.0\r\n\r\n"),
    ]
    with open(out + ".tmp", "w") as f:
        json.dump(said, f)
    sockets, opened = [], []
    threading.Thread(target=slowloris, args=(host, port, sockets, opened), daemon=True).start()
    while len(opened) < 24:  # past the connection cap of 16
        time.sleep(0.1)
    said["slow_sockets"] = len(opened)
    with open(out + ".tmp", "w") as f:
        json.dump(said, f)
    import os

    os.replace(out + ".tmp", out)
    while True:  # holds the slow sockets until the test kills this process
        time.sleep(1)


def gloo(master, out, stop):
    import os

    codes, published = set(), 0  # published: sent once a membership formed Gloo
    while not os.path.exists(stop):
        try:
            state = json.loads(get(master, "/tfdist-elastic/state"))
        except OSError:
            time.sleep(0.1)  # not up yet
            continue
        hosts = {m["host"] for m in state["members"]} or {master.rsplit(":", 1)[0]}
        scopes = ["global", "cross_0", "cross_1"] + [f"local_{h}" for h in sorted(hosts)]
        for scope in scopes:
            for key in range(4):
                url = f"http://{master}/{scope}/{key}"
                for request in (urllib.request.Request(url, method="DELETE"),
                                urllib.request.Request(url, data=b"garbage", method="PUT")):
                    codes.add(str(call(request)))
                    published += state["version"] > 0
        time.sleep(0.02)
    with open(out + ".tmp", "w") as f:
        json.dump({"codes": sorted(codes), "published": published}, f)
    os.replace(out + ".tmp", out)


def call(request) -> int:
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError as error:
        return type(error).__name__


if __name__ == "__main__":
    if sys.argv[1] == "--gloo":
        gloo(*sys.argv[2:5])
    else:
        main(*sys.argv[1:4])
