"""What the planner benchmark writes: its markdown sections (targets met or missed, tables of
padding, bounds, FSDP2/FSDP1 cuts and plan times)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence

import torch

from raggedfsdp.capacity.report import WorldReport

from .runner import BucketTime, FixtureCheck, Row
from .scenarios import (
    BOUND_TARGET,
    BUCKET_TARGET_S,
    MODEL_TARGET_S,
    PADDING_TARGET,
    SYNTHETIC,
    TIME_TARGET_S,
    TIME_TARGET_WORLD,
    TIMING_WORLDS,
    WHOLE_MODEL,
)


def _pct(ratio: float) -> str:
    if ratio >= 10:
        return f"{100 * ratio:,.0f}%"
    return f"{100 * ratio:.2f}%"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    align = ["---" if i < 3 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def main_table(rows: Sequence[Row]) -> list[str]:
    """One bucket per FSDP unit: ours vs the bound vs FSDP2/FSDP1."""
    header = [
        "model",
        "granularity",
        "W",
        "padding",
        "bound padding",
        "S/bound worst",
        "FSDP2 padding",
        "FSDP2 cut",
        "FSDP1 cut",
        "blocks",
        "plan ms",
    ]
    body = []
    for r in rows:
        if r.buffer != "unit":
            continue
        w = r.world
        body.append(
            [
                r.model,
                r.granularity,
                f"{w.world_size:,}",
                _pct(w.padding_ratio),
                _pct(w.bound_padding_ratio),
                f"{w.worst_bound_ratio:.3f}",
                _pct(w.fsdp2_padding_ratio),
                f"{w.fsdp2_cut_blocks:,}",
                f"{w.fsdp1_cut_blocks:,}",
                f"{w.blocks_total:,}",
                f"{1000 * w.plan_seconds:.1f}",
            ]
        )
    return _table(header, body)


def buffer_table(rows: Sequence[Row], buffers: Sequence[str]) -> list[str]:
    """Padding per bucket cap (``*`` marks a bucket more than 1.10x over its bound), and the best
    cap for each row: what choosing the cap per model and world size would give."""
    by_key: dict[tuple[str, str, int], dict[str, WorldReport]] = {}
    for r in rows:
        by_key.setdefault((r.model, r.granularity, r.world.world_size), {})[r.buffer] = r.world
    header = [
        "model",
        "granularity",
        "W",
        *(f"{b} padding" for b in buffers),
        "best cap",
        "slowest plan ms",
    ]
    body = []
    for (model, gran, world), worlds in by_key.items():
        cells = []
        for b in buffers:
            w = worlds[b]
            mark = "*" if w.worst_bound_ratio > BOUND_TARGET else ""
            cells.append(_pct(w.padding_ratio) + mark)
        # Ties go to the cap listed first (`unit` first).
        best = min(buffers, key=lambda b: worlds[b].padding_ratio)
        slowest = max(w.plan_seconds for w in worlds.values())
        body.append([model, gran, f"{world:,}", *cells, best, f"{1000 * slowest:.1f}"])
    return _table(header, body)


def cap_summary(rows: Sequence[Row], buffers: Sequence[str]) -> list[str]:
    """Per bucket cap: padding at block granularity where blocks are viable (W <= 64), how often
    the cap is the best choice there, and its slowest whole-model plan at the largest W."""
    viable = [r for r in rows if r.granularity != "element" and r.world.world_size <= 64]
    largest = max(r.world.world_size for r in rows)
    best: dict[tuple[str, str, int], str] = {}
    for key in {(r.model, r.granularity, r.world.world_size) for r in viable}:
        candidates = [r for r in viable if (r.model, r.granularity, r.world.world_size) == key]
        best[key] = min(
            candidates, key=lambda r: (r.world.padding_ratio, buffers.index(r.buffer))
        ).buffer
    header = [
        "buffer_size",
        "worst padding (32/128-row, W<=64)",
        "median",
        "best in",
        f"slowest plan at W={largest:,}",
    ]
    body = []
    for b in buffers:
        pads = sorted(r.world.padding_ratio for r in viable if r.buffer == b)
        times = [
            r.world.plan_seconds for r in rows if r.buffer == b and r.world.world_size == largest
        ]
        wins = sum(1 for v in best.values() if v == b)
        body.append(
            [
                b,
                _pct(pads[-1]) if pads else "",
                _pct(pads[len(pads) // 2]) if pads else "",
                f"{wins} of {len(best)}",
                f"{1000 * max(times):.1f} ms" if times else "",
            ]
        )
    return _table(header, body)


def targets(rows: Sequence[Row]) -> list[str]:
    """The issue's targets, met or missed, with the misses named."""

    def verdict(misses: Sequence[Row]) -> str:
        return "met" if not misses else "MISSED"

    def listing(misses: Sequence[Row], figure: Callable[[WorldReport], str]) -> str:
        return "; ".join(f"{_where(r)}: {figure(r.world)}" for r in misses)

    def ms(w: WorldReport) -> str:
        return f"{1000 * w.plan_seconds:.1f} ms"

    lines = []
    timed = [r for r in rows if r.world.world_size == TIME_TARGET_WORLD]
    if timed:
        slow = max(timed, key=lambda r: r.world.plan_seconds)
        over = [r for r in timed if r.world.plan_seconds >= TIME_TARGET_S]
        lines.append(
            f"- Plan time at W={TIME_TARGET_WORLD:,} (whole model, < {TIME_TARGET_S} s): "
            f"{verdict(over)}; slowest {ms(slow.world)} ({_where(slow)})."
        )
        per_unit = [r for r in timed if r.buffer == "unit"]
        if per_unit:
            slow_unit = max(per_unit, key=lambda r: r.world.plan_seconds)
            lines.append(
                f"  With one bucket per FSDP unit: "
                f"{verdict([r for r in per_unit if r.world.plan_seconds >= TIME_TARGET_S])}; "
                f"slowest {ms(slow_unit.world)} ({_where(slow_unit)})."
            )
    over_any = [r for r in rows if r.world.plan_seconds >= TIME_TARGET_S]
    slow_any = max(rows, key=lambda r: r.world.plan_seconds)
    lines.append(
        f"- Plan time at any W: slowest {ms(slow_any.world)} ({_where(slow_any)}); "
        f"{len(over_any)} of {len(rows)} runs at or over {TIME_TARGET_S} s"
        + (f": {listing(over_any, ms)}." if over_any else ".")
    )

    def ratio(w: WorldReport) -> str:
        return f"{w.worst_bound_ratio:.4f} (bucket {w.worst_bucket})"

    worst = max(rows, key=lambda r: r.world.worst_bound_ratio)
    misses = [r for r in rows if r.world.worst_bound_ratio > BOUND_TARGET]
    lines.append(
        f"- S within {BOUND_TARGET}x of the bound on every bucket: {verdict(misses)}; worst "
        f"{ratio(worst.world)} at {_where(worst)}"
        + (f"; misses: {listing(misses, ratio)}." if misses else ".")
    )

    def padding(w: WorldReport) -> str:
        return f"{_pct(w.padding_ratio)} (bound {_pct(w.bound_padding_ratio)})"

    allowed = [r for r in rows if r.world.bound_padding_ratio < PADDING_TARGET[r.granularity]]
    missed = [r for r in allowed if r.world.padding_ratio >= PADDING_TARGET[r.granularity]]
    lines.append(
        f"- Padding < 1% (element, 32-row) / < 3% (128-row) where the bound allows: "
        f"{verdict(missed)} in {len(allowed) - len(missed)} of the {len(allowed)} runs whose "
        f"bound is under the target"
        + (f" (missed: {listing(missed, padding)})" if missed else "")
        + f"; in the other {len(rows) - len(allowed)} runs the bound itself forces padding at or "
        f"over the target."
    )
    return lines


