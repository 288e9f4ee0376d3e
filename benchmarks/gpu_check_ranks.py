"""What ``benchmarks/gpu_check.py`` runs on its rank, phase by phase (importable by module and
name, as :func:`raggedfsdp.spawn.run_on_ranks` needs): the correctness checks and the count of
host synchronisations and kernel launches per step. One rank: NCCL on a GPU, Gloo on the CPU
(the dry run).

Every check catches its own failure, so one that breaks leaves the others' results.
"""

from __future__ import annotations

import copy
import gc
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import raggedfsdp as rf
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.runtime import HostSyncCounter
from raggedfsdp.train.build import build_optimizer
from raggedfsdp.train.config import TrainConfig

STEPS = 5
BATCH = 8
FP32_TOLERANCE = 1e-5  # max relative error per tensor, fp32 against the unwrapped model
OPTIM_TOLERANCE = 1e-4  # the same for rf.optim's optimizers (their own kernels on both sides)
BF16_LOSS_TOLERANCE = 0.02  # relative loss gap of bf16 mixed precision to fp32
COMPRESSED_LOSS_TOLERANCE = 0.05  # fp8 all-gather + int8 reduce-scatter to fp32
FP8_INT8 = rf.CommCompression(all_gather=torch.float8_e4m3fn, reduce_scatter=torch.int8)
BF16_FP32 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

#: CUDA runtime calls that block the host until the device is done (the profiler's names)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def device_of(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batches(model: str, device: torch.device, steps: int) -> list[tuple[torch.Tensor, ...]]:
    cfg = GPT_CONFIGS[model]
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def optimizer_for(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """``raggedfsdp train``'s optimizer ``name`` (decay on matrices, Muon on the blocks)."""
    return build_optimizer(model, TrainConfig(optimizer=name, lr=1e-3, muon_lr=1e-3))


def train(model: nn.Module, data: list, optimizer: torch.optim.Optimizer) -> list[float]:
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def wrap(model: nn.Module, optimizer: str = "adamw", **kwargs: Any) -> nn.Module:
    """``rf.fully_shard`` on each block, then the root; the planner keeps ``optimizer``'s
    structures whole."""
    kind = None if optimizer == "adamw" else optimizer
    planner = rf.StructAwarePlanner(optimizer_type=kind, compression=kwargs.get("compression"))
    for block in model.blocks:  # type: ignore[union-attr]
        rf.fully_shard(block, planner=planner, **kwargs)
    rf.fully_shard(model, planner=planner, **kwargs)
    return model


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor ``max |got - want| / max |want|``."""
    return max(
        ((got[k].float() - want[k].float().cpu()).abs().max() / want[k].abs().max()).item()
        for k in want
    )


def _loss_gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


# -- phase 1: correctness ---------------------------------------------------------------------


def _parity(base: nn.Module, data: list, optimizer: str) -> dict[str, Any]:
    """``optimizer`` on the wrapped model against the same on the unwrapped one."""
    reference = copy.deepcopy(base)
    ref_losses = train(reference, data, optimizer_for(reference, optimizer))
    sharded = wrap(copy.deepcopy(base), optimizer)
    losses = train(sharded, data, optimizer_for(sharded, optimizer))
    error = relative_error(rf.full_state_dict(sharded), reference.state_dict())
    tolerance = FP32_TOLERANCE if optimizer == "adamw" else OPTIM_TOLERANCE
    return {
        "max_relative_error": error,
        "tolerance": tolerance,
        "losses": losses,
        "reference_losses": ref_losses,
        "passed": error <= tolerance,
    }


def _plain(base: nn.Module, data: list) -> dict[str, Any]:
    """fp32 AdamW parity, then a DCP round trip of the trained model, bit for bit."""
    import torch.distributed.checkpoint as dcp

    out = _parity(base, data, "adamw")
    sharded = wrap(copy.deepcopy(base))
    train(sharded, data[:2], optimizer_for(sharded, "adamw"))
    full = rf.full_state_dict(sharded)
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(sharded.state_dict(), checkpoint_id=tmp)
        fresh = wrap(copy.deepcopy(base))
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=tmp)
        fresh.load_state_dict(state)
        reloaded = rf.full_state_dict(fresh)
    out["dcp_round_trip_bitwise"] = all(torch.equal(reloaded[k], full[k]) for k in full)
    out["passed"] = out["passed"] and out["dcp_round_trip_bitwise"]
    return out


def _against_fp32(base: nn.Module, data: list, tolerance: float, **kwargs: Any) -> dict:
    """The wrapped model's loss curve with ``kwargs`` (mixed precision, compression) against
    fp32's."""
    plain = wrap(copy.deepcopy(base))
    reference = train(plain, data, optimizer_for(plain, "adamw"))
    model = wrap(copy.deepcopy(base), **kwargs)
    losses = train(model, data, optimizer_for(model, "adamw"))
    gap = _loss_gap(losses, reference)
    return {"losses": losses, "fp32_losses": reference, "max_loss_gap": gap,
            "tolerance": tolerance, "passed": gap <= tolerance}  # fmt: skip


def _offload(base: nn.Module, data: list) -> dict[str, Any]:
    """``CPUOffloadPolicy(pin_memory=True)`` against no offload: parameters and device peaks
    (on CUDA the offloaded run must peak lower)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    runs = {}
    for name, policy in (("none", None), ("offload", CPUOffloadPolicy(pin_memory=True))):
        cuda = next(base.parameters()).device.type == "cuda"
        gc.collect()
        floor = torch.cuda.memory_allocated() if cuda else 0
        model = wrap(copy.deepcopy(base), offload_policy=policy)
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses = train(model, data, optimizer_for(model, "adamw"))
        peak = torch.cuda.max_memory_allocated() - floor if cuda else None
        runs[name] = (rf.full_state_dict(model), losses, peak)
    error = relative_error(runs["offload"][0], runs["none"][0])
    peaks = runs["offload"][2], runs["none"][2]
    lower = peaks[0] is None or peaks[1] is None or peaks[0] < peaks[1]
    return {"max_relative_error": error, "peak_bytes": peaks[0], "no_offload_peak_bytes": peaks[1],
            "passed": error <= FP32_TOLERANCE and lower}  # fmt: skip


def _guarded(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return check()
    except Exception:  # one broken check must not hide the others
        return {"passed": False, "error": traceback.format_exc()[-3000:]}


def correctness(rank: int, world: int, model_name: str, device_type: str) -> dict[str, Any]:
    """Every check of phase 1 on this rank, each against its reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = device_of(device_type)
    torch.manual_seed(0)
    base = GPT(GPT_CONFIGS[model_name], device=device)
    data = batches(model_name, device, STEPS)
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "plain": lambda: _plain(base, data),
        "bf16": lambda: _against_fp32(base, data, BF16_LOSS_TOLERANCE, mp_policy=BF16_FP32),
        "compressed": lambda: _against_fp32(
            base, data, COMPRESSED_LOSS_TOLERANCE, compression=FP8_INT8
        ),
        "muon": lambda: _parity(base, data, "muon"),
        "shampoo": lambda: _parity(base, data, "shampoo"),
        "adamw8bit": lambda: _parity(base, data, "adamw8bit"),
        "offload": lambda: _offload(base, data),
    }
    out: dict[str, Any] = {
        "device": str(device),
        "backend": str(torch.distributed.get_backend()),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    for name, check in checks.items():
        out[name] = _guarded(check)
    out["passed"] = all(out[name]["passed"] for name in checks)
    return out


# -- phase 2: host syncs and kernel launches --------------------------------------------------

#: name -> (wrap keyword arguments, optimizer)
SYNC_SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "plain, torch AdamW": ({}, "adamw"),
    "bf16, torch AdamW": ({"mp_policy": BF16_FP32}, "adamw"),
    "compressed, torch AdamW": ({"compression": FP8_INT8}, "adamw"),
    "plain, rf.optim.Muon": ({}, "muon"),
    "plain, rf.optim.Shampoo": ({}, "shampoo"),
    "plain, rf.optim.AdamW8bit": ({}, "adamw8bit"),
}


