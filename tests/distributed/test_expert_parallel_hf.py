"""Expert parallelism on the Hugging Face MoEs (tiny-mixtral, tiny-qwen2-moe): one launch of 4
Gloo ranks, each a different slice of the global batch, against one process running the
unmodified HF model on the whole batch -- the mean loss, the full gradients of the experts and
of the router after one backward, and the parameters after two AdamW steps:

- ``ep4``: the experts split over ep=4 (one expert per rank), nothing else sharded: the test
  averages the dense gradients over the ranks and divides the experts' by 4 (their gradient
  already sums the four ranks' tokens, which came to them by all-to-all);
- ``dp2_ep2``: a (dp=2, ep=2) mesh, the experts split over ep then ``rf.fully_shard`` over dp,
  each decoder layer and the root over dp and ep flattened (torchtitan's layout, as in
  test_expert_parallel.py): raggedfsdp averages every gradient over the 4 data ranks itself;
  ``dp2_ep2_copy`` the same with FSDP2's copy of the gathered parameters (``zero_copy=False``).
  Both gather the experts again in backward, into the buffers whose views forward read.

Tolerance 1e-5 (fp32): absolute for the loss and the trained weights (AdamW at lr 1e-3), and
for the gradients relative to the largest one (about 3e-3). Measured: loss 5e-7, gradients 3e-7
relative, trained weights 1.5e-6. Negative controls, on ep=4: the tokens computed by the experts
of the next rank (the right local index, the wrong expert), and no exchange at all (each rank's
experts on its own tokens only, the others' contributions lost): gradients off by about their
own size, trained weights by 4e-3 (a whole AdamW step each).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import raggedfsdp as rf
from harness import run_distributed
from raggedfsdp.models import expert_parallel

pytest.importorskip("transformers")

WORLD = 4
MODELS = ("tiny-mixtral", "tiny-qwen2-moe")
ROWS, SEQ = 2, 16  # per rank: the global batch is WORLD * ROWS sequences of SEQ tokens
STEPS = 2
TOLERANCE = 1e-5
#: The parameters compared: the experts' stacked weights and the routers'.
WATCHED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (WORLD * ROWS, SEQ + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _watched(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if k.endswith(WATCHED)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train(
    model: nn.Module, data_rank: int | None, sync: Callable[[nn.Module], None] | None = None
) -> dict[str, Any]:
    """The loss and full gradients of the first step and the parameters after ``STEPS`` AdamW
    steps. ``data_rank``: this rank's slice of each global batch (None: all of it); ``sync``:
    what makes the local gradients those of the global mean loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out: dict[str, Any] = {}
    for x, y in _batches():
        if data_rank is not None:
            rows = slice(data_rank * ROWS, (data_rank + 1) * ROWS)
            x, y = x[rows], y[rows]
        loss = model(x, y)
        loss.backward()
        if sync is not None:
            sync(model)
        if not out:
            out["loss"] = _global_mean(loss.detach()) if data_rank is not None else loss.item()
            out["grads"] = _watched({n: _whole(p.grad) for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    full = StateDictOptions(full_state_dict=True)
    out["trained"] = _watched(get_model_state_dict(model, options=full))
    return out


def _global_mean(loss: torch.Tensor) -> float:
    """The mean of the ranks' losses: the loss of the global batch (equal slices)."""
    dist.all_reduce(loss)
    return loss.item() / WORLD


def _ep_grads(model: nn.Module) -> None:
    """EP alone: the dense gradients averaged over the ranks; the experts' divided by the ranks
    (each already holds every rank's tokens' contribution to its own experts)."""
    for param in model.parameters():
        if isinstance(param.grad, DTensor):
            param.grad.div_(WORLD)
        else:
            dist.all_reduce(param.grad)
            param.grad.div_(WORLD)


def _ep4(base: nn.Module) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    model = copy.deepcopy(base)
    expert_parallel.parallelize_experts(model, mesh)
    return _train(model, mesh.get_local_rank(), _ep_grads)


def _dp2_ep2(base: nn.Module, config: rf.DBufferConfig | None = None) -> dict[str, Any]:
    from raggedfsdp.models.hf import decoder_layers

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dense = mesh["dp", "ep"]._flatten("dp_ep")
    model = copy.deepcopy(base)
    for experts in expert_parallel.parallelize_experts(model, mesh["ep"]):
        rf.fully_shard(experts, mesh=mesh["dp"], dbuffer_config=config)
    for layer in decoder_layers(model):
        rf.fully_shard(layer, mesh=dense, dbuffer_config=config)
    rf.fully_shard(model, mesh=dense, dbuffer_config=config)
    return _train(model, dense.get_local_rank())


#: ``expert_parallel._dispatch(module, tokens, counts)``.
Dispatch = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]


@contextmanager
def _patched_dispatch(
    wrong: Callable[[Dispatch, Any, torch.Tensor, torch.Tensor], torch.Tensor],
) -> Iterator[None]:
    """``expert_parallel._dispatch`` replaced by ``wrong(dispatch, module, tokens, counts)``."""
    dispatch = expert_parallel._dispatch
    expert_parallel._dispatch = lambda *args: wrong(dispatch, *args)  # type: ignore[assignment]
    try:
        yield
    finally:
        expert_parallel._dispatch = dispatch


def _next_rank(
    dispatch: Dispatch, module: Any, tokens: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Each token to the rank after the one holding its expert: the same local expert index,
    the wrong expert."""
    ep = module.ep_mesh.size()
    sizes = counts.view(ep, -1).sum(1).tolist()
    chunks = tokens.split(sizes)
    shifted = torch.cat([chunks[(j - 1) % ep] for j in range(ep)])
    moved = counts.view(ep, -1).roll(1, 0).reshape(-1)
    results = dispatch(module, shifted, moved).split(moved.view(ep, -1).sum(1).tolist())
    return torch.cat([results[(j + 1) % ep] for j in range(ep)])


def _no_exchange(
    dispatch: Dispatch, module: Any, tokens: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Only this rank's experts, on its own tokens; the rest left at zero (no all-to-all)."""
    ep, rank = module.ep_mesh.size(), module.ep_mesh.get_local_rank()
    sizes = counts.view(ep, -1).sum(1).tolist()
    start = sum(sizes[:rank])
    mine = tokens[start : start + sizes[rank]]
    done = expert_parallel._local_experts(module, mine, counts.view(ep, -1)[rank].tolist())
    return torch.cat([tokens[:start] * 0, done, tokens[start + sizes[rank] :] * 0])


def _grid(rank: int, world: int) -> dict[str, Any]:
    from raggedfsdp.models.hf import build_hf_model

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in MODELS:
        torch.manual_seed(0)  # the same weights on every rank
        base = build_hf_model(name, "cpu")
        # One process, HF's own model and experts implementation, the whole batch; rank 0 only.
        runs = {"reference": _train(copy.deepcopy(base), None)} if rank == 0 else {}
        runs["ep4"] = _ep4(base)
        runs["dp2_ep2"] = _dp2_ep2(base)
        runs["dp2_ep2_copy"] = _dp2_ep2(base, rf.DBufferConfig(zero_copy=False))
        for control in (_next_rank, _no_exchange):
            with _patched_dispatch(control):
                runs[control.__name__] = _ep4(base)
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(_grid, WORLD)


def _errors(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """The largest differences: of the loss and the trained weights (absolute), and of the
    gradients, relative to the largest gradient (about 3e-3 here, 0 for an expert no token
    chose)."""
    out = {"loss": abs(got["loss"] - want["loss"])}
    for kind in ("grads", "trained"):
        assert got[kind].keys() == want[kind].keys()
        out[kind] = max((got[kind][k] - v).abs().max().item() for k, v in want[kind].items())
    out["grads"] /= max(v.abs().max().item() for v in want["grads"].values())
    return out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", ["ep4", "dp2_ep2", "dp2_ep2_copy"])
def test_expert_parallel_computes_the_numbers_of_one_process(grid, name, layout):
    reference = grid[0][name]["reference"]
    assert len(reference["grads"]) == len(reference["trained"]) == 3 * 2  # 3 weights, 2 layers
    for rank, result in enumerate(grid):
        errors = _errors(result[name][layout], reference)
        print(f"{name} {layout} rank {rank}: {errors}")
        assert max(errors.values()) < TOLERANCE, (rank, errors)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("control", ["_next_rank", "_no_exchange"])
def test_a_wrong_dispatch_is_far_from_one_process(grid, name, control):
    reference = grid[0][name]["reference"]
    for rank, result in enumerate(grid):
        errors = _errors(result[name][control], reference)
        print(f"{name} {control} rank {rank}: {errors}")
        assert errors["grads"] > 100 * TOLERANCE and errors["trained"] > 100 * TOLERANCE
