"""How the planner benchmark runs: whole models planned per granularity, bucket cap and world
size; single buckets and the whole separate-expert model timed; the fixture of shard sizes
recorded and checked."""

from __future__ import annotations

import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raggedfsdp import StructAwarePlanner
from raggedfsdp.capacity.report import WorldReport, plan_report
from raggedfsdp.layout import BlockSize
from raggedfsdp.models import build_model
from raggedfsdp.planner import Bucket, ShardPlan, model_buckets

from .scenarios import (
    BUFFERS,
    FIXTURE,
    GRANULARITIES,
    POLICIES,
    SYNTHETIC,
    TIMING_WORLDS,
    WHOLE_MODEL,
    bucket_signature,
    fixture_keys,
    planner_of,
    policy_block,
    synthetic_bucket,
)


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


def _fresh_plan(block: BlockSize, params: dict, world_size: int, dtype: torch.dtype) -> ShardPlan:
    return planner_of(block).plan(params, world_size, dtype)


def _fresh_plan_model(block: BlockSize, module: nn.Module, world_size: int) -> list[ShardPlan]:
    return planner_of(block).plan_model(module, world_size)


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
            planner = planner_of(block)
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


def _case_plans(
    module: nn.Module, policy: str, buffer: str, world_size: int
) -> tuple[StructAwarePlanner, list[Bucket], list[ShardPlan], float]:
    planner = planner_of(policy_block(policy, module))
    buckets = model_buckets(module, buffer_size=BUFFERS[buffer], param_dtype=torch.float32)
    slowest, plans = 0.0, []
    for b in buckets:
        start = time.perf_counter()
        plans.append(planner.plan_bucket(b, world_size))
        slowest = max(slowest, time.perf_counter() - start)
    return planner, buckets, plans, slowest


def record_fixture(path: Path, models: Sequence[str]) -> None:
    """Write the current planner's S per bucket of every case (see
    tests/support/planner_fixture.json for the format)."""
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
