"""The address Horovod's Gloo HTTP store is given: the service's, with a path in it.

Why: Horovod's C++ store (``horovod/common/gloo/http_store.h``, 0.28) has no option for
a path or a credential. It builds each URL as ``"http://" + HOROVOD_GLOO_RENDEZVOUS_ADDR
+ ":" + HOROVOD_GLOO_RENDEZVOUS_PORT + "/" + scope + "/" + key``, and its HTTP client
(``third_party/HTTPRequest``) connects to what comes before the first ``/`` and sends
the rest as the request's path. An address of ``HOST:PORT/ELEMENT`` therefore makes
every request of a member's store ``/ELEMENT:PORT/scope/key``: the membership service
(`tfdist.engines.horovod.kv_server`) takes Gloo's keys only under the current
formation's ELEMENT, which only a member can compute. tests/test_hooks_horovod_gloo.py
fails if Horovod's client stops sending that path (``hvd.init`` then fails against
the service). Importing nothing.
"""

from __future__ import annotations


def rendezvous_env(host: str, port: str, element: str) -> dict[str, str]:
    """Horovod's rendezvous variables that send its store's requests under ``element``."""
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": f"{host}:{port}/{element}",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}


def path_element(part: str) -> str:
    """The ELEMENT of a request path's first part (``ELEMENT:PORT``, as Horovod sends)."""
    return part.split(":", 1)[0]
