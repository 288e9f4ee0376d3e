"""``raggedfsdp rendezvous``: host a multi-node job's rendezvous store, so that any training node
may be lost (:mod:`raggedfsdp.train.rendezvous` says why and hosts it)."""

from __future__ import annotations

import argparse
import socket

from ..train.rendezvous import DEFAULT_PORT, rendezvous_store

__all__ = ["configure", "run"]


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [1, 65535], got {text!r}")
    return int(text)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``rendezvous`` arguments to ``parser``: the port."""
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"the port to listen on, on every address of this machine (default {DEFAULT_PORT})",
    )


def run(args: argparse.Namespace) -> int:
    """Host the store until SIGTERM or SIGINT; 0 then. A port already taken is a ``ValueError``
    (one line), before anything listens."""
    with rendezvous_store(args.port) as stopped:
        print(
            f"rendezvous store listening on port {args.port}: start each node with "
            f"--rdzv-endpoint {socket.gethostname()}:{args.port} (Ctrl-C or SIGTERM ends it)",
            flush=True,
        )
        stopped.wait()
    return 0
