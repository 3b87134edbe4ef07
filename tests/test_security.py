"""Security rules: private addresses only without a warning, nothing unpickled from the network."""

import re
import warnings
from pathlib import Path

import pytest

from tfdist.cluster import ClusterSpec, is_private_host, resolve_cluster

PACKAGE = Path(__file__).resolve().parents[1] / "tfdist"


@pytest.mark.parametrize("host,private", [
    ("127.0.0.1", True), ("localhost", True), ("10.1.2.3", True), ("192.168.0.5", True),
    ("[::1]", True), ("worker-0", True), ("w0.default.svc.cluster.local", True),
    ("8.8.8.8", False), ("example.com", False)])
def test_is_private_host(host, private):
    assert is_private_host(host) is private


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


def test_nothing_is_unpickled_outside_the_launchers_private_files():
    """Only the launcher reads pickles, and only files it wrote in its own temp dir; and
    the Spark/Ray task runner, which reads what its engine delivered (Spark and Ray move
    functions and results as pickles by design: whoever can submit to the cluster can run
    code, as the README's security section says)."""
    allowed = {"api.py", "_task_main.py", "_remote_task.py"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if re.search(r"\b(pickle|cloudpickle|dill)\.loads?\(|allow_pickle=True", text) \
                and path.name not in allowed:
            offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders
