"""Whether a Ray cluster's address answers, asked before ``ray.init``: to a ``host:port`` where nothing
listens (a typo, a cluster that is gone), Ray 2.60's ``ray.init`` retries for minutes before it gives up
("Timed out while waiting for GCS to become available"); a TCP connect answers at once."""

from __future__ import annotations

import re
import socket

_HOST_PORT = re.compile(r"^[^:/\s]+:\d+$")  # a GCS address; not "auto", not a ray:// client address


def gcs_unreachable(address: str, timeout_s: float = 5) -> bool:
    """True when ``address`` is a plain ``host:port`` to which no TCP connection opens within ``timeout_s``
    seconds; False when it opens, or when ``address`` is another form (``auto``, ``ray://...``: Ray resolves
    those itself)."""
    if not _HOST_PORT.match(address):
        return False
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return False
    except OSError:
        return True
