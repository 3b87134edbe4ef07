"""tfdist/_hooks/horovod_kv.py: Horovod's rendezvous handler still stores its values
behind ``_get_value``/``_put_value``, which tfdist's checked handler calls."""

import inspect

import pytest

pytestmark = pytest.mark.horovod


def test_rendezvous_handler_get_and_put_value_are_what_the_hooks_call():
    from horovod.runner.http.http_server import RendezvousHandler

    assert list(inspect.signature(RendezvousHandler._get_value).parameters) == [
        "self", "scope", "key"], "Horovod changed RendezvousHandler._get_value"
    assert list(inspect.signature(RendezvousHandler._put_value).parameters) == [
        "self", "scope", "key", "value"], "Horovod changed RendezvousHandler._put_value"
    assert "self._get_value(" in inspect.getsource(RendezvousHandler.do_GET), (
        "Horovod's GET no longer reads through _get_value: tfdist's handler would store "
        "where Horovod does not read")


def test_stored_value_reads_what_store_value_wrote():
    import threading
    import types

    from tfdist._hooks.horovod_kv import store_value, stored_value
    from horovod.runner.http.http_server import RendezvousHandler

    handler = object.__new__(RendezvousHandler)
    handler.server = types.SimpleNamespace(cache_lock=threading.Lock(), cache={}, verbose=0)
    assert stored_value(handler, "scope", "key") is None
    store_value(handler, "scope", "key", b"v")
    assert stored_value(handler, "scope", "key") == b"v"
    assert handler.server.cache == {"scope": {"key": b"v"}}
