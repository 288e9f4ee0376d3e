"""A rendezvous store that outlives every training node (the ``raggedfsdp rendezvous``
command, :mod:`raggedfsdp.cli.rendezvous`, runs it).

torchrun's c10d rendezvous keeps its state (the rounds, who is in them, the nodes' heartbeats) in
a TCP store. Without a store of its own the first launcher to reach ``--rdzv-endpoint`` hosts that
store in its own process, so losing that node loses the rendezvous and the survivors end. Run
the command on a machine that is not a training node (or in a process of its own that the job's
failures do not take down), and point every node's ``--rdzv-endpoint`` at it: torchrun's agents
then find the port taken and join it as clients (``_create_tcp_store`` falls back to a client
when it cannot host), so any training node may be lost and replaced. One store serves several
jobs, each with its own ``--rdzv-id``.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import threading
from collections.abc import Iterator

__all__ = ["DEFAULT_PORT", "rendezvous_store"]

#: torchrun's default c10d rendezvous port.
DEFAULT_PORT = 29400


@contextlib.contextmanager
def rendezvous_store(port: int) -> Iterator[threading.Event]:
    """Host the store on ``port``, on every address of this machine, while the block runs; the
    event it yields is set by SIGTERM or SIGINT (installed first, so one that comes while the
    store starts is not lost). A port already taken is a ``ValueError``, before anything
    listens."""
    from torch.distributed import TCPStore

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        # The server listens on every address; the process's own client connects to loopback.
        store = TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=30),
        )
    except RuntimeError as err:  # the port is taken (another store, a launcher that hosts one)
        raise ValueError(f"--port {port}: cannot listen there: {err}") from err
    try:
        yield stop
    finally:
        del store  # the server stops with its last reference
