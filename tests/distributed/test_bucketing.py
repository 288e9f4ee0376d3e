"""One bucketing for plan, dry run and runtime: what ``plan_model`` plans is what
``FSDPBackend`` builds, and ranks that planned differently are told where.

One launch of 4 ranks runs every case at each world size W = 1..4, as if launched on W ranks
(harness.run_world_grid, ``as_launches``); the tests judge the collected results."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import raggedfsdp as rf
from harness import world_grid_fixture

POLICIES = (None, 4, (4, 4), "whole")
OPTIMIZERS = (None, "muon", "shampoo", "adamw8bit")
PARAM_DTYPES = (None, torch.bfloat16)
BUFFER_SIZES = (None, 256, 1 << 20)  # one bucket per unit; one per parameter or so; large


class Block(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(12, 12)
        self.mlp = nn.Linear(12, 24, bias=False)
        self.norm = nn.LayerNorm(24)
        self.mlp.weight.requires_grad_(not frozen)  # a frozen matrix in some blocks


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 12)
        self.blocks = nn.ModuleList(Block(frozen=i == 1) for i in range(3))
        self.head = nn.Linear(12, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two names
        self.scale = nn.Parameter(torch.ones(()))


def _planner(policy, optimizer) -> rf.StructAwarePlanner:
    options = {"max_preconditioner_dim": 4} if optimizer == "shampoo" else {}
    return rf.StructAwarePlanner(optimizer, rf.RaggedShard(block_size=policy), **options)


def _grid_on_rank(rank: int, world: int) -> list[dict]:
    """For every case: the plans ``plan_model`` makes and those the runtime built."""
    out = []
    for policy, optimizer, param_dtype, buffer_size in itertools.product(
        POLICIES, OPTIMIZERS, PARAM_DTYPES, BUFFER_SIZES
    ):
        torch.manual_seed(0)
        planned = _planner(policy, optimizer).plan_model(
            Model(), world, buffer_size=buffer_size, dtype=param_dtype
        )
        # The earlier bucketing measured buffer_size in the master dtype: a negative control.
        by_master_bytes = _planner(policy, optimizer).plan_model(
            Model(), world, buffer_size=buffer_size
        )
        model = rf.FSDPBackend(
            Model(),
            planner=_planner(policy, optimizer),
            mp_policy=rf.MixedPrecisionPolicy(param_dtype=param_dtype),
            dbuffer_config=rf.DBufferConfig(buffer_size=buffer_size),
        )
        built = model.shard_plans()
        out.append(
            {
                "case": (str(policy), optimizer, str(param_dtype), buffer_size),
                "planned": [(p.name, p.digest()) for p in planned],
                "built": [(p.name, p.digest()) for p in built],
                "master_bytes": [(p.name, p.digest()) for p in by_master_bytes],
            }
        )
    return out


def _cases(rank: int, world: int, group: None) -> dict[str, list[dict] | str]:
    """Every case at this world size; at W = 2, a rank that planned differently too."""
    out: dict[str, list[dict] | str] = {"grid": _grid_on_rank(rank, world)}
    if world == 2:
        out["disagreeing"] = _disagreeing_rank(rank, world)
    return out


grid = world_grid_fixture(_cases, [1, 2, 3, 4], as_launches=True, timeout=600)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_model_is_what_the_runtime_builds(grid, world: int) -> None:
    per_rank = [result["grid"] for result in grid[world]]
    cases = per_rank[0]
    assert len(cases) == len(POLICIES) * len(OPTIMIZERS) * len(PARAM_DTYPES) * len(BUFFER_SIZES)
    for case in cases:
        assert case["built"] == case["planned"], case["case"]
        assert len(case["built"]) >= 5, case["case"]  # blocks, a frozen bucket, the root
    names = [name for name, _ in cases[0]["built"]]
    assert names[:4] == [
        "blocks.0/float32/0",
        "blocks.1/float32/0",
        "blocks.1/float32/frozen/0",
        "blocks.2/float32/0",
    ]
    assert names[-1] == "<root>/float32/0"
    # Under bf16 with a small buffer, splitting by master-dtype bytes gives other buckets.
    control = [c for c in cases if c["case"][2:] == ("torch.bfloat16", 256)]
    assert control and all(c["master_bytes"] != c["built"] for c in control)
    for other in per_rank[1:]:  # every rank planned the same
        assert [c["built"] for c in other] == [c["built"] for c in cases]


def _disagreeing_rank(rank: int, world: int) -> str:
    """Rank 1 shards with another policy: the check before the first all-gather names it."""
    policy = rf.RaggedShard(block_size=4 if rank == 0 else None)
    model = rf.FSDPBackend(Model(), shard_policy=policy)
    try:
        model.unshard()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_ranks_that_planned_differently_are_told_where(grid) -> None:
    messages = [result["disagreeing"] for result in grid[2]]
    assert messages[0] == messages[1]
    assert "ranks planned different buckets: bucket 'blocks.0/float32/0'" in messages[0]
    assert "on rank 0 and" in messages[0] and "on rank 1" in messages[0]


def test_wrap_must_be_a_predicate() -> None:
    """A function returning the units (the earlier ``plan_model(wrap=...)``) is refused, not
    taken as "every module is a unit"."""
    planner = rf.StructAwarePlanner()
    assert len(planner.plan_model(Model(), 2, wrap=lambda m: isinstance(m, Block))) == 5
    with pytest.raises(TypeError, match="wrap must return True or False for each module"):
        planner.plan_model(Model(), 2, wrap=lambda m: [("", m)])
