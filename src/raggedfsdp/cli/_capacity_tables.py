"""What ``raggedfsdp plan --gpu ...`` prints: a capacity report.

As rich tables, JSON records and a plot of memory and step time against the world size.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .._console import format_bytes, write_whole
from ..capacity.capacity import CapacityReport, MeshFit, SystemCost, WorldCapacity
from ..facts.systems import SYSTEMS
from ..planner.quant_blocks import Compression

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["PLOT_WORLDS", "capacity_records", "plot_capacity", "render_capacity"]

#: World sizes of the plot: powers of two from 4 to 16,384.
PLOT_WORLDS = tuple(2**k for k in range(2, 15))

_MEMORY_ROWS = (
    ("sharded parameters", "params"),
    ("sharded gradients", "grads"),
    ("optimizer state", "optimizer"),
    ("quantized shards + residuals", "compression"),
    ("persistent", "persistent"),
    ("unsharded at the peak", "unsharded"),
    ("activations at the peak", "activations"),
    ("peak", "peak"),
)


def _options_text(report: CapacityReport) -> str:
    o = report.options
    parts = [
        f"batch {o.batch} x seq {o.seq_len}",
        o.optimizer,
        str(o.param_dtype).removeprefix("torch."),
        "activation checkpointing" if o.checkpointing else "no checkpointing",
    ]
    if o.buffer_size is not None:
        parts.append(f"buckets <= {format_bytes(o.buffer_size)}")
    if o.compression is not None and o.compression.enabled:
        parts.append(f"raggedfsdp compressed: {_compression_text(o.compression)}")
    if o.offload:
        parts.append(f"CPU offload ({'pinned' if o.pin_memory else 'pageable'})")
    if o.reshard_after_forward is not None:
        parts.append(f"reshard after forward to {o.reshard_after_forward}")
    return ", ".join(parts)


def _compression_text(compression: Compression | None) -> str:
    """``all-gather float8_e4m3fn, reduce-scatter int8, error feedback`` (or ``none``)."""
    if compression is None or not compression.enabled:
        return "none"
    parts = []
    for label, dtype in (
        ("all-gather", compression.all_gather),
        ("reduce-scatter", compression.reduce_scatter),
    ):
        if dtype is not None:
            parts.append(f"{label} {str(dtype).removeprefix('torch.')}")
    if compression.error_feedback:
        parts.append("error feedback")
    return ", ".join(parts)


def _world_table(report: CapacityReport, world: WorldCapacity) -> Table:
    """Memory per rank, bytes and time per step, raggedfsdp beside FSDP2, for one W.

    One row per figure; long by nature.
    """
    from rich.table import Table

    hw = report.hardware
    costs = [world.systems[s.name] for s in SYSTEMS]
    mesh = ""
    if world.parallel is not None:
        mesh = f"  dp {world.dp:,} x ep {world.dims.ep} x tp {world.dims.tp}"
    table = Table(
        title=f"{report.model}  W={world.world_size:,}{mesh}  {hw.name}  ({_options_text(report)})",
        caption=(
            f"usable memory {format_bytes(report.usable_bytes)} per device "
            f"({100 * report.options.reserve:.0f}% reserve); link "
            f"{hw.link_bytes_per_s(world.world_size) * 8 / 1e9:,.0f} Gbit/s per device; "
            f"compute at {100 * hw.efficiency:.0f}% of {hw.peak_flops / 1e12:,.0f} TFLOP/s; "
            f"planned and costed in {1000 * world.plan_seconds:,.0f} ms"
        ),
    )
    table.add_column("per rank")
    for system in SYSTEMS:
        table.add_column(system.name, justify="right")
    memories = [c.memory.to_dict() for c in costs]
    if report.options.offload:  # the split is in its own table (_offload_table)
        table.add_row("device peak", *(format_bytes(c.memory.peak) for c in costs))
        table.add_row("host, this rank", *(format_bytes(c.memory.host) for c in costs))
        table.add_row("host, its node", *(format_bytes(c.host_per_node) for c in costs))
    else:
        for label, key in _MEMORY_ROWS:
            table.add_row(label, *(format_bytes(m[key]) for m in memories))
    table.add_row("fits", *(_fits_text(c) for c in costs))
    # what the rank feeds in (RuntimeStats' convention): its shards; whole gradients
    table.add_row(
        "all-gather input per step", *(format_bytes(c.bytes.all_gather_bytes) for c in costs)
    )
    table.add_row(
        "reduce-scatter input per step",
        *(format_bytes(c.bytes.reduce_scatter_bytes) for c in costs),
    )
    table.add_row("sent on the link per step", *(format_bytes(c.bytes.wire_bytes) for c in costs))
    if report.options.reshard_after_forward is not None:
        table.add_row(
            "  pieces kept from forward, at the peak",
            *(format_bytes(c.memory.post_forward) for c in costs),
        )
        table.add_row(
            "  their all-gather input per step",
            *(format_bytes(c.bytes.post_forward_all_gather_bytes) for c in costs),
        )
    _part_rows(table, costs)
    if world.parallel is not None:
        _parallel_rows(table, world, len(costs))
    degrees = {"tp_s": world.dims.tp, "ep_s": world.dims.ep}
    for label, key in _TIME_ROWS:
        if degrees.get(key, 2) == 1:
            continue
        table.add_row(label, *(f"{c.time.to_dict()[key] * 1000:,.1f} ms" for c in costs))
    table.add_row("tokens/s per device", *(f"{c.time.tokens_per_s:,.0f}" for c in costs))
    table.add_row("communication share", *(f"{100 * c.time.comm_share:.1f}%" for c in costs))
    return table


def _part_rows(table: Table, costs: list[SystemCost]) -> None:
    """A vision-language model's vision side and language model apart: their persistent bytes
    on a rank, and what its all-gathers and reduce-scatters take in per step for each."""
    for index, part in enumerate(costs[0].parts):
        parts = [c.parts[index] for c in costs]
        table.add_row(
            f"{part.name} ({part.param_numel / 1e9:,.2f}B): persistent",
            *(format_bytes(p.persistent) for p in parts),
        )
        table.add_row("  all-gather input", *(format_bytes(p.all_gather_bytes) for p in parts))
        table.add_row(
            "  reduce-scatter input", *(format_bytes(p.reduce_scatter_bytes) for p in parts)
        )


#: (label, StepTime key) of the time rows; the tp and ep rows only under tensor or expert
#: parallelism
_TIME_ROWS = (
    ("forward", "forward_s"),
    ("backward", "backward_s"),
    ("optimizer", "optimizer_s"),
    ("step", "total_s"),
    ("  compute", "compute_s"),
    ("  collectives (own time)", "comm_s"),
    ("  tp all-reduces (critical path)", "tp_s"),
    ("  ep all-to-alls (critical path)", "ep_s"),
    ("  quantizing (compute thread)", "codec_s"),
    ("  host <-> device copies (compute stream)", "host_copy_s"),
    ("  communication exposed", "exposed_comm_s"),
)


def _parallel_rows(table: Table, world: WorldCapacity, columns: int) -> None:
    """Tensor and expert parallelism's bytes per step (the same for every system), for each
    degree above 1: the all-reduces' and all-to-alls' input and what leaves the rank."""
    p = world.parallel
    assert p is not None
    rows = []
    if world.dims.tp > 1:
        rows += [
            (f"tp all-reduce input per step ({p.tp_calls:,} calls)", p.tp_bytes),
            ("tp sent on the link per step", p.tp_wire_bytes),
        ]
    if world.dims.ep > 1:
        rows += [
            (f"ep all-to-all input per step ({p.ep_calls:,} calls)", p.ep_bytes),
            ("ep sent to other ranks per step", p.ep_wire_bytes),
        ]
    for label, value in rows:
        table.add_row(label, *([format_bytes(value)] * columns))


#: (label, the device's bytes, the host's bytes) of a rank under offload, from
#: :meth:`MemoryBreakdown.to_dict`; None: nothing there
_OFFLOAD_ROWS: tuple[tuple[str, str | None, str | None], ...] = (
    ("sharded parameters", None, "params"),
    ("sharded gradients", None, "grads"),
    ("optimizer state", None, "optimizer"),
    ("residuals, divisor", "device_persistent", None),
    ("persistent", "device_persistent", "host"),
    ("unsharded at the peak", "unsharded", None),
    ("cast staging (pooled)", "staging", None),
    ("activations at the peak", "activations", None),
    ("peak", "peak", "host"),
)


def _offload_table(report: CapacityReport, world: WorldCapacity) -> Table:
    """Under offload: one rank's bytes on the device and on the host, for both systems."""
    from rich.table import Table

    ranks = min(world.world_size, report.hardware.devices_per_node)
    ram = report.usable_host_bytes
    host = f", {format_bytes(ram)} of host RAM per node" if ram is not None else ""
    table = Table(
        title=f"where the bytes live, W={world.world_size:,}, CPU offload",
        caption=f"usable: {format_bytes(report.usable_bytes)} per device{host} "
        f"({ranks} rank{'s' if ranks > 1 else ''} a node)",
    )
    table.add_column("per rank")
    for system in SYSTEMS:
        table.add_column(f"{system.name} device", justify="right")
        table.add_column(f"{system.name} host", justify="right")
    memories = [world.systems[s.name].memory.to_dict() for s in SYSTEMS]
    for label, device, host in _OFFLOAD_ROWS:
        cells = []
        for memory in memories:
            cells += [format_bytes(memory[k]) if k else "-" for k in (device, host)]
        table.add_row(label, *cells)
    nodes = [("-", format_bytes(world.systems[s.name].host_per_node)) for s in SYSTEMS]
    table.add_row("per node", *(cell for pair in nodes for cell in pair))
    return table


