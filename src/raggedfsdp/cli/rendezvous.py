"""``raggedfsdp rendezvous``: host a multi-node job's rendezvous store.

So that any training node may be lost (:mod:`raggedfsdp.train.rendezvous` says why and hosts it).
"""

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
    """Add the ``rendezvous`` arguments to ``parser``: the address and the port."""
    parser.description = (
        f"{parser.description}. The store has no authentication: anyone who reaches the port "
        f"can read and write every job's state there (and so disturb or join the jobs). Run "
        f"it on a private network only, listening on that network's address (--host), as "
        f"PyTorch's security policy says of its TCP store; SECURITY.md."
    )
    parser.add_argument(
        "--host",
        default=None,
        metavar="ADDR",
        help="the address (or name) of this machine to listen on, alone: that of the private "
        "network the nodes share (default: every address of this machine)",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"the port to listen on (default {DEFAULT_PORT})",
    )


def run(args: argparse.Namespace) -> int:
    """Host the store until SIGTERM or SIGINT; 0 then. A port already taken is a ``ValueError``
    (one line), before anything listens."""
    with rendezvous_store(args.port, args.host) as stopped:
        where = f"on {args.host}" if args.host else "on every address (no authentication)"
        print(
            f"rendezvous store listening {where}, port {args.port}: start each node with "
            f"--rdzv-endpoint {args.host or socket.gethostname()}:{args.port} and a --rdzv-id "
            f"of its job (Ctrl-C or SIGTERM ends it)",
            flush=True,
        )
        stopped.wait()
    return 0
