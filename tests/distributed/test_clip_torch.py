"""torch's own norm utilities over rf.fully_shard-ed gradients (``ShardedGrad``): the global
norms, equal on every rank, whatever path torch takes (foreach or not, any order), and the same
clipping as ``rf.clip_grad_norm_``. One Gloo launch of 3 ranks (some hold no piece of a
parameter); the tests judge its collected results.
"""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import raggedfsdp as rf
from harness import run_distributed
from parity_models import OddModel, make_batches
from raggedfsdp.runtime._sharded_grad import ShardedGrad, as_sharded_grad

WORLD = 3
NORMS = (2.0, 1.0, 3.0, math.inf)


def _run(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = OddModel()
    for block in model.blocks:
        rf.fully_shard(block)
    rf.fully_shard(model)
    idx, targets = make_batches(1, 2 * world)[0]
    model(idx[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    out: dict[str, Any] = {"local": [], "types": sorted({type(g).__name__ for g in grads})}
    for norm_type in NORMS:
        reference = rf.clip_grad_norm_(params, math.inf, norm_type)  # reads ShardInfo, no clip
        for foreach in (None, True, False):
            total = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
            out[(norm_type, foreach)] = (float(total), float(reference), type(total).__name__)
    two = float(rf.clip_grad_norm_(params, math.inf))
    out["stack"] = (float(torch.stack([g.norm() for g in grads]).norm()), two)
    out["sum"] = (float(sum(g.norm() ** 2 for g in grads) ** 0.5), two)
    out["data"] = (float(sum(p.grad.data.norm(2) ** 2 for p in params) ** 0.5), two)
    out["local"] = float(torch.stack([g.as_subclass(torch.Tensor).norm() for g in grads]).norm())
    expected = [g.detach().clone() * min(1.0, 0.5 / (two + 1e-6)) for g in grads]
    calls: list[int] = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: (calls.append(1), all_reduce(*args, **kwargs))[1]
    try:
        returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    finally:
        dist.all_reduce = all_reduce
    out["all_reduces"] = len(calls)
    out["clip"] = (float(returned), two)
    out["clipped_equal"] = all(
        torch.allclose(g, e, rtol=1e-6, atol=0) for g, e in zip(grads, expected, strict=True)
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_get_total_norm_is_global(results, norm_type, foreach):
    for rank in results:
        total, reference, kind = rank[(norm_type, foreach)]
        assert kind == "Tensor"  # a plain tensor: nothing partial leaks out
        assert math.isclose(total, reference, rel_tol=1e-6), (rank, total, reference)
    assert len({r[(norm_type, foreach)][0] for r in results}) == 1  # bitwise equal on all ranks


def test_other_ways_to_write_the_norm(results):
    for rank in results:
        assert rank["types"] == ["ShardedGrad"]
        for key in ("stack", "sum", "data", "clip"):
            assert math.isclose(*rank[key], rel_tol=1e-6), (key, rank[key])
        assert rank["clipped_equal"]
        assert rank["all_reduces"] == 1  # the clip's only collective, not one per gradient


def test_negative_control_local_norms_differ(results):
    """Without ShardedGrad each rank would see only its pieces: the norms it would clip by."""
    local = [r["local"] for r in results]
    assert len(set(local)) == WORLD and all(v < results[0]["clip"][1] for v in local)


def test_sharded_grad_is_a_plain_tensor_but_for_norms_and_aliases():
    """No process group needed: only norms communicate."""
    grad = as_sharded_grad(torch.arange(4.0), None)
    assert type(grad * 2) is torch.Tensor and type(torch.zeros_like(grad)) is torch.Tensor
    assert type(grad.data) is ShardedGrad and type(grad.detach()) is ShardedGrad
    copied = copy.deepcopy(grad)
    assert type(copied) is ShardedGrad and torch.equal(copied, grad)
    assert copied.data_ptr() != grad.data_ptr()
    buffer = io.BytesIO()
    torch.save(grad, buffer)  # a process group cannot be pickled: saved as the plain piece
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, torch.arange(4.0))
