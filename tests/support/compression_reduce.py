"""Compressed reduce-scatter cases run on every rank (``test_compression.py`` judges them):
each element against the quantizer's analytic bound, exactness where every block is
representable, error feedback, and the bytes on the wire (per step, both directions).
``native`` cases run NCCL's all-to-all of the messages on Gloo (``gloo_point_to_point=False``)
under its asynchrony emulated (``collective_wrap``)."""

from __future__ import annotations

import torch
from torch import nn

import raggedfsdp as rf
from collective_wrap import emulated_when
from compression_gather import quant_dequant
from raggedfsdp.planner import quant_block

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = {"a": (13, 24), "b": (3, 8), "c": (50,)}  # b: fewer rows than ranks
#: per code dtype: (relative half-step of a normal code, half the smallest subnormal code)
HALF_STEP = {torch.int8: (0.0, 0.5), E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}
#: a code magnitude every block gets (so its scale is exactly 1), and what else is exact
CODE_MAX = {torch.int8: 127.0, E4M3: 448.0, E5M2: 57344.0}
EXACT_RANGE = {torch.int8: 126, E4M3: 16, E5M2: 8}


class Probe(nn.Module):
    """``loss = sum(p * target_p)``: the gradient of each parameter is its target, exactly."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))

    def forward(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, n) * t).sum() for n, t in targets.items())


def _targets(rank: int, dtype: torch.dtype | None, policy, exact: bool) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for name, shape in SHAPES.items():
        if not exact:
            out[name] = torch.randn(shape, generator=g) * 10.0 ** (rank - 2)
            continue
        limit = EXACT_RANGE[dtype]
        t = torch.randint(-limit, limit + 1, shape, generator=g).float()
        block = quant_block(name, shape, rf.RaggedShard(block_size=policy))
        grid = t.view(block.view_shape(t.numel()))
        grid[:: block.rows, :: block.cols] = CODE_MAX[dtype]  # every block: scale exactly 1
        out[name] = t
    return out


def _step(rank, world, policy, compression, targets, native=False):
    """One backward of ``Probe``; on the NCCL branch (``native``) under emulated asynchrony,
    whose failure (or ``None``) comes last."""
    model = Probe(SHAPES)
    config = rf.DBufferConfig(gloo_point_to_point=not native)
    rf.FSDPBackend(
        model,
        shard_policy=rf.RaggedShard(block_size=policy),
        compression=compression,
        dbuffer_config=config,
    )
    model.reset_stats()
    with emulated_when(native) as emulation:
        model(targets[rank]).backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}  # the pieces
    layouts = {n: rf.layout_of(p) for n, p in model.named_parameters()}
    failure = None if emulation is None else emulation.failure()
    return grads, layouts, model.stats(), model.shard_plans(), failure


def _within_bound(rank, world, policy, dtype, native=False) -> list:
    targets = [_targets(k, dtype, policy, exact=False) for k in range(world)]
    comp = rf.CommCompression(reduce_scatter=dtype)
    grads, layouts, _, _, failure = _step(rank, world, policy, comp, targets, native)
    relative, absolute = HALF_STEP[dtype]
    failures = [failure] if failure else []
    for name, shape in SHAPES.items():
        block = quant_block(name, shape, rf.RaggedShard(block_size=policy))
        true = sum(t[name] for t in targets) / world
        bound = torch.zeros(shape)
        for t in targets:
            _, scale = quant_dequant(t[name], block, dtype)
            bound += torch.maximum(t[name].abs() * relative, scale * absolute) / world
        error = (layouts[name].to_local(true, rank) - grads[name]).abs()
        excess = error - layouts[name].to_local(bound, rank) * (1 + 1e-5) - 1e-30
        if excess.numel() and excess.max() > 0:
            failures.append((name, excess.max().item()))
    return failures


def _exact_and_bytes(rank, world, policy, dtype, native=False) -> list:
    """Representable blocks: the compressed reduce-scatter gives bitwise what the uncompressed
    one gives, the mean summed in rank order (on NCCL's branch, ``native``: the compressed
    one, whose sum is the runtime's own, still in rank order)."""
    targets = [_targets(k, dtype, policy, exact=True) for k in range(world)]
    true = {n: sum(t[n] for t in targets) / world for n in SHAPES}
    comp = rf.CommCompression(all_gather=torch.int8, reduce_scatter=dtype)
    failures = []
    # The compressed one last: its stats and plans follow. NCCL's uncompressed AVG does not
    # promise the rank order of the sum (Gloo's reduce-scatter does not either).
    for compression in (comp,) if native else (None, comp):
        got, layouts, stats, plans, failure = _step(
            rank, world, policy, compression, targets, native
        )
        failures += [failure] if failure else []
        failures += [
            (n, compression is None)
            for n in got
            if not torch.equal(got[n], layouts[n].to_local(true[n], rank))
        ]
    messages = sum(_message_bytes(plan, policy) for plan in plans)
    shards = sum(plan.shard_numel * 4 for plan in plans)  # fp32
    expected = {
        "all_gather_bytes": messages,
        "reduce_scatter_bytes": world * messages,
        "all_gather_uncompressed_bytes": shards,
        "reduce_scatter_uncompressed_bytes": world * shards,
    }
    failures += [(k, stats[k], v) for k, v in expected.items() if stats[k] != v]
    return failures


def _message_bytes(plan, policy) -> int:
    """Codes of the shard padded to 16 bytes, then the largest count of fp32 scales of a rank,
    the whole padded to 16 bytes."""
    blocks = [
        sum(
            quant_block(e.name, e.shape, rf.RaggedShard(block_size=policy)).num_blocks(end - start)
            for e in plan.entries.values()
            for start, end in [plan.local_range(e.name, rank)]
        )
        for rank in range(plan.world_size)
    ]
    return _ceil16(_ceil16(plan.shard_numel) + 4 * max(blocks))


def _ceil16(n: int) -> int:
    return -(-n // 16) * 16


def _error_feedback(rank, world) -> dict[str, float]:
    """A fixed gradient every step: the sum of what was reduced drifts from the true sum
    without error feedback, and stays within one step's error with it."""
    targets = [_targets(k, None, None, exact=False) for k in range(world)]
    true = {n: sum(t[n] for t in targets) / world for n in SHAPES}
    errors = {}
    for feedback in (False, True):
        comp = rf.CommCompression(reduce_scatter=E5M2, error_feedback=feedback)
        model = Probe(SHAPES)
        rf.FSDPBackend(model, compression=comp)
        total = {n: torch.zeros_like(p.to_local()) for n, p in model.named_parameters()}
        steps = 16
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(targets[rank]).backward()
            for n, p in model.named_parameters():
                total[n] += p.grad.to_local()
        errors[str(feedback)] = max(
            (rf.layout_of(p).to_local(true[n] * steps, rank) - total[n]).abs().max().item()
            for n, p in model.named_parameters()
            if p.to_local().numel()
        )
    return errors


def reduce_grid(rank: int, world: int) -> dict:
    results = {}
    for policy in (None, (4, 8)):
        for dtype in (torch.int8, E4M3, E5M2):
            results[("bound", policy, str(dtype))] = _within_bound(rank, world, policy, dtype)
            results[("exact", policy, str(dtype))] = _exact_and_bytes(rank, world, policy, dtype)
    # NCCL's calls on Gloo, under its asynchrony emulated.
    results[("bound-native", None, str(E4M3))] = _within_bound(rank, world, None, E4M3, native=True)
    results[("exact-native", (4, 8), str(torch.int8))] = _exact_and_bytes(
        rank, world, (4, 8), torch.int8, native=True
    )
    if world == 2:
        results["error_feedback"] = _error_feedback(rank, world)
    return results
