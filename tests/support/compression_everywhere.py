"""Compressed communication everywhere it should work, run on 4 ranks (``test_compression.py``
judges it): HSDP (the replicate all-reduce in full precision), no_sync accumulation, bf16 mixed
precision, error feedback, meta-device init, rf.optim; and bad input, before any collective.
``-native`` cases run NCCL's calls on Gloo (``gloo_point_to_point=False``) under its asynchrony
emulated (``collective_wrap``)."""

from __future__ import annotations

import torch
from torch import nn

import raggedfsdp as rf
from collective_wrap import emulated_when
from compression_gather import _unsharded_parameters, quant_dequant
from compression_reduce import SHAPES, Probe
from harness import error_message
from parity_models import OddModel, make_batches
from raggedfsdp.materialize import init_sharded_
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.models.gpt import init_parameter_
from raggedfsdp.planner import quant_block

INT8, E4M3 = torch.int8, torch.float8_e4m3fn
BOTH = rf.CommCompression(all_gather=INT8, reduce_scatter=INT8)
STEPS, GLOBAL_BATCH = 3, 16


def _losses(
    rank, world, compression, *, mesh=None, mp=None, micro=1, optimizer="adamw", native=False
):
    """Per-step losses (averaged over ranks) of OddModel trained sharded, and its stats."""
    torch.manual_seed(0)
    model = OddModel()
    planner = rf.StructAwarePlanner(
        optimizer_type="adamw8bit" if optimizer == "adamw8bit" else None,
        shard_policy=rf.RaggedShard(block_size=4),
        compression=compression,
    )
    rf.FSDPBackend(
        model,
        planner=planner,
        mesh=mesh,
        mp_policy=mp,
        compression=compression,
        dbuffer_config=rf.DBufferConfig(gloo_point_to_point=not native),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = rf.optim.AdamW8bit(params, lr=1e-2) if optimizer == "adamw8bit" else None
    opt = opt or torch.optim.AdamW(params, lr=1e-2)
    replicas = 1 if mesh is None else mesh.size(0)
    losses, per = [], GLOBAL_BATCH // world
    for idx, targets in make_batches(STEPS, GLOBAL_BATCH):
        model.reset_stats()
        opt.zero_grad()
        idx, targets = idx[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]
        chunks = list(zip(idx.chunk(micro), targets.chunk(micro), strict=True))
        total = 0.0
        for i, (x, y) in enumerate(chunks):
            model.set_requires_gradient_sync(i == micro - 1)
            loss = model(x, y) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    reduced = torch.tensor(losses)
    torch.distributed.all_reduce(reduced)
    return (reduced / world).tolist(), model.stats(), model, replicas


def _close(a: list[float], b: list[float], tol: float = 0.02) -> bool:
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b, strict=True))


def _training(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    plain, _, _, _ = _losses(rank, world, None)
    for name, kwargs in {
        "flat": {"compression": BOTH},
        "no_sync": {"compression": BOTH, "micro": 2},
        "bf16": {
            "compression": rf.CommCompression(all_gather=E4M3, reduce_scatter=INT8),
            "mp": rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        },
        "error_feedback": {
            "compression": rf.CommCompression(reduce_scatter=INT8, error_feedback=True)
        },
        "adamw8bit": {"compression": BOTH, "optimizer": "adamw8bit"},
        # NCCL's calls on Gloo, under its asynchrony emulated
        "flat-native": {"compression": BOTH, "native": True},
        "no_sync-native": {"compression": BOTH, "micro": 2, "native": True},
    }.items():
        with emulated_when(kwargs.get("native", False)) as emulation:
            losses, stats, _, _ = _losses(rank, world, **kwargs)
        failure = None if emulation is None else emulation.failure()
        close = _close(losses, plain) and failure is None
        out[name] = (close, failure or losses, plain, stats["reduce_scatter_calls"])
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for name, native in (("hsdp", False), ("hsdp-native", True)):
        with emulated_when(native) as emulation:
            losses, stats, model, _ = _losses(rank, world, BOTH, mesh=mesh, native=native)
        trainable = {
            n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
        }
        full_precision = sum(
            4 * plan.shard_numel for plan in model.shard_plans() if set(plan.entries) <= trainable
        )
        close = _close(losses, plain) and (emulation is None or emulation.failure() is None)
        out[name] = (close, stats["all_reduce_bytes"], full_precision)
        if not native:
            policy = rf.RaggedShard(block_size=4)
            out["hsdp_forward"] = _forward_is_quantize_dequantize(model, policy)
    return out


def _forward_is_quantize_dequantize(model: nn.Module, policy: rf.RaggedShard) -> list[str]:
    seen = _unsharded_parameters(model)
    full = rf.full_state_dict(model)
    return [
        name
        for name, got in seen.items()
        if not torch.equal(
            got, quant_dequant(full[name], quant_block(name, got.shape, policy), INT8)[0]
        )
    ]


def _meta_init(rank: int, world: int) -> list[str]:
    cfg = GPT_CONFIGS["gpt-tiny"]
    model = GPT(cfg, device="meta")
    comp = rf.CommCompression(all_gather=INT8)
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4), compression=comp)
    torch.manual_seed(5)
    init_sharded_(model, lambda name, t: init_parameter_(name, t, cfg))
    return _forward_is_quantize_dequantize(model, rf.RaggedShard(block_size=4))


def _bad_input(rank: int, world: int) -> dict[str, str]:
    errors = {}

    def expect(name, fn):
        errors[name] = error_message(fn)

    counted = OddModel()
    counted.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    expect("non_floating", lambda: rf.fully_shard(counted, compression=BOTH))
    expect(
        "planner",
        lambda: rf.FSDPBackend(OddModel(), planner=rf.StructAwarePlanner(), compression=BOTH),
    )
    wide = rf.CommCompression(all_gather=INT8, block_size=8)
    expect(
        "tile",
        lambda: rf.FSDPBackend(
            OddModel(), shard_policy=rf.RaggedShard(block_size=4), compression=wide
        ),
    )
    model = OddModel()
    rf.FSDPBackend(model, compression=BOTH)
    with torch.no_grad():
        if rank == 1:
            model.blocks[0].fc1.weight.to_local().view(-1)[0] = float("nan")  # its piece
    idx, targets = make_batches(1, world)[0]
    expect("non_finite", lambda: model(idx[rank : rank + 1], targets[rank : rank + 1]))
    return errors


def _hsdp_non_finite(rank: int, world: int) -> tuple[str, float]:
    """HSDP 2 x 2: rank 3 (replica group {2, 3}) has a NaN gradient; every rank of both groups
    must raise, then reach the next collective."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = Probe(SHAPES)
    rf.FSDPBackend(
        model,
        shard_policy=rf.RaggedShard(block_size=4),
        mesh=mesh,
        compression=rf.CommCompression(reduce_scatter=INT8),
    )
    targets = {n: torch.ones(s) for n, s in SHAPES.items()}
    if rank == 3:
        targets["a"].view(-1)[0] = float("nan")
    message = error_message(lambda: model(targets).backward())
    after = torch.ones(1)
    torch.distributed.all_reduce(after)
    return message, after.item()


def everywhere(rank: int, world: int) -> dict:
    return {"training": _training(rank, world), "meta": _meta_init(rank, world)} | {
        "bad": _bad_input(rank, world),
        "hsdp_non_finite": _hsdp_non_finite(rank, world),
    }
