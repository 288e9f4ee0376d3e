"""The ``raggedfsdp plan`` command: its arguments, and the report as rich tables or JSON.

Without capacity flags it reports the plans (padding, elements per rank, FSDP2/FSDP1 beside them).
With any capacity flag (``--gpu``, ``--batch``, the compression flags as ``raggedfsdp train`` spells
them, ``--offload``, ``--tp`` / ``--ep``, ...) it answers "will it fit, and how fast": memory per
rank, bytes and time per step, raggedfsdp beside FSDP2; with ``--tp`` or ``--ep`` the bytes of each
dimension and the smallest ``(dp, tp, ep)`` that fits each world size.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from .._console import arg_type, check_writable, format_bytes
from ..capacity.capacity import DEFAULT_RESERVE, CapacityOptions, capacity_report
from ..capacity.hardware import HARDWARE, Hardware, hardware
from ..capacity.pipeline import plan_pipeline, search_pipeline
from ..capacity.report import PlanReport, WorldReport, plan_report
from ..capacity.schedules import PipelineSchedule
from ..capacity.shapes import EXPERTS_PER_TOKEN
from ..capacity.wire import ALL_GATHER_CODES, REDUCE_SCATTER_CODES, CompressionSpec
from ..facts import PP_SCHEDULES, ParallelDims, stages_per_rank
from ..layout import BlockSize, parse_block_size
from ..models import GPT_CONFIGS, MODEL_NAMES, build_model
from ..planner import OPTIMIZER_TYPES, parse_buffer_size
from ._capacity_tables import PLOT_WORLDS, capacity_records, plot_capacity, render_capacity
from ._pipeline_tables import pipeline_records, render_pipeline

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["configure", "parse_world_sizes", "render_plan_report", "run"]


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
#: Sequence length of a capacity plan when the model has none of its own (the zoo's LLMs).
DEFAULT_SEQ = 4096
_CAPACITY_FLAGS = (
    "gpu",
    "link_gbit",
    "batch",
    "seq",
    "checkpointing",
    "efficiency",
    "reserve",
    "plot",
    "compress_all_gather",
    "compress_reduce_scatter",
    "error_feedback",
    "offload",
    "pin_memory",
    "tp",
    "ep",
    "reshard_after_forward",
    "pp",
    "reduce_dtype",
)
#: Default bucket cap of ``plan`` (see docs/results/planner.md for the measurements behind it).
DEFAULT_BUFFER_SIZE = "none"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` arguments to ``parser``: the model, world sizes and policy, then the
    capacity flags."""
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
        "--dtype",
        choices=tuple(_DTYPES),
        default=None,
        help="communication dtype (with --gpu: param_dtype of mixed precision); default "
        "float32, bfloat16 for a capacity plan on a GPU",
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=tuple(_DTYPES),
        default=None,
        help="with capacity flags: what gradients are reduced (and accumulated) in "
        "(MixedPrecisionPolicy.reduce_dtype; default: --dtype's)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON: a list, one object per world size"
    )
    _configure_capacity(parser)


def _positive(kind: type[int] | type[float], what: str) -> Callable[[str], object]:
    """An argparse type: a positive ``kind``, else one line naming ``what``."""

    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{what} must be a positive number, got {text!r}") from None
        if not value > 0:
            raise ValueError(f"{what} must be positive, got {text}")
        return value

    parse.__name__ = what
    return arg_type(parse)


def _configure_capacity(parser: argparse.ArgumentParser) -> None:
    """The capacity flags: what the step is and what it runs on."""
    group = parser.add_argument_group("capacity (will it fit, and how fast)")
    group.add_argument(
        "--gpu",
        metavar="PRESET",
        help=f"device preset: {', '.join(HARDWARE)} (default with other capacity flags: h100)",
    )
    group.add_argument(
        "--link-gbit",
        type=_positive(float, "--link-gbit"),
        metavar="GBIT",
        help="bandwidth per device between nodes, Gbit/s (default: the preset's NIC)",
    )
    group.add_argument(
        "--efficiency",
        type=_positive(float, "--efficiency"),
        metavar="FRACTION",
        help="fraction of peak FLOP/s the compute reaches (default: the preset's, 0.5)",
    )
    group.add_argument(
        "--batch", type=_positive(int, "--batch"), metavar="B", help="sequences per rank (1)"
    )
    group.add_argument(
        "--seq",
        type=_positive(int, "--seq"),
        metavar="T",
        help=f"tokens per sequence (default: the model's, else {DEFAULT_SEQ})",
    )
    group.add_argument(
        "--activation-checkpointing",
        dest="checkpointing",
        action="store_true",
        default=None,
        help="every block recomputes its activations in backward",
    )
    group.add_argument(
        "--reserve",
        type=arg_type(float),
        metavar="FRACTION",
        help=f"device memory kept free (allocator, communication buffers, CUDA context); "
        f"default {DEFAULT_RESERVE}",
    )
    group.add_argument(
        "--plot",
        metavar="FILE",
        help="also write a PNG of memory and step time against W (4 to 16,384)",
    )
    _configure_compression(group)
    _configure_offload(group)
    _configure_parallel(group)