def _fits_text(cost: SystemCost) -> str:
    """``yes`` or ``NO``, with where the device's peak is, or that the node's host RAM is short
    (under offload)."""
    if not cost.host_fits:
        return "NO (host RAM of the node)"
    return ("yes" if cost.fits else "NO") + f" (peak: {cost.memory.phase} backward)"


def _smallest_text(report: CapacityReport) -> str | None:
    """The smallest-W line (``None``: none fits)."""
    if report.smallest_world is None:
        return None
    mp = report.options.dims.model_parallel
    which = "smallest power-of-two W" if mp == 1 else f"smallest W = {mp} (tp x ep) x 2^k"
    if not report.options.offload:
        return f"{which} that fits: {report.smallest_world:,}"
    plain = report.smallest_world_without_offload
    without = f"{plain:,}" if plain is not None else "none up to 16,384"
    return (
        f"{which} that fits with CPU offload: {report.smallest_world:,} "
        f"(without offload: {without})"
    )


def _mesh_text(fit: MeshFit) -> str:
    return (
        f"(dp {fit.dp:,}, tp {fit.tp}, ep {fit.ep}): peak {format_bytes(fit.peak)}, "
        f"{fit.tokens_per_s:,.0f} tokens/s per device"
    )


def _mesh_lines(report: CapacityReport) -> list[str]:
    """The ``(dp, tp, ep)`` search's result at each world size."""
    lines = []
    for search in report.meshes:
        lines.append(
            f"W={search.world_size:,}, {search.tried} (tp, ep) costed with tp inside a node:"
        )
        if search.smallest is None or search.fastest is None:
            lines.append("  no (dp, tp, ep) fits")
            continue
        lines.append(f"  smallest (dp, tp, ep) that fits {_mesh_text(search.smallest)}")
        lines.append(f"  fastest that fits {_mesh_text(search.fastest)}")
    return lines


