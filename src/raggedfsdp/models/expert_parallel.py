"""Expert parallelism for the Hugging Face mixtures of experts (torchtitan's ExpertParallel).

:func:`parallelize_experts` splits each experts module (transformers 5's stacked experts) over a 1-D
``ep`` mesh and sends every (token, expert) pair to the rank holding that expert and back by
``all_to_all_single``; the router and anything beside the experts stay HF's own code, and the
experts compute HF's eager per-expert math. How, and why the module's class is extended: the comment
at :func:`parallelize_experts`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["check_expert_parallel", "exchange_rows", "expert_modules", "parallelize_experts"]

#: The stacked weights of an experts module, each ``[experts, ...]``: the ones split over ep.
_WEIGHTS = ("gate_up_proj", "down_proj")
#: The arguments of an HF experts forward, after ``self``.
_SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")
#: ``use_experts_implementation``'s layout flags, at the values of the layout computed here (a
#: transposed, biased, ungated, interleaved or post-normed stack is another computation).
_LAYOUT_FLAGS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}
#: transformers' own gate, ``act_fn(gate) * up``; a class of its own gate (gpt-oss's clamped
#: SwiGLU, for one) names it otherwise.
_DEFAULT_GATE = "_default_apply_gate"


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every experts module of ``model`` (the module holding the stacked 3-D
    expert weights), in model order; ``[]`` for a model without experts (a GPT, a Llama).

    An experts module is one that holds a 3-D parameter of its own (a convolution's weight
    aside), or any module named ``experts`` (a list of per-expert MLPs, say), so that a layout
    this module does not know is found, and refused by :func:`check_expert_parallel`, rather
    than taken for a dense model."""
    return [(name, module) for name, module in model.named_modules() if _is_experts(name, module)]


