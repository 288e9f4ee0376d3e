"""The ``raggedfsdp`` command: the table of subcommands, and how errors end.

Each subcommand is one entry of :data:`SUBCOMMANDS` and a module of this package exporting
``configure(parser)`` and ``run(args) -> int``: it parses, prints and chooses the exit status; the
work stays in its room. User errors (``ValueError``) print one line and exit 2 (the traceback under
``--debug``), the machine's (``OSError``) one line and exit 1; anything else is a bug and keeps its
traceback. A new subcommand is such a module and one entry; ``python -m raggedfsdp.cli`` runs
:func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from .._console import USAGE_ERROR, one_line
from . import bench, export, plan, rendezvous, train

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]

PROG = "raggedfsdp"


@dataclass(frozen=True)
class Subcommand:
    """One ``raggedfsdp`` subcommand: ``configure`` adds its arguments, ``run`` executes it."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (like every other user error), not usage + error."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(USAGE_ERROR)


SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": Subcommand(
        "plan a model's shards and compare padding and cut blocks with FSDP2/FSDP1",
        plan.configure,
        plan.run,
    ),
    "train": Subcommand(
        "train a GPT with raggedfsdp (workers started by torchrun)",
        train.configure,
        train.run,
    ),
    "bench": Subcommand(
        "time raggedfsdp against FSDP2, DDP and the compute floor, interleaved",
        bench.configure,
        bench.run,
    ),
    "export": Subcommand(
        "write a training checkpoint's model as a plain state dict",
        export.configure,
        export.run,
    ),
    "rendezvous": Subcommand(
        "host a multi-node job's rendezvous store, so that any training node may be lost",
        rendezvous.configure,
        rendezvous.run,
    ),
}
"""Every subcommand, by name. Add one by adding an entry."""


def build_parser() -> argparse.ArgumentParser:
    """The ``raggedfsdp`` parser with every subcommand of :data:`SUBCOMMANDS`."""
    # --debug is accepted before or after the subcommand; SUPPRESS keeps a subparser from
    # resetting a value the main parser already set (so it is absent when not given). The
    # action is shared by every parser, so no set_defaults(debug=...) may touch it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the traceback of an error",
    )
    parser = _Parser(
        prog=PROG,
        description="Structure-aware fully sharded data parallelism for PyTorch.",
        parents=[common],
    )
    parser.set_defaults(command=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, sub in SUBCOMMANDS.items():
        sub_parser = commands.add_parser(
            name, help=sub.help, description=sub.help, parents=[common]
        )
        sub.configure(sub_parser)
        sub_parser.set_defaults(command=name, run=sub.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``raggedfsdp`` with ``argv`` (default: the process's arguments); the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error, already reported in one line
        return done.code if isinstance(done.code, int) else USAGE_ERROR
    if args.command is None:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{PROG}: error: a command is needed: {', '.join(SUBCOMMANDS)}\n")
        return USAGE_ERROR
    try:
        return args.run(args)
    except ValueError as err:
        if getattr(args, "debug", False):
            raise
        sys.stderr.write(f"{PROG}: error: {one_line(err)}\n")
        return USAGE_ERROR
    except OSError as err:  # the machine's: a full disk, a lost file, a failed command
        if getattr(args, "debug", False):
            raise
        sys.stderr.write(f"{PROG}: error: {one_line(err)}\n")
        return 1