def render_capacity(report: CapacityReport, out: TextIO) -> None:
    """One table per world size, then the smallest world size that fits."""
    from rich.console import Console

    console = Console(file=out)
    if not console.is_terminal:
        console = Console(file=out, width=120)
    console.print(f"{report.model}: {report.param_numel:,} parameters")
    for world in report.worlds:
        if report.options.offload:
            console.print(_offload_table(report, world))
        console.print(_world_table(report, world))
    smallest = _smallest_text(report)
    if smallest is not None:
        console.print(smallest)
    else:
        console.print(
            "no W up to 16,384 fits (activations do not shrink with W): turn on "
            "--activation-checkpointing, lower --batch or --seq, use larger devices, or "
            "--tp / --ep"
        )
    for line in _mesh_lines(report):
        console.print(line)


def capacity_records(report: CapacityReport) -> list[dict[str, object]]:
    """One JSON-ready dict per world size, each self-contained."""
    o = report.options
    head: dict[str, object] = {
        "model": report.model,
        "param_numel": report.param_numel,
        "hardware": asdict(report.hardware),
        "batch": o.batch,
        "seq_len": o.seq_len,
        "optimizer": o.optimizer,
        "activation_checkpointing": o.checkpointing,
        "param_dtype": str(o.param_dtype).removeprefix("torch."),
        "reserve": o.reserve,
        "compression": _compression_text(o.compression),
        "usable_bytes": report.usable_bytes,
        "smallest_world": report.smallest_world,
        "offload": o.offload,
        "pin_memory": o.pin_memory,
        "tp": o.tp,
        "ep": o.ep,
        "reshard_after_forward": o.reshard_after_forward,
    }
    if o.offload:
        head["smallest_world_without_offload"] = report.smallest_world_without_offload
    records = []
    for world in report.worlds:
        systems = {
            name: {
                "memory": cost.memory.to_dict(),
                "fits": cost.fits,
                **(
                    {"host_per_node": cost.host_per_node, "host_fits": cost.host_fits}
                    if o.offload
                    else {}
                ),
                "bytes": asdict(cost.bytes),
                "time": cost.time.to_dict(),
                **({"parts": [asdict(part) for part in cost.parts]} if cost.parts else {}),
            }
            for name, cost in world.systems.items()
        }
        record = {**head, "world_size": world.world_size, "plan_seconds": world.plan_seconds}
        if world.parallel is not None:
            record["dp"] = world.dp
            record["parallel"] = asdict(world.parallel)
        searched = [m for m in report.meshes if m.world_size == world.world_size]
        if searched:
            record["mesh_search"] = asdict(searched[0])
        records.append({**record, **systems})
    return records


