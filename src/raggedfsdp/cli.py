"""The ``raggedfsdp`` command.

Each subcommand is one entry of :data:`SUBCOMMANDS`: a help line, a function that adds its
arguments to an ``argparse`` parser, and a function that runs it and returns the exit status. To
add ``train``, ``bench`` or ``export``, write those two functions and add one line to the dict.

Errors the user caused (a bad argument, an unknown model, a policy the shapes cannot meet) are
``ValueError``; they print one line ``raggedfsdp: error: ...`` to stderr and exit 2, with the
traceback only under ``--debug``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, TextIO

import torch

from . import bench
from .launch import configure_export_parser, configure_train_parser, run_export, run_train
from .layout import BlockSize, RaggedShard
from .models import MODEL_NAMES
from .plan_report import PlanReport, WorldReport, plan_report
from .planner import OPTIMIZER_TYPES

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "SUBCOMMANDS",
    "Subcommand",
    "build_parser",
    "main",
    "parse_block_size",
    "parse_buffer_size",
    "parse_world_sizes",
    "render_plan_report",
]

PROG = "raggedfsdp"
#: Exit status of a usage error (argparse's convention).
USAGE_ERROR = 2


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


# ---------------------------------------------------------------------------------------------
# Argument values. Each raises ValueError naming the bad value, so they serve argparse and code.

_BINARY_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"8,64,1024"`` -> ``(8, 64, 1024)``; duplicates dropped, order kept."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(
                f"invalid world size {part!r} in {text!r}: expected comma-separated integers >= 1"
            )
        if int(part) not in sizes:
            sizes.append(int(part))
    return tuple(sizes)


def parse_block_size(text: str) -> BlockSize:
    """``"none"`` (element), ``"32"`` (rows), ``"128x128"`` (tiles) or ``"whole"``."""
    value = text.strip().lower()
    block: BlockSize
    if value == "none":
        block = None
    elif value == "whole":
        block = "whole"
    elif value.isdigit():
        block = int(value)
    elif value.count("x") == 1 and all(p.isdigit() for p in value.split("x")):
        rows, cols = value.split("x")
        block = (int(rows), int(cols))
    else:
        block = "invalid"  # type: ignore[assignment]
    try:
        RaggedShard(block_size=block)  # positive sizes only
    except ValueError:
        raise ValueError(
            f"invalid block size {text!r}: expected none, whole, ROWS (e.g. 32) or ROWSxCOLS "
            f"(e.g. 128x128) with positive integers"
        ) from None
    return block


def parse_buffer_size(text: str) -> int | None:
    """Bytes: ``"none"``, ``"4194304"``, ``"4MiB"``, ``"4M"``, ``"1GiB"`` (K/M/G are binary)."""
    value = text.strip().lower()
    if value == "none":
        return None
    number, scale = value, 1
    for suffix in ("ib", "b"):
        if number.endswith(suffix) and number[: -len(suffix)][-1:] in _BINARY_SUFFIXES:
            number = number[: -len(suffix)]
            break
    if number[-1:] in _BINARY_SUFFIXES:
        number, scale = number[:-1], _BINARY_SUFFIXES[number[-1]]
    if not number.isdigit() or int(number) < 1:
        raise ValueError(
            f"invalid buffer size {text!r}: expected none or a positive number of bytes, "
            f"optionally with K, M or G (binary: 4M = 4MiB = 4194304)"
        )
    return int(number) * scale


def _arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """Adapt a ``ValueError``-raising parser to argparse, keeping its message."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__
    return convert


# ---------------------------------------------------------------------------------------------
# plan

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Default bucket cap of ``plan`` (see docs/planner.md for the measurements behind it).
DEFAULT_BUFFER_SIZE = "none"


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, metavar="NAME", help=f"one of: {', '.join(MODEL_NAMES)}"
    )
    parser.add_argument(
        "--world",
        required=True,
        type=_arg_type(parse_world_sizes),
        metavar="W[,W...]",
        help="world sizes to plan for, comma-separated (e.g. 8,64,1024)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZER_TYPES,
        default="adamw",
        help="the optimizer the shards must serve (default: adamw)",
    )
    parser.add_argument(
        "--block-size",
        type=_arg_type(parse_block_size),
        default=None,
        metavar="none|ROWS|ROWSxCOLS|whole",
        help="RaggedShard block: none (element), 32 (rows), 128x128 (tiles), whole (default: none)",
    )
    parser.add_argument(
        "--buffer-size",
        type=_arg_type(parse_buffer_size),
        default=parse_buffer_size(DEFAULT_BUFFER_SIZE),
        metavar="BYTES|none",
        help="bucket cap in bytes (4M, 64MiB, 1G, ...); none: one bucket per FSDP unit "
        f"(default: {DEFAULT_BUFFER_SIZE})",
    )
    parser.add_argument(
        "--dtype", choices=tuple(_DTYPES), default="float32", help="communication dtype"
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON: a list, one object per world size"
    )


