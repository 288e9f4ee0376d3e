"""Each optimizer on the real runtime: a GPT wrapped by FSDPBackend with the matching planner
steps exactly as an unwrapped copy stepped by the same optimizer on the full gradients."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import raggedfsdp as rf
from harness import run_distributed
from optim_grid import structured_optimizer, structured_planner
from raggedfsdp.models import GPT, GPT_CONFIGS

CFG = GPT_CONFIGS["gpt-tiny"]
AUX = ("tok_emb.weight", "pos_emb.weight")


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return structured_optimizer(kind, model, lambda name: name in AUX, 1024)


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every sharded gradient gathered whole (test-only: all_gather_object of the pieces)."""
    out = {}
    for name, p in model.named_parameters():
        info = rf.shard_info(p)
        pieces: list = [None] * info.layout.world_size
        dist.all_gather_object(pieces, p.grad.to_local().detach().clone())
        out[name] = info.layout.from_locals(pieces)
    return out


def _run(rank: int, world: int) -> dict[str, float]:
    results = {}
    for kind in ("adamw", "muon", "shampoo", "adamw8bit"):
        torch.manual_seed(0)
        reference = GPT(CFG)
        model = copy.deepcopy(reference)
        rf.FSDPBackend(model, planner=structured_planner(kind))
        opt, ref_opt = _optimizer(kind, model), _optimizer(kind, reference)
        ref_params = dict(reference.named_parameters())
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            idx = torch.randint(0, CFG.vocab_size, (2 * world, 16), generator=g)
            x, y = idx[2 * rank : 2 * rank + 2, :-1], idx[2 * rank : 2 * rank + 2, 1:]
            opt.zero_grad()
            model(x, y).backward()
            for name, grad in _full_grads(model).items():
                ref_params[name].grad = grad
            opt.step()
            ref_opt.step()
        full = rf.full_state_dict(model)
        want = reference.state_dict()
        results[kind] = max((full[k] - want[k]).abs().max().item() for k in want)
    return results


def test_optimizers_on_the_runtime_match_single_device_bitwise():
    for results in run_distributed(_run, 3):
        assert results == {"adamw": 0.0, "muon": 0.0, "shampoo": 0.0, "adamw8bit": 0.0}