def _configure_parallel(group: argparse._ArgumentGroup) -> None:
    """Tensor and expert parallelism beside FSDP (docs/capacity.md, "With tensor and expert
    parallelism")."""
    group.add_argument(
        "--tp",
        type=_positive(int, "--tp"),
        metavar="N",
        help="tensor-parallel degree (torchtitan's plans; consecutive ranks); also searches "
        "the (dp, tp, ep) that fit each --world (default: 1)",
    )
    group.add_argument(
        "--ep",
        type=_positive(int, "--ep"),
        metavar="N",
        help="expert-parallel degree, borrowed from the data-parallel ranks (mixture-of-experts "
        "models); also searches the (dp, tp, ep) that fit (default: 1)",
    )
    group.add_argument(
        "--pp",
        type=_positive(int, "--pp"),
        metavar="N",
        help="pipeline ranks: memory per stage, the bubble and the step for this (dp, tp, pp, "
        "ep), then the fastest (dp, tp, pp, ep) that fits each --world (--batch: sequences "
        "per micro-batch)",
    )
    group.add_argument(
        "--pp-schedule",
        choices=tuple(PP_SCHEDULES),
        default="1f1b",
        help="torch's schedule (default: 1f1b)",
    )
    group.add_argument(
        "--microbatches",
        type=_positive(int, "--microbatches"),
        metavar="M",
        help="micro-batches per step (default: 4 x pp)",
    )
    group.add_argument(
        "--stages-per-rank",
        type=_positive(int, "--stages-per-rank"),
        metavar="V",
        help="stages per rank of interleaved-1f1b and zero-bubble (default: 2; 1 otherwise)",
    )
    group.add_argument(
        "--reshard-after-forward",
        type=_positive(int, "--reshard-after-forward"),
        metavar="N",
        help="every block reshards after forward to groups of N ranks (fully_shard's "
        "reshard_after_forward=N): keeps a 1/N piece, all-gathers within the N in backward "
        "(default: reshard to all ranks)",
    )


def _configure_offload(group: argparse._ArgumentGroup) -> None:
    """CPU offload: both systems with ``CPUOffloadPolicy`` (docs/capacity.md)."""
    group.add_argument(
        "--offload",
        action="store_true",
        default=None,
        help="CPU offload (CPUOffloadPolicy) for both systems: shards, gradients and optimizer "
        "state on the host; device and host bytes, PCIe copies, the optimizer on the host",
    )
    group.add_argument(
        "--pin-memory",
        action="store_true",
        default=None,
        help="the offload policy's pin_memory (needs --offload)",
    )


