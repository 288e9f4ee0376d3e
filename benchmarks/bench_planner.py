"""Planner benchmark: plan time and padding on public LLM shapes, against the bound and FSDP2.

For every model, granularity (element, 32-row, 128-row), bucket cap (one bucket per FSDP unit, and
several ``buffer_size`` values) and world size, plan the whole model (median wall time of
``--repeats`` runs, a fresh planner each run so no cache carries over) and report

- our padding beside the padding the planner's provable lower bound forces, and ``S / bound``
  (overall and for the worst bucket);
- FSDP2's padding (``ceil(dim0/W)*W`` rows per parameter) and the policy blocks FSDP2 and FSDP1
  cut on the same shapes (ours cut none);
- per target of the issue: plan time under 0.3 s at W=10000, ``S`` within 1.10x of the bound on
  every bucket, padding under 1% (element, 32-row) / 3% (128-row) wherever the bound allows.

It also times single buckets (``--parts buckets``): for every model, policy (element, 32-row,
128-row, tile, whole) and W in 2, 8, 64, 1024, 16384 the slowest distinct bucket (median of
``--repeats``, a fresh planner each run), a synthetic 2,002-tensor bucket, and the whole
DeepSeek-V3 with separate experts, against the targets of 0.3 s per bucket and 1 s per model.
And it checks the planner against the fixture of shard sizes recorded before the type-count
search (``--parts fixture``, ``tests/planner_fixture.json``): no bucket of any recorded case may
get a larger ``S`` (``--record-fixture PATH`` writes a new one from the current planner).

Usage::

    PYTHONPATH=src python3 benchmarks/bench_planner.py --write-docs docs/planner.md

prints markdown tables and, with ``--write-docs``, replaces the generated sections of that file
(between the ``bench_planner`` and ``bench_planner_buckets`` markers; the prose is kept).
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from generated_docs import write_section
from raggedfsdp import RaggedShard, StructAwarePlanner
from raggedfsdp.capacity.report import WorldReport, plan_report
from raggedfsdp.layout import BlockSize, row_numel
from raggedfsdp.models import build_model
from raggedfsdp.planner import Bucket, ShardPlan, model_buckets

MODELS = (
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "deepseek-v3-671b",
    "gpt-oss-120b",
    "deepseek-v2-lite",
    "gpt-oss-120b-experts",
    "deepseek-v3-671b-experts",
)
WORLDS = (8, 64, 1024, 10000)
GRANULARITIES: dict[str, BlockSize] = {"element": None, "32-row": 32, "128-row": 128}
MIB = 1 << 20
BUFFERS: dict[str, int | None] = {
    "unit": None,
    "4 MiB": 4 * MIB,
    "64 MiB": 64 * MIB,
    "256 MiB": 256 * MIB,
    "1 GiB": 1024 * MIB,
}
#: The issue's targets.
TIME_TARGET_S = 0.3
TIME_TARGET_WORLD = 10000
BOUND_TARGET = 1.10
PADDING_TARGET = {"element": 0.01, "32-row": 0.01, "128-row": 0.03}
#: Single-bucket timing: every policy (tile: 128x128 tiles, 128x64 where a row length is not a
#: multiple of 128) at these W, against these targets.
POLICIES = ("element", "32-row", "128-row", "tile", "whole")
TIMING_WORLDS = (2, 8, 64, 1024, 16384)
BUCKET_TARGET_S = 0.3
MODEL_TARGET_S = 1.0
WHOLE_MODEL = "deepseek-v3-671b-experts"
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "planner_fixture.json"


@dataclass(frozen=True)
class Row:
    model: str
    granularity: str
    buffer: str
    world: WorldReport


def run(
    models: Sequence[str],
    worlds: Sequence[int],
    granularities: Sequence[str],
    buffers: Sequence[str],
    repeats: int,
) -> list[Row]:
    rows = []
    for model in models:
        module = build_model(model, device="meta")
        for gran in granularities:
            for buf in buffers:
                start = time.perf_counter()
                report = plan_report(
                    module,
                    worlds,
                    block_size=GRANULARITIES[gran],
                    buffer_size=BUFFERS[buf],
                    repeats=repeats,
                    model_name=model,
                )
                rows += [Row(model, gran, buf, w) for w in report.worlds]
                print(
                    f"# {model:17s} {gran:8s} {buf:8s} {time.perf_counter() - start:6.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


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


# ---------------------------------------------------------------------------------------------
# Single buckets, the whole separate-expert model, and the fixture of recorded shard sizes.

SYNTHETIC = "synthetic-2002"


def policy_block(policy: str, module: nn.Module | None) -> BlockSize:
    """The block of ``policy``: tiles are 128x128, or 128x64 for a model with a row length that
    is not a multiple of 128 (GPT-OSS's 2880, DeepSeek-V2-Lite's 10944); the planner's units are
    128 rows either way."""
    if policy == "tile":
        rows = [row_numel(p.shape) for p in module.parameters() if p.dim() >= 2] if module else []
        return (128, 128) if all(r % 128 == 0 for r in rows) else (128, 64)
    return {"element": None, "32-row": 32, "128-row": 128, "whole": "whole"}[policy]


def _planner(policy: str, module: nn.Module | None) -> StructAwarePlanner:
    return _planner_of(policy_block(policy, module))


def _planner_of(block: BlockSize) -> StructAwarePlanner:
    return StructAwarePlanner(shard_policy=RaggedShard(block_size=block))


def bucket_signature(planner: StructAwarePlanner, bucket: Bucket) -> str:
    """How the fixture names a bucket: its parameters' shapes and units in model order and its
    planning dtype (the same function as tests/test_planner.py's)."""
    parts = [
        (tuple(p.shape), planner.unit_numel(n, tuple(p.shape))) for n, p in bucket.params.items()
    ]
    return hashlib.sha1(repr((parts, str(bucket.plan_dtype))).encode()).hexdigest()[:12]


def synthetic_bucket() -> dict[str, tuple[int, ...]]:
    """2,002 tensors in one bucket: DeepSeek-V3 attention projections, a norm, and 666
    experts of separate gate, up and down matrices."""
    params: dict[str, tuple[int, ...]] = {
        "q_a": (1536, 7168),
        "q_b": (24576, 1536),
        "kv_a": (576, 7168),
        "norm": (7168,),
    }
    for e in range(666):
        params |= {f"e{e}.gate": (2048, 7168), f"e{e}.up": (2048, 7168), f"e{e}.down": (7168, 2048)}
    return params


def _fresh_plan(block: BlockSize, params: dict, world_size: int, dtype: torch.dtype) -> ShardPlan:
    return _planner_of(block).plan(params, world_size, dtype)


def _fresh_plan_model(block: BlockSize, module: nn.Module, world_size: int) -> list[ShardPlan]:
    return _planner_of(block).plan_model(module, world_size)


def _median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        gc.collect()  # so that no full collection of a 46k-module model lands in a timed run
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@dataclass(frozen=True)
class BucketTime:
    model: str
    policy: str
    world_size: int
    tensors: int  # parameters in the slowest bucket (in the whole model for whole-model rows)
    seconds: float  # plan time of the slowest distinct bucket, or of the whole model (median)
    bound_ratio: float  # the worst S / bound of the model's buckets
    before: float | None  # the same figure for the planner before, from the fixture (one run)


def bucket_times(
    models: Sequence[str], repeats: int, fixture: dict | None
) -> tuple[list[BucketTime], list[BucketTime]]:
    """Per (model, policy, W): the slowest distinct bucket with one bucket per FSDP unit (a
    fresh planner per run, so no cache), plus the synthetic 2,002-tensor bucket; and per
    (policy, W) the whole :data:`WHOLE_MODEL` with ``plan_model``."""
    cases = fixture["cases"] if fixture else {}
    rows, whole = [], []
    for model in [*models, SYNTHETIC]:
        module = None if model == SYNTHETIC else build_model(model, device="meta")
        for policy in POLICIES:
            # The block once, outside the timed runs: the tile block looks at every parameter.
            block = policy_block(policy, module)
            planner = _planner_of(block)
            if module is None:
                buckets = [(synthetic_bucket(), torch.float32)]
            else:
                distinct = {bucket_signature(planner, b): b for b in model_buckets(module)}
                buckets = [(b.params, b.plan_dtype) for b in distinct.values()]
            for w in TIMING_WORLDS:
                slowest, tensors, worst = 0.0, 0, 1.0
                for params, dtype in buckets:
                    seconds, plan = _median_seconds(
                        functools.partial(_fresh_plan, block, params, w, dtype), repeats
                    )
                    assert isinstance(plan, ShardPlan)
                    if plan.lower_bound:
                        worst = max(worst, plan.shard_numel / plan.lower_bound)
                    if seconds >= slowest:
                        slowest, tensors = seconds, len(params)
                before = cases.get(f"{model}|{policy}|unit|{w}", {})
                rows.append(
                    BucketTime(
                        model,
                        policy,
                        w,
                        tensors,
                        slowest,
                        worst,
                        before.get("before_slowest_bucket_seconds"),
                    )
                )
                print(
                    f"# bucket {model:24s} {policy:8s} W={w:<6d} {1000 * slowest:8.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
                if model == WHOLE_MODEL:
                    seconds, plans = _median_seconds(
                        functools.partial(_fresh_plan_model, block, module, w), repeats
                    )
                    assert isinstance(plans, list)
                    ratio = max(
                        (p.shard_numel / p.lower_bound for p in plans if p.lower_bound), default=1.0
                    )
                    count = sum(len(p.entries) for p in plans)
                    whole.append(
                        BucketTime(
                            model, policy, w, count, seconds, ratio, before.get("before_seconds")
                        )
                    )
    return rows, whole


def fixture_keys(models: Sequence[str]) -> list[tuple[str, str, str, int]]:
    """The recorded cases: the benchmark's grid (every granularity and buffer at its W) and the
    single-bucket grid (every policy, one bucket per unit, at :data:`TIMING_WORLDS`)."""
    keys: dict[tuple[str, str, str, int], None] = {}
    for model in models:
        for gran in GRANULARITIES:
            for buf in BUFFERS:
                for w in WORLDS:
                    keys[(model, gran, buf, w)] = None
        for policy in POLICIES:
            for w in TIMING_WORLDS:
                keys[(model, policy, "unit", w)] = None
    return list(keys)


def _case_plans(
    module: nn.Module, policy: str, buffer: str, world_size: int
) -> tuple[StructAwarePlanner, list[Bucket], list[ShardPlan], float]:
    planner = _planner(policy, module)
    buckets = model_buckets(module, buffer_size=BUFFERS[buffer], param_dtype=torch.float32)
    slowest, plans = 0.0, []
    for b in buckets:
        start = time.perf_counter()
        plans.append(planner.plan_bucket(b, world_size))
        slowest = max(slowest, time.perf_counter() - start)
    return planner, buckets, plans, slowest


def record_fixture(path: Path, models: Sequence[str]) -> None:
    """Write the current planner's S per bucket of every case (see tests/planner_fixture.json
    for the format)."""
    cases = {}
    by_model: dict[str, list[tuple[str, str, int]]] = {}
    for model, policy, buffer, w in fixture_keys(models):
        by_model.setdefault(model, []).append((policy, buffer, w))
    for model, keys in by_model.items():
        module = build_model(model, device="meta")
        for policy, buffer, w in keys:
            start = time.perf_counter()
            planner, buckets, plans, slowest = _case_plans(module, policy, buffer, w)
            cases[f"{model}|{policy}|{buffer}|{w}"] = {
                "buckets": len(buckets),
                "total": sum(p.shard_numel for p in plans),
                "shard_numel": {
                    bucket_signature(planner, b): p.shard_numel
                    for b, p in zip(buckets, plans, strict=True)
                },
                "before_seconds": round(time.perf_counter() - start, 4),
                "before_slowest_bucket_seconds": round(slowest, 4),
            }
        print(f"# recorded {model}", file=sys.stderr, flush=True)
    tiles = {m: list(policy_block("tile", build_model(m, device="meta"))) for m in by_model}  # type: ignore[arg-type]
    about = json.loads(FIXTURE.read_text())["about"] if FIXTURE.exists() else ""
    path.write_text(
        json.dumps({"about": about, "tile_blocks": tiles, "cases": cases}, separators=(",", ":"))
        + "\n"
    )


@dataclass(frozen=True)
class FixtureCheck:
    cases: int
    buckets: int  # bucket plans compared
    worse: tuple[str, ...]  # "case bucket: new > recorded"
    better: int  # bucket plans with a smaller S than recorded
    worst_ratio: float  # the largest S / bound over all compared buckets
    worst_where: str
    missing: tuple[str, ...]  # cases of the models asked for that the fixture lacks


def check_fixture(path: Path, models: Sequence[str]) -> FixtureCheck:
    """Plan every recorded case of ``models`` and compare each bucket's S with the record."""
    fixture = json.loads(path.read_text())
    worse, missing = [], []
    cases = compared = better = 0
    worst, where = 1.0, ""
    module_of: dict[str, nn.Module] = {}
    for model, policy, buffer, w in fixture_keys(models):
        key = f"{model}|{policy}|{buffer}|{w}"
        record = fixture["cases"].get(key)
        if record is None:
            missing.append(key)
            continue
        if model not in module_of:
            module_of.clear()  # one model at a time in memory
            module_of[model] = build_model(model, device="meta")
        planner, buckets, plans, _ = _case_plans(module_of[model], policy, buffer, w)
        cases += 1
        if len(buckets) != record["buckets"]:
            worse.append(f"{key}: {len(buckets)} buckets, {record['buckets']} recorded")
            continue
        for b, p in zip(buckets, plans, strict=True):
            recorded = record["shard_numel"][bucket_signature(planner, b)]
            compared += 1
            better += p.shard_numel < recorded
            if p.shard_numel > recorded:
                worse.append(f"{key} {b.name}: {p.shard_numel:,} > {recorded:,}")
            if p.lower_bound and p.shard_numel / p.lower_bound > worst:
                worst, where = p.shard_numel / p.lower_bound, f"{key} {b.name}"
        print(f"# fixture {key}", file=sys.stderr, flush=True)
    return FixtureCheck(cases, compared, tuple(worse), better, worst, where, tuple(missing))


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
            f"- Fixture (S recorded before this search, tests/planner_fixture.json): "
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


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes")
    parser.add_argument(
        "--granularities", default=",".join(GRANULARITIES), help=f"of {list(GRANULARITIES)}"
    )
    parser.add_argument("--buffers", default=",".join(BUFFERS), help=f"of {list(BUFFERS)}")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median time)")
    parser.add_argument(
        "--parts",
        default="main,buckets,fixture",
        help="of main (the whole-model grid), buckets (single-bucket and whole-model timing), "
        "fixture (no S larger than recorded)",
    )
    parser.add_argument("--fixture", type=Path, default=FIXTURE, help="recorded shard sizes")
    parser.add_argument(
        "--record-fixture",
        type=Path,
        metavar="PATH",
        help="write the current S per case, then exit",
    )
    parser.add_argument("--write-docs", type=Path, metavar="PATH", help="e.g. docs/planner.md")
    args = parser.parse_args(argv)
    buffers = _csv(args.buffers)
    parts = _csv(args.parts)
    for name, chosen, known in (
        ("granularities", _csv(args.granularities), GRANULARITIES),
        ("buffers", buffers, BUFFERS),
        ("parts", parts, ("main", "buckets", "fixture")),
    ):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; expected some of {list(known)}")
    models = _csv(args.models)
    if args.record_fixture:
        record_fixture(args.record_fixture, models)
        print(f"# wrote {args.record_fixture}", file=sys.stderr)
        return 0
    command = "PYTHONPATH=src python3 benchmarks/bench_planner.py " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    failed = False
    sections = []
    if "main" in parts:
        rows = run(
            models,
            [int(w) for w in _csv(args.worlds)],
            _csv(args.granularities),
            buffers,
            args.repeats,
        )
        sections.append(("bench_planner", markdown(rows, buffers, command.rstrip(), args.repeats)))
    check = None
    if "fixture" in parts:
        check = check_fixture(args.fixture, models)
        failed = bool(check.worse)
    if "buckets" in parts or check is not None:
        fixture = json.loads(args.fixture.read_text()) if args.fixture.exists() else None
        rows_b, whole = (
            bucket_times(models, args.repeats, fixture) if "buckets" in parts else ([], [])
        )
        text = bucket_markdown(rows_b, whole, check) if rows_b else _fixture_lines(check)
        env = (
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs ({platform.machine()}), median of {args.repeats} runs"
        )
        head = ["", "Produced by:", "", "```", command.rstrip(), "```", "", f"on {env}.", ""]
        sections.append(("bench_planner_buckets", "\n".join([*head, *text])))
    for name, section in sections:
        print(section)
        if args.write_docs:
            write_section(args.write_docs, name, section, script="bench_planner")
    if args.write_docs:
        print(f"# wrote {args.write_docs}", file=sys.stderr)
    return 1 if failed else 0


def _fixture_lines(check: FixtureCheck | None) -> list[str]:
    if check is None:
        return []
    lines = [
        f"Fixture: {check.cases} cases, {check.buckets:,} bucket plans compared, "
        f"{len(check.worse)} larger than recorded, {check.better:,} smaller; worst S / bound "
        f"{check.worst_ratio:.4f} ({check.worst_where}).",
        "",
    ]
    return lines + [f"- LARGER: {w}" for w in check.worse]


if __name__ == "__main__":
    raise SystemExit(main())
