"""tfdist/_hooks/horovod_gloo.py: Horovod's Gloo HTTP store still sends its requests
under the path given in HOROVOD_GLOO_RENDEZVOUS_ADDR, so a member's ``hvd.init``
forms Gloo against the membership service, which serves Gloo's keys only there."""

import subprocess
import sys

import pytest

from helpers import require_horovod

pytestmark = [pytest.mark.horovod, pytest.mark.multiprocess]

TOKEN = "gloo-hook-token"

_INIT = """
import horovod.tensorflow as hvd
hvd.init()
print("size", hvd.size(), "rank", hvd.rank(), flush=True)
hvd.shutdown()
"""


def test_a_members_store_writes_under_its_formations_path(monkeypatch):
    require_horovod()
    import os

    from tfdist import env
    from tfdist.engines.horovod import membership

    server = membership.MembershipServer("127.0.0.1", 1, 1, token=TOKEN)
    try:
        server.publish([("worker-0", "127.0.0.1")])
        monkeypatch.setenv(env.TOKEN, TOKEN)  # as the launcher gives it every task
        slot = membership.slot_env(membership.fetch_state(server.address), "worker-0",
                                   server.address)
        run = subprocess.run(
            [sys.executable, "-c", _INIT], capture_output=True, text=True, timeout=240,
            env={**os.environ, **slot, "HOROVOD_GLOO_IFACE": "lo",
                 "HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
        assert run.returncode == 0 and "size 1 rank 0" in run.stdout, run.stderr[-3000:]
        # Gloo's three contexts each wrote and finalized there; nothing was refused
        assert server._server.served >= 3 and server._server.refused == 0, (
            server._server.served, server._server.refused)
    finally:
        server.close()