def _configure_compression(group: argparse._ArgumentGroup) -> None:
    """``raggedfsdp train``'s compression flags, same spellings: raggedfsdp's collectives move
    codes and scales (FSDP2 beside it stays uncompressed)."""
    group.add_argument(
        "--compress-all-gather",
        choices=ALL_GATHER_CODES,
        help="quantize raggedfsdp's all-gather to fp8 (e4m3) or int8 codes plus one fp32 scale "
        "per block, as raggedfsdp train does (default: none)",
    )
    group.add_argument(
        "--compress-reduce-scatter",
        choices=REDUCE_SCATTER_CODES,
        help="quantize raggedfsdp's reduce-scatter (default: none)",
    )
    group.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="8-bit error-feedback residuals (needs --compress-reduce-scatter)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``raggedfsdp plan``: the plan report, or the capacity report with capacity flags;
    the exit status."""
    if any(getattr(args, flag, None) is not None for flag in _CAPACITY_FLAGS):
        return _run_capacity(args)
    report = plan_report(
        args.model,
        args.world,
        optimizer=args.optimizer,
        block_size=args.block_size,
        buffer_size=args.buffer_size,
        dtype=_DTYPES[args.dtype or "float32"],
    )
    if args.json:
        json.dump(report.to_records(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_plan_report(report, sys.stdout)
    return 0


def _run_capacity(args: argparse.Namespace) -> int:
    """``plan`` with capacity flags: the capacity report, and the plot if asked for."""
    if args.model not in MODEL_NAMES:
        raise ValueError(f"unknown model {args.model!r}; known models: {', '.join(MODEL_NAMES)}")
    overrides = {"efficiency": args.efficiency} if args.efficiency else {}
    if args.link_gbit:
        overrides["link_gbit"] = args.link_gbit
    hw = hardware(args.gpu or "h100", **overrides)
    _check_offload(args, hw)
    dims = ParallelDims(tp=args.tp or 1, ep=args.ep or 1)
    for world in args.world:  # before any planning
        dims.check_world(world)
    if args.plot:  # before any planning
        check_writable(Path(args.plot), "--plot")
    gpt = GPT_CONFIGS.get(args.model)
    default_dtype = "float32" if hw.name == "cpu-gloo" else "bfloat16"
    options = CapacityOptions(
        batch=args.batch or 1,
        seq_len=args.seq or (gpt.seq_len if gpt else DEFAULT_SEQ),
        optimizer=args.optimizer,
        checkpointing=bool(args.checkpointing),
        block_size=args.block_size,
        buffer_size=args.buffer_size,
        param_dtype=_DTYPES[args.dtype or default_dtype],
        reduce_dtype=_DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
        reserve=DEFAULT_RESERVE if args.reserve is None else args.reserve,
        compression=CompressionSpec.parse(
            args.compress_all_gather, args.compress_reduce_scatter, bool(args.error_feedback)
        ),
        offload=bool(args.offload),
        pin_memory=bool(args.pin_memory),
        tp=dims.tp,
        ep=dims.ep,
        reshard_after_forward=args.reshard_after_forward,
    )
    if args.pp is not None:
        return _run_pipeline(args, hw, options)
    searched = args.tp is not None or args.ep is not None
    report = capacity_report(args.model, args.world, hw, options, search_meshes=searched)
    if args.json:
        json.dump(capacity_records(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_capacity(report, sys.stdout)
    if args.plot:
        multiple = dims.world_multiple * (args.reshard_after_forward or 1)
        worlds = [w for w in PLOT_WORLDS if w % multiple == 0]
        curve = capacity_report(
            args.model, worlds, hw, options, find_smallest=False, up_to_shardable=True
        )
        if not plot_capacity(curve, args.plot):
            sys.stderr.write("raggedfsdp plan: matplotlib is not installed; no plot written\n")
        elif not args.json:
            sys.stdout.write(f"plot: {args.plot}\n")
    return 0


def _run_pipeline(args: argparse.Namespace, hw: Hardware, options: CapacityOptions) -> int:
    """``plan --pp``: each world size's layout (memory per stage, bubble, step) and the
    search for the fastest ``(dp, tp, pp, ep)`` that fits."""
    if args.plot:
        raise ValueError("--plot draws FSDP's curve against W; it does not take --pp")
    stages = args.stages_per_rank or stages_per_rank(args.pp_schedule)
    schedule = PipelineSchedule(args.pp_schedule, args.pp, args.microbatches or 4 * args.pp, stages)
    module = build_model(args.model, device="meta")
    k = EXPERTS_PER_TOKEN.get(args.model)
    usable = int(hw.memory_bytes * (1 - options.reserve))
    records = []
    for world in args.world:
        plans = plan_pipeline(
            module, world, hw, options, schedule, experts_per_token=k, model_name=args.model
        )
        search = search_pipeline(
            module,
            world,
            hw,
            options,
            schedule=args.pp_schedule,
            microbatches=args.microbatches,
            stages_per_rank=stages,
            experts_per_token=k,
            model_name=args.model,
        )
        if args.json:
            records.append(pipeline_records(args.model, world, plans, search))
        else:
            render_pipeline(args.model, world, plans, search, usable, sys.stdout)
    if args.json:
        json.dump(records, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return 0


def _check_offload(args: argparse.Namespace, hw: Hardware) -> None:
    """``--offload`` needs a device with a host link, ``--pin-memory`` needs ``--offload``: one
    line naming the flag, before any planning."""
    if args.pin_memory and not args.offload:
        raise ValueError("--pin-memory pins the host copies of --offload; add --offload")
    if args.offload and hw.pcie_bytes_per_s is None:
        raise ValueError(
            f"--offload needs a device with a host to offload to, but --gpu {hw.name} runs on "
            f"the host already (no PCIe link in the preset); use a GPU preset, e.g. --gpu h100"
        )


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
