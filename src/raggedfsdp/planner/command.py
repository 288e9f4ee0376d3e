"""The ``raggedfsdp plan`` command: its arguments, and the report as rich tables or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, TextIO

import torch

from .._console import arg_type, format_bytes
from ..layout import BlockSize, parse_block_size
from ..models import MODEL_NAMES
from ._planner import OPTIMIZER_TYPES
from .bucketing import parse_buffer_size
from .report import PlanReport, WorldReport, plan_report

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["configure_parser", "parse_world_sizes", "render_plan_report", "run"]


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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Default bucket cap of ``plan`` (see docs/planner.md for the measurements behind it).
DEFAULT_BUFFER_SIZE = "none"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, metavar="NAME", help=f"one of: {', '.join(MODEL_NAMES)}"
    )
    parser.add_argument(
        "--world",
        required=True,
        type=arg_type(parse_world_sizes),
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
        type=arg_type(parse_block_size),
        default=None,
        metavar="none|ROWS|ROWSxCOLS|whole",
        help="RaggedShard block: none (element), 32 (rows), 128x128 (tiles), whole (default: none)",
    )
    parser.add_argument(
        "--buffer-size",
        type=arg_type(parse_buffer_size),
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


def run(args: argparse.Namespace) -> int:
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
        else f"buckets <= {format_bytes(opts.buffer_size)}"
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
        format_bytes(world.allgather_bytes_total),
        format_bytes(world.bound_rank_numel * item),
        format_bytes(world.fsdp2_rank_numel * item),
        format_bytes(world.fsdp1_rank_numel * item),
    )
    table.add_row("all-gather bytes, largest", format_bytes(world.allgather_bytes_max), "", "", "")
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