def _profiled_calls(step: Callable[[], None], cuda: bool) -> dict[str, int]:
    """CUDA runtime calls of one ``step``, by kind (zeros without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()  # earlier work done; the calls are counted as they are made
    with profile(activities=activities) as prof:
        step()
    names = Counter(event.name for event in prof.events())
    return {
        # a synchronous cudaMemcpy blocks too; the async ones (device-to-host copies are
        # followed by a cudaStreamSynchronize) are counted beside
        "host_syncs": sum(names[n] for n in SYNC_CALLS) + names["cudaMemcpy"],
        "memcpy_async": names["cudaMemcpyAsync"],
        "kernel_launches": sum(names[n] for n in LAUNCH_CALLS),
    }


def _count_setting(base: nn.Module, data: list, kwargs: dict[str, Any], optim: str) -> dict:
    model = wrap(copy.deepcopy(base), optim, **kwargs)
    optimizer = optimizer_for(model, optim)
    train(model, data[:2], optimizer)  # warm-up: lazy init, optimizer state
    x, y = data[2]
    out: dict[str, Any] = {}
    for phase in ("forward_backward", "optimizer"):
        counter = HostSyncCounter()

        def run(phase: str = phase, counter: HostSyncCounter = counter) -> None:
            with counter:
                if phase == "forward_backward":
                    model(x, y).backward()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

        calls = _profiled_calls(run, x.device.type == "cuda")
        out[phase] = {"dispatch_syncs": counter.total, **calls}
    return out


def sync_counts(rank: int, world: int, model_name: str, device_type: str) -> dict[str, Any]:
    """Phase 2: per setting, one step's host syncs and kernel launches, forward+backward and
    optimizer step apart: the profiler's CUDA runtime calls, and the ops that read a device
    value on the host (:class:`raggedfsdp.runtime.HostSyncCounter`, the CPU tests' count)."""
    device = device_of(device_type)
    torch.manual_seed(0)
    base = GPT(GPT_CONFIGS[model_name], device=device)
    data = batches(model_name, device, 3)
    out: dict[str, Any] = {}
    for name, (kwargs, optim) in SYNC_SETTINGS.items():
        out[name] = _guarded(lambda k=kwargs, o=optim: _count_setting(base, data, k, o))
    return out
