"""A rendezvous store that outlives every training node (``raggedfsdp rendezvous`` runs it).

torchrun's c10d rendezvous keeps its state in a TCP store, which the first launcher otherwise hosts
in its own process, so losing that node loses the rendezvous. Run on a machine that is not a
training node, with every node's ``--rdzv-endpoint`` pointed at it, any training node may be lost
and replaced; one store serves several jobs, each with its own ``--rdzv-id``. What reaching the
store can do, and how this module narrows it: [Note: the rendezvous store is not a trust boundary]
at :func:`rendezvous_store`.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import pickle
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .stores import hosted_store, is_ip_address, listening_socket

__all__ = [
    "BACKEND",
    "DEFAULT_PORT",
    "STATE_TYPES",
    "check_state",
    "register_backend",
    "rendezvous_store",
]

#: torchrun's default c10d rendezvous port.
DEFAULT_PORT = 29400
#: The name of the rendezvous backend raggedfsdp's launchers use: torchrun's c10d, whose state
#: is checked before it is unpickled (module Note).
BACKEND = "raggedfsdp-c10d"
_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
#: ``(module, name)`` of every type in torchrun's c10d rendezvous state (torch 2.13's
#: ``dynamic_rendezvous``: the state, a node's description, its heartbeat times in UTC).
STATE_TYPES = frozenset(
    {
        (_DYNAMIC, "_RendezvousState"),
        (_DYNAMIC, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
    }
)


# [Note: the rendezvous store is not a trust boundary] A TCP store has no authentication: anyone who
# reaches its port may read and write every key (PyTorch's security policy says so too). So it
# belongs on a private network, and this module narrows what reaching it can do:
#
# - ``raggedfsdp rendezvous --host ADDR`` listens on that address alone (a socket bound here and
#   handed to the store: ``master_listen_fd``), as does a launcher that hosts the store of an
#   endpoint given as an IP address (a host name may resolve to another address here than on the
#   other nodes, 127.0.1.1 say, so one keeps torchrun's every address).
# - torchrun's c10d rendezvous keeps its state as a pickle under ``torch.rendezvous.JOB_ID``, and
#   ``dynamic_rendezvous`` unpickles whatever is there: a process that writes a crafted pickle under
#   a job's key runs code in every agent. raggedfsdp's launchers use torch's c10d backend through
#   :data:`BACKEND`, which reads that state with an unpickler admitting only its three types
#   (:data:`STATE_TYPES`) before torch does, and refuses anything else with a
#   ``RendezvousStateError`` naming the type. A valid state written by a stranger can still disturb
#   the job (join it, close it): that is what a private network is for.
# - A job's id defaults to a random one on one node; several nodes must name theirs (``--rdzv-id``):
#   a guessable default would let unrelated jobs, or a stranger, share its key.
# - A one-node job (no ``--rdzv-endpoint``) meets on 127.0.0.1 alone: its rendezvous store, and
#   through torchrun's ``--local-addr`` the workers' store (:func:`~.health.attempt_store`, bound
#   to ``MASTER_ADDR`` when that is an address) and their Gloo connections. On several nodes the
#   workers' store listens on every address of node 0, at a free port, holding no pickles.
@contextlib.contextmanager
def rendezvous_store(port: int, host: str | None = None) -> Iterator[threading.Event]:
    """Host the store on ``port`` while the block runs: on ``host`` alone (an address or name
    of this machine), or on every address when None. The event it yields is set by SIGTERM or
    SIGINT (installed first, so one that comes while the store starts is not lost). A port
    already taken, or a host that is not this machine's, is a ``ValueError``, before anything
    listens."""
    from torch.distributed import TCPStore

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    timeout = datetime.timedelta(seconds=30)
    try:
        if host is not None:
            store = hosted_store(host, listening_socket(host, port), timeout, multi_tenant=True)
        else:
            # The server listens on every address; the process's own client connects to
            # loopback.
            store = TCPStore(
                "127.0.0.1",
                port,
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=timeout,
            )
    except (RuntimeError, OSError) as err:  # taken (another store, a launcher), not an address
        where = f"--host {host} --port {port}" if host is not None else f"--port {port}"
        raise ValueError(f"{where}: cannot listen there: {err}") from err
    try:
        yield stop
    finally:
        del store  # the server stops with its last reference


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in STATE_TYPES:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def check_state(state: bytes, key: str) -> None:
    """``RendezvousStateError`` unless ``state`` (the pickle under the store's ``key``) holds
    nothing but the types of torchrun's rendezvous state (:data:`STATE_TYPES`): unpickled
    here with that allow-list, so a crafted one runs nothing, before torch unpickles it."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    try:
        _StateUnpickler(io.BytesIO(state)).load()
    except Exception as err:  # whatever a crafted or damaged pickle raises
        raise RendezvousStateError(
            f"the store's value under {key!r} is not a rendezvous state ({type(err).__name__}: "
            f"{err}): refused unread; another process writes to this store (it has no "
            f"authentication: keep it on a private network, docs/operations.md)"
        ) from None


def _checked_backend(store: Any, run_id: str) -> Any:
    """torchrun's c10d rendezvous backend on ``store``, whose every state read from the store
    passes :func:`check_state` first."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    class Checked(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self) -> Any:
            got = super().get_state()
            if got is not None:
                check_state(got[0], self._key)
            return got

        def set_state(self, state: bytes, token: Any = None) -> Any:
            got = super().set_state(state, token)
            if got is not None:
                check_state(got[0], self._key)
            return got

    return Checked(store, run_id)


def _job_store(params: Any) -> Any:
    """The store of a launcher's rendezvous at ``params.endpoint``: hosted here on that
    address alone when it is an IP address of this machine with the port free, else joined
    (the port is taken: another launcher or ``raggedfsdp rendezvous`` hosts it); an endpoint
    given by name goes to torch's own (module Note)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    if not is_ip_address(host):
        return create_backend(params)[1]
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60))
    try:
        return hosted_store(host, listening_socket(host, port), timeout, multi_tenant=True)
    except OSError as err:
        if err.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
    return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = _job_store(params)
    return create_handler(store, _checked_backend(store, params.run_id), params)


def register_backend() -> None:
    """Make :data:`BACKEND` known to torchrun's agent in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
