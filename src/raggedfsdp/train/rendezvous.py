"""``raggedfsdp rendezvous``: a rendezvous store that outlives every training node.

torchrun's c10d rendezvous keeps its state (the rounds, who is in them, the nodes' heartbeats) in
a TCP store. Without this command the first launcher to reach ``--rdzv-endpoint`` hosts that
store in its own process, so losing that node loses the rendezvous and the survivors end. Run
this command on a machine that is not a training node (or in a process of its own that the job's
failures do not take down), and point every node's ``--rdzv-endpoint`` at it: torchrun's agents
then find the port taken and join it as clients (``_create_tcp_store`` falls back to a client
when it cannot host), so any training node may be lost and replaced. One store serves several
jobs, each with its own ``--rdzv-id``.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import socket
import threading

__all__ = ["configure_rendezvous_parser", "run_rendezvous"]

#: torchrun's default c10d rendezvous port.
DEFAULT_PORT = 29400


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [1, 65535], got {text!r}")
    return int(text)


def configure_rendezvous_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"the port to listen on, on every address of this machine (default {DEFAULT_PORT})",
    )


def run_rendezvous(args: argparse.Namespace) -> int:
    """Host the store until SIGTERM or SIGINT; 0 then. A port already taken is a ``ValueError``
    (one line), before anything listens."""
    from torch.distributed import TCPStore

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        # The server listens on every address; the process's own client connects to loopback.
        store = TCPStore(
            "127.0.0.1",
            args.port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=30),
        )
    except RuntimeError as err:  # the port is taken (another store, a launcher that hosts one)
        raise ValueError(f"--port {args.port}: cannot listen there: {err}") from err
    print(
        f"rendezvous store listening on port {args.port}: start each node with "
        f"--rdzv-endpoint {socket.gethostname()}:{args.port} (Ctrl-C or SIGTERM ends it)",
        flush=True,
    )
    stop.wait()
    del store
    return 0
