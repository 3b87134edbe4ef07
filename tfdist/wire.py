"""What tfdist's services share about messages from the network.

The multi-node rendezvous (`tfdist.launch.rendezvous`) and the elastic membership
service (`tfdist.engines.horovod.kv_server`) both listen where anyone on the network
(or, on one host, any local user) can connect. Both use what is here: the job token's
HMAC (`proof`, `sign`, `verify`), the same bounds on connections (`MAX_PENDING`,
`HELLO_SECONDS`), and quoting of whatever is logged (`quote`, `printable`: printable
ASCII, bounded, so a peer cannot write lines or terminal escapes into a log).
Nothing here imports another tfdist module.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

MAX_PENDING = 16  # connections waiting for their hello (a whole request) at once
HELLO_SECONDS = 10.0  # a connection's time to send its hello (a whole request)


def new_token() -> str:
    """A fresh secret for one job."""
    return secrets.token_urlsafe(18)


def proof(token: str, nonce: str) -> str:
    """The token's HMAC-SHA256 of ``nonce``, in hex."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def sign(token: str, message: dict) -> bytes:
    """``message`` as JSON with the token's HMAC over it."""
    text = json.dumps(message, sort_keys=True)
    return json.dumps({"body": text, "mac": proof(token, text)}).encode()


def verify(token: str, raw: bytes) -> dict | None:
    """The message of a `sign`-ed ``raw``, or None if its signature is not the token's."""
    try:
        wrapped = json.loads(raw)
        text, mac = wrapped["body"], wrapped["mac"]
        if not (isinstance(text, str) and isinstance(mac, str)) or not hmac.compare_digest(
                mac.encode("ascii", "replace"), proof(token, text).encode("ascii")):
            return None
        message = json.loads(text)
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def quote(value, limit: int = 80) -> str:
    """``value`` as Python writes it (``'a\\n'``), in printable ASCII, cut at ``limit``."""
    text = ascii(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def printable(text: str, limit: int = 1000) -> str:
    """``text`` with every character but printable ASCII escaped (``\\n``, ``\\x1b``),
    cut at ``limit``: a message from the wire that cannot forge a line in a log."""
    text = str(text)
    escaped = "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in text[:limit])
    return escaped if len(escaped) <= limit and len(text) <= limit else f"{escaped[:limit]}..."