def _run_plan(args: argparse.Namespace) -> int:
    report = plan_report(
        args.model,
        args.world,
        optimizer=args.optimizer,
        block_size=args.block_size,
        buffer_size=args.buffer_size,
        dtype=_DTYPES[args.dtype],
    )
    if args.json:
        json.dump(report.to_records(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_plan_report(report, sys.stdout)
    return 0


def _percent(ratio: float) -> str:
    return f"{100 * ratio:,.2f}%"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"


def _block_text(block: BlockSize) -> str:
    if block is None:
        return "element"
    if isinstance(block, tuple):
        return f"{block[0]}x{block[1]} tiles"
    return "whole tensors" if block == "whole" else f"{block} rows"


def _world_table(report: PlanReport, world: WorldReport) -> Table:
    from rich.table import Table  # rich is only needed to render

    opts = report.options
    item = opts.dtype.itemsize
    buffer = (
        "one bucket per FSDP unit"
        if opts.buffer_size is None
        else f"buckets <= {_bytes(opts.buffer_size)}"
    )
    table = Table(
        title=(
            f"{report.model}  W={world.world_size:,}  {opts.optimizer or 'adamw'}  "
            f"{_block_text(opts.block_size)}  {buffer}  {str(opts.dtype).removeprefix('torch.')}"
        ),
        caption=(
            f"{world.buckets} buckets planned in {1000 * world.plan_seconds:,.1f} ms; "
            f"S / bound {world.bound_ratio:.4f} overall, worst {world.worst_bound_ratio:.4f} "
            f"({world.worst_bucket})"
        ),
    )
    table.add_column("per rank")
    for name in ("raggedfsdp", "lower bound", "FSDP2", "FSDP1"):
        table.add_column(name, justify="right")
    table.add_row(
        "padding",
        _percent(world.padding_ratio),
        _percent(world.bound_padding_ratio),
        _percent(world.fsdp2_padding_ratio),
        _percent(world.fsdp1_padding_ratio),
    )
    table.add_row(
        "elements",
        f"{world.rank_numel:,}",
        f"{world.bound_rank_numel:,}",
        f"{world.fsdp2_rank_numel:,}",
        f"{world.fsdp1_rank_numel:,}",
    )
    table.add_row(
        "all-gather bytes, all buckets",
        _bytes(world.allgather_bytes_total),
        _bytes(world.bound_rank_numel * item),
        _bytes(world.fsdp2_rank_numel * item),
        _bytes(world.fsdp1_rank_numel * item),
    )
    table.add_row("all-gather bytes, largest", _bytes(world.allgather_bytes_max), "", "", "")
    table.add_row(
        f"policy blocks cut (of {world.blocks_total:,})",
        "0",
        "0",
        f"{world.fsdp2_cut_blocks:,}",
        f"{world.fsdp1_cut_blocks:,}",
    )
    return table


def render_plan_report(report: PlanReport, out: TextIO) -> None:
    """Print one table per world size; plain text (no colour) when ``out`` is not a terminal."""
    from rich.console import Console

    console = Console(file=out)
    if not console.is_terminal:
        # Rich falls back to 80 columns off a terminal, which wraps the numbers.
        console = Console(file=out, width=120)
    console.print(
        f"{report.model}: {report.num_params:,} parameters, {report.param_numel:,} elements"
    )
    for world in report.worlds:
        console.print(_world_table(report, world))


# ---------------------------------------------------------------------------------------------
# The command.

SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": Subcommand(
        "plan a model's shards and compare padding and cut blocks with FSDP2/FSDP1",
        _configure_plan,
        _run_plan,
    ),
    "train": Subcommand(
        "train a GPT with raggedfsdp (workers started by torchrun)",
        configure_train_parser,
        run_train,
    ),
    "bench": Subcommand(
        "time raggedfsdp against FSDP2, DDP and the compute floor, interleaved",
        bench.configure_parser,
        bench.run,
    ),
    "export": Subcommand(
        "write a training checkpoint's model as a plain state dict",
        configure_export_parser,
        run_export,
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


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


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
        sys.stderr.write(f"{PROG}: error: {_one_line(err)}\n")
        return USAGE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
