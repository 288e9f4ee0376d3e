"""TCP stores that listen on one address alone, for the launcher's rendezvous and the workers'.

torch's ``TCPStore`` server listens on every address of the machine; handed a socket already
bound to one (``master_listen_fd``), it serves there alone. Both the launcher (``rendezvous.py``)
and the workers (``health.attempt_store``) host stores, so this lives apart from either.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import Any

__all__ = ["hosted_store", "is_ip_address", "listening_socket"]


def is_ip_address(host: str) -> bool:
    """Whether ``host`` is an IP address rather than a name (a name may resolve to another
    address on this machine than on its peers, 127.0.1.1 say, so a store is bound to addresses
    only)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` (an address of this machine, or a name of one) and
    ``port`` (0: a free one), listening: what a store is handed to listen there alone.
    ``OSError`` when it cannot (``EADDRINUSE``: taken; ``EADDRNOTAVAIL``: not an address of
    this machine)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's own server
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def hosted_store(
    host: str, sock: socket.socket, timeout: datetime.timedelta, **options: Any
) -> Any:
    """A TCP store served on the listening ``sock`` (which it then owns); ``options``: the
    store's others (``world_size``, ``multi_tenant``, ...)."""
    from torch.distributed import TCPStore

    port = sock.getsockname()[1]
    options.setdefault("wait_for_workers", False)
    try:
        return TCPStore(
            host, port, is_master=True, timeout=timeout, master_listen_fd=sock.fileno(), **options
        )
    finally:
        sock.detach()  # the store's server listens on it now; never closed under it
