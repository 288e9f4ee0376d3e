"""``raggedfsdp plan --pp``'s tables: a layout's memory per stage and step, and the search.

As rich tables or JSON, from :mod:`raggedfsdp.capacity.pipeline`'s plans and search.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, TextIO

from .._console import format_bytes
from ..capacity.pipeline import PipelineFit, PipelinePlan, PipelineSearch

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["pipeline_records", "render_pipeline"]


def _ranks_shown(plan: PipelinePlan) -> list[int]:
    """The first rank (embedding), the second (the most in flight among the blocks-only ranks)
    and the last (head and loss); every rank up to four."""
    pp = len(plan.ranks)
    return list(range(pp)) if pp <= 4 else [0, 1, pp - 2, pp - 1]


def _stage_table(model: str, world: int, plans: dict[str, PipelinePlan], usable: int) -> Table:
    from rich.table import Table

    first = next(iter(plans.values()))
    dp, tp, pp, ep = first.dims
    s = first.schedule
    table = Table(
        title=(
            f"{model}  W={world:,}  dp {dp} x tp {tp} x pp {pp} x ep {ep}  {s.name}, "
            f"{s.microbatches} micro-batches, {s.stages_per_rank} stage(s) per rank"
        ),
        caption=(
            f"usable memory {format_bytes(usable)} per device; unsharded stage weights and "
            f"gradients held for the whole step (no reshard after forward under PP); costed "
            f"in {1000 * first.plan_seconds:,.0f} ms"
        ),
    )
    table.add_column(f"per device ({first.system})")
    shown = _ranks_shown(first)
    for r in shown:
        rank = first.ranks[r]
        what = "emb + " if rank.embedding else ""
        what += f"{rank.layers} layers" + (" + head" if rank.head else "")
        table.add_column(f"rank {r}: {what}", justify="right")
    rows = (
        ("sharded parameters", lambda c: format_bytes(c.params)),
        ("sharded gradients", lambda c: format_bytes(c.grads)),
        ("optimizer state", lambda c: format_bytes(c.optimizer)),
        ("unsharded, whole step", lambda c: format_bytes(c.unsharded)),
        ("micro-batches in flight (local stages)", lambda c: str(c.in_flight)),
        ("activations at the peak", lambda c: format_bytes(c.activations)),
        ("peak", lambda c: format_bytes(c.peak)),
        ("fits", lambda c: "yes" if c.peak <= usable else "NO"),
        ("forward + backward, one micro-batch", lambda c: _ms(c.forward_s + c.backward_s)),
        ("FSDP all-gathers + reduce-scatters", lambda c: _ms(c.fsdp_s)),
        ("tp / ep collectives, all micro-batches", lambda c: _ms(c.parallel_s)),
    )
    for label, cell in rows:
        table.add_row(label, *(cell(first.ranks[r]) for r in shown))
    for name, plan in plans.items():
        if plan is not first:
            table.add_row(f"{name}: peak", *(format_bytes(plan.ranks[r].peak) for r in shown))
    return table


def _step_table(plans: dict[str, PipelinePlan]) -> Table:
    from rich.table import Table

    table = Table(title="the step")
    table.add_column("")
    for name in plans:
        table.add_column(name, justify="right")
    rows = (
        ("bubble", lambda p: f"{_ms(p.bubble_s)} ({100 * p.bubble_fraction:.1f}%)"),
        ("stage-to-stage sends", lambda p: _ms(p.p2p_s)),
        ("step", lambda p: _ms(p.step_s)),
        ("tokens/s per device", lambda p: f"{p.tokens_per_s:,.1f}"),
        ("peak (the fullest rank)", lambda p: format_bytes(p.peak)),
    )
    for label, cell in rows:
        table.add_row(label, *(cell(p) for p in plans.values()))
    return table


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.1f} ms"


def _fit_text(fit: PipelineFit) -> str:
    return (
        f"(dp {fit.dp}, tp {fit.tp}, pp {fit.pp}, ep {fit.ep}): peak {format_bytes(fit.peak)}, "
        f"bubble {100 * fit.bubble_fraction:.1f}%, {fit.tokens_per_s:,.1f} tokens/s per device"
    )


def render_pipeline(
    model: str,
    world: int,
    plans: dict[str, PipelinePlan],
    search: PipelineSearch,
    usable: int,
    out: TextIO,
) -> None:
    """The layout's ranks and step, then the search's fastest fits."""
    from rich.console import Console

    console = Console(file=out)
    if not console.is_terminal:
        console = Console(file=out, width=160)
    console.print(_stage_table(model, world, plans, usable))
    console.print(_step_table(plans))
    console.print(
        f"W={world:,}: {search.tried} (dp, tp, pp, ep) costed with {search.schedule} in "
        f"{search.seconds:,.1f} s (tp inside a node; pp = 1: FSDP alone, one micro-batch)"
    )
    if not search.fits:
        console.print("  none fits")
    for place, fit in enumerate(search.fits[:5]):
        console.print(f"  {'fastest that fits' if place == 0 else 'then'} {_fit_text(fit)}")


def pipeline_records(
    model: str, world: int, plans: dict[str, PipelinePlan], search: PipelineSearch
) -> dict[str, object]:
    """One JSON-ready object: the layout for each system and the search."""
    return {
        "model": model,
        "world_size": world,
        "systems": {name: {**asdict(p), "peak": p.peak} for name, p in plans.items()},
        "search": {**asdict(search), "fastest": asdict(search.fastest) if search.fits else None},
    }
