"""Horovod's rendezvous key-value store, read and written from tfdist's request handler
(tfdist.engines.horovod.kv_server).

Why: Horovod's ``RendezvousHandler`` keeps its values behind the private
``_get_value``/``_put_value`` (they take its lock); tfdist's handler checks each request
before it stores or answers, so it must call them itself. tests/test_hooks_horovod_kv.py
fails if Horovod renames them. Importing nothing: the handler passes itself.
"""

from __future__ import annotations


def stored_value(handler, scope: str, key: str) -> bytes | None:
    """The value ``handler``'s server holds at ``scope``/``key``, or None."""
    return handler._get_value(scope, key)


def store_value(handler, scope: str, key: str, value: bytes) -> None:
    """Stores ``value`` at ``scope``/``key`` in ``handler``'s server."""
    handler._put_value(scope, key, value)
