"""Muon in one process: its Newton–Schulz is torch's kernel bit for bit (and on raw row shards is
not), the owner plan balances Newton–Schulz work and keeps whole matrices at home, the planner's
layouts of the reference GPT keep traffic and load near the ideal, and bad input is named. (On
ragged shards at W = 1..4: tests/distributed/test_optim_muon.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

from raggedfsdp.optim import Muon
from raggedfsdp.optim.muon import _newton_schulz, newton_schulz_cost, plan_owners

NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch.optim.Muon's coefficients, steps and eps


def test_newton_schulz_bf16_path_is_torch_kernel() -> None:
    """Our dtype-generic Newton–Schulz, given bf16, is torch's kernel bit for bit."""
    for shape in [(30, 20), (20, 30), (16, 16)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        ours = _newton_schulz(x.bfloat16(), *NS)
        assert torch.equal(ours, _zeropower_via_newtonschulz(x, *NS))


def test_row_shard_newton_schulz_differs_substantially() -> None:
    """Negative control: Newton–Schulz of raw row shards is not Newton–Schulz of the matrix."""
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(2))
    whole = _zeropower_via_newtonschulz(x, *NS).float()
    for world in (2, 4):
        shards = torch.cat([_zeropower_via_newtonschulz(s, *NS) for s in x.chunk(world)]).float()
        relative = ((shards - whole).norm() / whole.norm()).item()
        assert relative > 0.01, (world, relative)


def test_owner_plan_balances_reference_gpt() -> None:
    """Greedy owners over the reference GPT's matrices (d=512, 8 layers): max/mean <= 1.1."""
    shapes = [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 8
    costs = [newton_schulz_cost(*s) for s in shapes]
    ratios = {}
    for world in (2, 4, 7):
        owners = plan_owners(costs, world)
        load = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
        ratios[world] = max(load) / (sum(load) / world)
        assert owners == plan_owners(costs, world)  # deterministic
    print(f"Muon NS load max/mean: {ratios}")
    assert ratios[2] <= 1.1 and ratios[4] <= 1.1
    assert ratios[7] <= 4 / 3  # LPT's bound; 32 coarse matrices on 7 ranks cannot be even


def test_owner_plan_keeps_whole_matrices_at_home() -> None:
    owners = plan_owners([10, 50, 5, 40], 3, holders=[2, None, 2, None])
    assert owners[0] == 2 and owners[2] == 2
    assert owners[1] == 0 and owners[3] == 1  # largest first to the least loaded, ties by rank
    with pytest.raises(ValueError, match="holders"):
        plan_owners([1, 2], 2, holders=[None])


def test_non_matrix_parameter_without_adamw_rule_is_named() -> None:
    weight, bias = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"'layer.bias' \(global shape \[4\]\).*adamw_params"):
        Muon([("layer.weight", weight), ("layer.bias", bias)])
    Muon([weight], adamw_params=[bias])  # an explicit list routes it
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([weight], ns_dtype=torch.int32)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([weight], adjust_lr_fn="bogus")
    with pytest.raises(ValueError, match="lr must be >= 0"):
        Muon([weight], lr=-1.0)


def test_reference_gpt_traffic_and_balance_on_planner_layouts() -> None:
    """On the planner's real layouts of the reference GPT: Muon's bytes per rank stay within 1.1x
    of 2(W-1)/W^2*P*2 (bf16) and Newton–Schulz load within 1.1x of the mean (pure logic)."""
    from raggedfsdp.models import GPT, GPT_CONFIGS
    from raggedfsdp.optim.muon import _plan_bucket
    from raggedfsdp.planner import StructAwarePlanner, model_buckets

    model = GPT(GPT_CONFIGS["gpt-ref"], device="meta")
    planner = StructAwarePlanner("muon")
    for world in (2, 4):
        shapes, ranges = [], []
        for bucket in model_buckets(model):
            plan = planner.plan(bucket.params, world)
            for name, entry in plan.entries.items():
                if len(entry.shape) >= 2 and "emb" not in name:
                    shapes.append(torch.Size(entry.shape))
                    ranges.append(plan.layout(name).ranges)
        total = sum(s.numel() for s in shapes)
        plans = [_plan_bucket(shapes, ranges, world, me) for me in range(world)]
        sent = [2 * 2 * sum(p.outgoing_splits) for p in plans]  # gather + scatter, bf16
        assert max(sent) <= 1.1 * 2 * (world - 1) / world**2 * total * 2, (world, sent)
        load = [0] * world
        for matrix in plans[0].matrices:
            load[matrix.owner] += newton_schulz_cost(matrix.rows, matrix.cols)
        assert max(load) <= 1.1 * sum(load) / world, (world, load)