def _is_experts(name: str, module: nn.Module) -> bool:
    if isinstance(module, _ExpertParallel):
        return True
    if isinstance(module, nn.modules.conv._ConvNd):  # [out, in, kernel]: 3-D, not experts
        return False
    if any(param.dim() == 3 for param in module.parameters(recurse=False)):
        return True
    return name.rsplit(".", 1)[-1] == "experts"


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """``ValueError``, naming the model or the module at fault, unless ``ep`` groups of experts
    can split ``model``: it has experts, each experts module has HF's stacked structure (the
    one :func:`parallelize_experts` computes) and a number of experts divisible by ``ep``.
    Reads shapes and classes only: works on a meta-device model, before any collective."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert parallelism: ep must be a positive integer, got {ep!r}")
    found = expert_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no experts (no module holds stacked [experts, ...] "
            f"weights): a model without experts cannot take --ep"
        )
    for name, module in found:
        where = f"{type(model).__name__}: experts module {name!r} ({type(module).__name__})"
        problem = _structure_problem(module)
        if problem is not None:
            raise ValueError(
                f"{where} {problem}; expert parallelism knows transformers' stacked experts: "
                f"gate_up_proj [E, 2I, d], down_proj [E, d, I], act_fn(gate) * up, called as "
                f"forward{_SIGNATURE}"
            )
        experts = module.gate_up_proj.shape[0]
        if experts % ep:
            raise ValueError(
                f"{where} holds {experts} experts, which {ep} expert-parallel ranks cannot "
                f"split evenly: take an ep that divides {experts}"
            )


def _structure_problem(module: nn.Module) -> str | None:
    """What in ``module`` differs from HF's stacked experts, or None."""
    if isinstance(module, _ExpertParallel):
        return "is already split by expert parallelism"
    names = sorted(name for name, _ in module.named_parameters())
    if names != sorted(_WEIGHTS):
        return f"holds the parameters {names}"
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"has weights of {gate_up.dim()} and {down.dim()} dims"
    experts, double, width = gate_up.shape
    if tuple(down.shape) != (experts, width, double // 2) or double % 2:
        return (
            f"has gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)}, not "
            f"[E, 2I, d] and [E, d, I]"
        )
    if getattr(module, "num_experts", experts) != experts:
        return f"counts num_experts={module.num_experts} beside {experts} stacked experts"
    for flag, value in _LAYOUT_FLAGS.items():
        if getattr(module, flag, value) != value:
            return f"sets {flag}={getattr(module, flag)!r}"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", None) != _DEFAULT_GATE:
        return f"gates by a _apply_gate of its own ({gate.__qualname__})"
    if not callable(getattr(module, "act_fn", None)):
        return "has no act_fn"
    arguments = tuple(inspect.signature(type(module).forward).parameters)[1:]
    if arguments != _SIGNATURE:
        return f"is called as forward{arguments}"
    return None


# transformers 5 keeps a MoE layer's experts stacked in one *experts module*: ``gate_up_proj [E, 2I,
# d]`` (each expert's gate and up projections, concatenated), ``down_proj [E, d, I]`` and
# ``act_fn``, called as ``experts(hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k])``
# after the layer's own router chose each token's ``k`` experts (Mixtral, Qwen2-MoE, and most MoEs
# of the library: their eager forwards are the same code). :func:`parallelize_experts` splits each
# such module over the ranks of a 1-D ``ep`` mesh: rank ``r`` keeps experts ``[r E/ep, (r+1) E/ep)``
# as DTensors ``Shard(0)``, and the module's forward sends every (token, expert) pair to the rank
# holding that expert and brings the result back, by ``all_to_all_single`` over the ep group (both
# directions differentiable). The router, the top-k choice, the weighting by the router's scores and
# anything beside the experts (Qwen2-MoE's shared expert) stay HF's own code; the experts compute
# exactly HF's eager per-expert math, on this rank's experts only.
#
# Every experts module is entered by every rank of the ep group once per forward, in model order,
# whatever tokens it got: the exchanges are collectives, and a count of 0 is a valid split.
#
# transformers dispatches an experts forward by ``config._experts_implementation`` (eager,
# ``grouped_mm``, kernels; the ``use_experts_implementation`` decorator). None of those knows that
# the weights are split, so the split module's class is extended by :class:`_ExpertParallel` (as
# raggedfsdp's ``fully_shard`` extends a class it shards): its forward runs whatever the config
# says, and a model left unsplit keeps HF's dispatch untouched.
def parallelize_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Expert parallelism over the 1-D mesh ``ep_mesh`` (torchtitan's ExpertParallel); returns
    the experts modules, in model order.

    Each experts module's stacked weights become DTensor Parameters ``Shard(0)`` over
    ``ep_mesh`` (this rank keeps experts ``[r E/ep, (r+1) E/ep)``), cut from the full weights
    that every rank holds (the same seed everywhere) without a collective; its forward then
    dispatches each token to the ranks holding its experts and back (module docstring). Calls
    :func:`check_expert_parallel` first: bad input is a ``ValueError`` before any change or
    collective. To shard the experts for data parallelism as well, ``fully_shard`` each
    returned module over the other (dp) mesh afterwards."""
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_experts: ep_mesh must be 1-D, got dims {ep_mesh.mesh_dim_names} of "
            f"shape {tuple(ep_mesh.shape)} (take mesh['ep'])"
        )
    if ep_mesh.get_coordinate() is None:
        raise ValueError(f"parallelize_experts: this rank is not in ep_mesh {ep_mesh}")
    ep = ep_mesh.size()
    check_expert_parallel(model, ep)
    rank = ep_mesh.get_local_rank()
    modules = [module for _, module in expert_modules(model)]
    for module in modules:
        for name in _WEIGHTS:
            full = getattr(module, name)
            size = full.shape[0] // ep
            # A copy, not a view: the full stack is freed once the parameter is replaced.
            mine = full.detach()[rank * size : (rank + 1) * size].clone()
            local = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(local, requires_grad=full.requires_grad))
        module.__class__ = _expert_parallel_class(type(module))
        module.ep_mesh = ep_mesh
    return modules


#: The class of each split experts class, made once, so modules of one class share one class.
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallel, cls), {})
    return _CLASSES[cls]


class _ExpertParallel(nn.Module):
    """Mixed in before an HF experts class by :func:`parallelize_experts`: the forward of the
    split experts, whatever ``config._experts_implementation`` names."""

    #: The 1-D mesh the experts are split over; its group carries the tokens.
    ep_mesh: DeviceMesh
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """HF's experts forward: ``hidden_states [T, d]`` through the experts ``top_k_index
        [T, k]`` names, weighted by ``top_k_weights [T, k]`` and summed -> ``[T, d]``."""
        num_tokens, top_k = top_k_index.shape
        num_experts = self.gate_up_proj.shape[0]  # a DTensor's shape: the global one
        pairs = top_k_index.reshape(-1)  # 1-D [T * k]: token t's slot j at t * k + j
        order = pairs.argsort(stable=True)  # the pairs grouped by expert, tokens in order
        counts = torch.bincount(pairs, minlength=num_experts)  # 1-D [E]
        done = _dispatch(self, hidden_states[order // top_k], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # The scores weight each result on the token's own rank: they need not travel.
        weighted = done[inverse].view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        experts = self.gate_up_proj.shape[0]
        local = experts // self.ep_mesh.size()
        first = self.ep_mesh.get_local_rank() * local
        return f"experts {first}..{first + local - 1} of {experts} (ep)"


def _dispatch(module: _ExpertParallel, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``tokens [N, d]``, grouped by the global expert they go to (``counts [E]`` of them per
    expert), through their experts on the ranks holding them; the results in the same order."""
    group, ep = module.ep_mesh.get_group(), module.ep_mesh.size()
    local = counts.numel() // ep
    received = torch.empty_like(counts)  # 1-D [ep * local]: from each source, per local expert
    dist.all_to_all_single(received, counts, group=group)
    # [rank][local expert]: the tokens this rank sends to each rank's experts, and those it gets
    # from each rank for its own; one host sync for both (all_to_all_single takes host lists).
    to_ranks, from_ranks = torch.stack((counts, received)).view(2, ep, local).tolist()
    send, recv = [sum(row) for row in to_ranks], [sum(row) for row in from_ranks]
    arrived = exchange_rows(tokens, recv, send, group)  # by source rank, then expert
    pieces = arrived.split([n for row in from_ranks for n in row])
    by_expert = [pieces[s * local + e] for e in range(local) for s in range(ep)]
    per_expert = [sum(from_ranks[s][e] for s in range(ep)) for e in range(local)]
    done = _local_experts(module, torch.cat(by_expert), per_expert)
    results = done.split([piece.shape[0] for piece in by_expert])  # by expert, then source
    back = torch.cat([results[e * ep + s] for s in range(ep) for e in range(local)])
    return exchange_rows(back, send, recv, group)


def _local_experts(module: nn.Module, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """HF's eager per-expert math on this rank's experts: ``tokens [N, d]`` grouped by local
    expert, ``counts[e]`` of them for expert ``e``."""
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    out = []
    for expert, chunk in enumerate(tokens.split(counts)):
        gate, up = F.linear(chunk, gate_up[expert]).chunk(2, dim=-1)
        out.append(F.linear(module.act_fn(gate) * up, down[expert]))
    return torch.cat(out)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: the local tensor of an expert-parallel DTensor (in forward, also
    under ``fully_shard`` over a dp mesh: its unsharded parameter is the DTensor over ep)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def exchange_rows(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` over ``group`` (``in_splits[r]`` rows to rank ``r``,
    ``out_splits[r]`` from it), differentiable: the backward sends the gradients back the way
    the rows came. Token dispatch for expert parallelism."""
    return _AllToAll.apply(rows, out_splits, in_splits, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows, differentiable: backward sends the gradients back the way
    the rows came."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        in_splits, out_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None