def plot_capacity(report: CapacityReport, path: str | Path) -> bool:
    """Peak memory per rank and step time against W for both systems (``report`` costed at
    :data:`PLOT_WORLDS`); ``False`` (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    worlds = [w.world_size for w in report.worlds]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, style in zip(SYSTEMS, ("-o", "--s"), strict=True):
        peaks = [w.systems[system.name].memory.peak / 2**30 for w in report.worlds]
        steps = [w.systems[system.name].time.total_s for w in report.worlds]
        mem_ax.plot(worlds, peaks, style, label=system.name, markersize=4)
        time_ax.plot(worlds, steps, style, label=system.name, markersize=4)
    mem_ax.axhline(report.usable_bytes / 2**30, color="grey", linestyle=":", label="usable")
    mem_ax.set(ylabel="peak memory per rank (GiB)", yscale="log")
    time_ax.set(ylabel="step time (s)", yscale="log")
    for ax in (mem_ax, time_ax):
        ax.set(xscale="log", xlabel="world size W")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report.model} on {report.hardware.name}: {_options_text(report)}")
    fig.tight_layout()
    try:
        target = Path(path)
        fmt = target.suffix.removeprefix(".") or "png"
        write_whole(target, lambda partial: fig.savefig(partial, dpi=110, format=fmt))
    finally:
        plt.close(fig)
    return True
