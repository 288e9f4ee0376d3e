"""torch's own norm utilities over rf.fully_shard-ed gradients (RaggedTensor DTensors): the
global norms, equal on every rank, whatever path torch takes (foreach or not, any order), the
same clipping as ``rf.clip_grad_norm_``, and what FSDP2 returns on the same model in the same
launch (DTensors whose value is the global norm). One Gloo launch of 3 ranks (some hold no piece
of a parameter); the tests judge its collected results.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import raggedfsdp as rf
from harness import run_distributed
from parity_models import OddModel, make_batches

WORLD = 3
NORMS = (2.0, 1.0, 3.0, math.inf)


def _value(x: torch.Tensor) -> float:
    return float(x.full_tensor() if isinstance(x, DTensor) else x)


def _backward(model: torch.nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    idx, targets = make_batches(1, 2 * world)[0]
    model(idx[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    return [p for p in model.parameters() if p.grad is not None]


def _run(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = OddModel()
    model = copy.deepcopy(base)
    for block in model.blocks:
        rf.fully_shard(block)
    rf.fully_shard(model)
    params = _backward(model, rank, world)
    grads = [p.grad for p in params]
    out: dict[str, Any] = {"types": sorted({type(g).__name__ for g in grads})}
    for norm_type in NORMS:
        reference = rf.clip_grad_norm_(params, math.inf, norm_type)  # no clip
        for foreach in (None, True, False):
            total = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
            out[(norm_type, foreach)] = (_value(total), float(reference), type(total).__name__)
    two = float(rf.clip_grad_norm_(params, math.inf))
    out["stack"] = (_value(torch.stack([g.norm() for g in grads]).norm()), two)
    out["sum"] = (_value(sum(g.norm() ** 2 for g in grads) ** 0.5), two)
    out["local"] = float(torch.stack([g.to_local().norm() for g in grads]).norm())
    expected = [g.to_local().detach().clone() * min(1.0, 0.5 / (two + 1e-6)) for g in grads]
    returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    out["clip"] = (_value(returned), two, type(returned).__name__)
    out["clipped_equal"] = all(
        torch.allclose(g.to_local(), e, rtol=1e-6, atol=0)
        for g, e in zip(grads, expected, strict=True)
    )
    # FSDP2 on the same model and batch, in the same launch: torch's clip there returns a
    # DTensor too, of the same value.
    fsdp2 = copy.deepcopy(base)
    for block in fsdp2.blocks:
        fsdp2_fully_shard(block)
    fsdp2_fully_shard(fsdp2)
    fsdp2_params = _backward(fsdp2, rank, world)
    fsdp2_total = torch.nn.utils.clip_grad_norm_(fsdp2_params, math.inf)
    out["fsdp2"] = (_value(fsdp2_total), type(fsdp2_total).__name__)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_get_total_norm_is_global(results, norm_type, foreach):
    for rank in results:
        total, reference, kind = rank[(norm_type, foreach)]
        assert kind == "DTensor"  # as FSDP2's: reduced when read, never a local value
        assert math.isclose(total, reference, rel_tol=1e-6), (rank, total, reference)
    assert len({r[(norm_type, foreach)][0] for r in results}) == 1  # bitwise equal on all ranks


def test_other_ways_to_write_the_norm(results):
    for rank in results:
        assert rank["types"] == ["RaggedTensor"]
        for key in ("stack", "sum"):
            assert math.isclose(*rank[key], rel_tol=1e-6), (key, rank[key])
        assert math.isclose(rank["clip"][0], rank["clip"][1], rel_tol=1e-6)
        assert rank["clipped_equal"]


def test_same_norm_and_type_as_fsdp2(results):
    for rank in results:
        value, kind = rank["fsdp2"]
        assert kind == rank["clip"][2] == "DTensor"
        assert math.isclose(value, rank["clip"][1], rel_tol=1e-5), (value, rank["clip"])


def test_negative_control_local_norms_differ(results):
    """Norms of the local pieces alone differ from rank to rank: what each would clip by."""
    local = [r["local"] for r in results]
    assert len(set(local)) == WORLD and all(v < results[0]["clip"][1] for v in local)
