"""What the planner benchmark plans: the models, granularities, bucket caps, world sizes and
policies of its grids, the issue's targets, the synthetic 2,002-tensor bucket, and how the
fixture of recorded shard sizes names its cases and buckets."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from raggedfsdp import RaggedShard, StructAwarePlanner
from raggedfsdp.layout import BlockSize, row_numel
from raggedfsdp.planner import Bucket

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
#: The shard sizes recorded before the type-count search (``--parts fixture``).
FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "support" / "planner_fixture.json"
#: The name of the synthetic 2,002-tensor bucket in the single-bucket tables.
SYNTHETIC = "synthetic-2002"


def policy_block(policy: str, module: nn.Module | None) -> BlockSize:
    """The block of ``policy``: tiles are 128x128, or 128x64 for a model with a row length that
    is not a multiple of 128 (GPT-OSS's 2880, DeepSeek-V2-Lite's 10944); the planner's units are
    128 rows either way."""
    if policy == "tile":
        rows = [row_numel(p.shape) for p in module.parameters() if p.dim() >= 2] if module else []
        return (128, 128) if all(r % 128 == 0 for r in rows) else (128, 64)
    return {"element": None, "32-row": 32, "128-row": 128, "whole": "whole"}[policy]


def planner_of(block: BlockSize) -> StructAwarePlanner:
    return StructAwarePlanner(shard_policy=RaggedShard(block_size=block))


def bucket_signature(planner: StructAwarePlanner, bucket: Bucket) -> str:
    """How the fixture names a bucket: its parameters' shapes and units in model order and its
    planning dtype (the same function as tests/unit/test_planner.py's)."""
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