def _where(r: Row) -> str:
    return f"{r.model}, {r.granularity}, buffer {r.buffer}, W={r.world.world_size:,}"


def markdown(rows: Sequence[Row], buffers: Sequence[str], command: str, repeats: int) -> str:
    env = (
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), median of {repeats} runs per figure"
    )
    parts = [
        "",
        "Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        f"on {env}. Plan time is wall clock for the whole model with a fresh planner.",
        "",
        "### Targets",
        "",
        *targets(rows),
        "",
        "### One bucket per FSDP unit (`buffer_size=None`)",
        "",
        "Padding is over all buckets; *bound padding* is what the provable lower bound on",
        "each bucket's S forces; *S/bound worst* is the largest S / bound of any bucket.",
        "FSDP2 pads each parameter to `ceil(dim0/W)*W` rows; *cut* counts policy blocks",
        "(units) that FSDP2's row chunks or FSDP1's even split of each unit's flat parameter",
        "would cut, of *blocks* in all. Ours cut none.",
        "",
        *main_table(rows),
        "",
        "### Padding by bucket cap (`buffer_size`)",
        "",
        "`unit` is one bucket per FSDP unit; a cap splits a unit's parameters in model order",
        "(a larger parameter gets its own bucket). `*` marks a run with a bucket over 1.10x",
        "its bound.",
        "",
        *buffer_table(rows, buffers),
        "",
        "Summary per cap:",
        "",
        *cap_summary(rows, buffers),
        "",
    ]
    return "\n".join(parts)


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{1000 * seconds:,.0f}" if seconds >= 1 else f"{1000 * seconds:.1f}"


def bucket_markdown(
    rows: Sequence[BucketTime], whole: Sequence[BucketTime], check: FixtureCheck | None
) -> list[str]:
    header = [
        "model",
        "policy",
        "tensors",
        *(f"W={w:,} ms" for w in TIMING_WORLDS),
        "S/bound worst",
    ]
    body, by = [], {}
    for r in rows:
        by.setdefault((r.model, r.policy), []).append(r)
    for (model, policy), cells in by.items():
        body.append(
            [
                model,
                policy,
                f"{max(c.tensors for c in cells):,}",
                *(
                    _ms(c.seconds) + (f" ({_ms(c.before)})" if c.before is not None else "")
                    for c in cells
                ),
                f"{max(c.bound_ratio for c in cells):.4f}",
            ]
        )
    lines = _table(header, body)
    whole_body = []
    by_policy: dict[str, list[BucketTime]] = {}
    for r in whole:
        by_policy.setdefault(r.policy, []).append(r)
    for policy, cells in by_policy.items():
        whole_body.append(
            [
                policy,
                f"{cells[0].tensors:,}",
                *(
                    _ms(c.seconds) + (f" ({_ms(c.before)})" if c.before is not None else "")
                    for c in cells
                ),
                f"{max(c.bound_ratio for c in cells):.4f}",
            ]
        )
    whole_lines = _table(["policy", "tensors", *header[3:]], whole_body)
    targets = []
    over = [r for r in rows if r.seconds >= BUCKET_TARGET_S]
    slow = max(rows, key=lambda r: r.seconds)
    targets.append(
        f"- Every bucket (up to {max(r.tensors for r in rows):,} tensors) in < {BUCKET_TARGET_S} s "
        f"at every W and policy: {'met' if not over else 'MISSED'}; slowest "
        f"{_ms(slow.seconds)} ms ({slow.model}, {slow.policy}, W={slow.world_size:,}, "
        f"{slow.tensors:,} tensors)"
        + (
            "; over: "
            + "; ".join(
                f"{r.model} {r.policy} W={r.world_size:,} {_ms(r.seconds)} ms" for r in over
            )
            if over
            else ""
        )
        + "."
    )
    before = [r for r in rows if r.before is not None]
    if before:
        worst_before = max(before, key=lambda r: r.before or 0.0)
        targets.append(
            f"  Before (the fixture's one-run figure): slowest {_ms(worst_before.before)} ms "
            f"({worst_before.model}, {worst_before.policy}, W={worst_before.world_size:,}); "
            f"now {_ms(worst_before.seconds)} ms there."
        )
    if whole:
        slow_whole = max(whole, key=lambda r: r.seconds)
        over_whole = [r for r in whole if r.seconds >= MODEL_TARGET_S]
        targets.append(
            f"- Whole {WHOLE_MODEL} ({whole[0].tensors:,} tensors, identical layers planned once) "
            f"in < {MODEL_TARGET_S} s at every W and policy: "
            f"{'met' if not over_whole else 'MISSED'}; slowest {_ms(slow_whole.seconds)} ms "
            f"({slow_whole.policy}, W={slow_whole.world_size:,})"
            + (f"; {len(over_whole)} of {len(whole)} at or over" if over_whole else "")
            + "."
        )
    for name, picked in (
        ("element, 32-row, 128-row and tile", [r for r in rows if r.policy != "whole"]),
        ("whole", [r for r in rows if r.policy == "whole"]),
    ):
        worst = max(picked, key=lambda r: r.bound_ratio)
        targets.append(
            f"- S / bound, {name}: worst {worst.bound_ratio:.4f} ({worst.model}, "
            f"W={worst.world_size:,})."
        )
    if check is not None:
        larger = (
            f"{len(check.worse)} LARGER: " + "; ".join(check.worse[:10])
            if check.worse
            else "none larger"
        )
        targets.append(
            f"- Fixture (S recorded before this search, tests/support/planner_fixture.json): "
            f"{check.cases} cases, {check.buckets:,} bucket plans compared; {larger}, "
            f"{check.better:,} smaller; worst S / bound {check.worst_ratio:.4f} "
            f"({check.worst_where})"
            + (f"; {len(check.missing)} cases not recorded" if check.missing else "")
            + "."
        )
    return [
        "### Targets (single buckets and the whole separate-expert model)",
        "",
        *targets,
        "",
        "### Slowest bucket per model, policy and W (one bucket per FSDP unit)",
        "",
        "Median of the repeats with a fresh planner (no cache); in brackets the planner before",
        "this search, from the fixture (one run). *tensors*: in the slowest bucket;",
        f"`{SYNTHETIC}` is one bucket of 2,002 tensors (666 separate DeepSeek-V3 experts).",
        "",
        *lines,
        "",
        *(
            [
                f"### Whole {WHOLE_MODEL} (`plan_model`, identical layers planned once)",
                "",
                "Median of the repeats with a fresh planner; in brackets the planner before, from",
                "the fixture (one run).",
                "",
                *whole_lines,
                "",
            ]
            if whole
            else []
        ),
    ]


def fixture_lines(check: FixtureCheck | None) -> list[str]:
    if check is None:
        return []
    lines = [
        f"Fixture: {check.cases} cases, {check.buckets:,} bucket plans compared, "
        f"{len(check.worse)} larger than recorded, {check.better:,} smaller; worst S / bound "
        f"{check.worst_ratio:.4f} ({check.worst_where}).",
        "",
    ]
    return lines + [f"- LARGER: {w}" for w in check.worse]
