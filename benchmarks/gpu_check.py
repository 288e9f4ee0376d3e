"""One command for a session that is lent a GPU: check the CUDA/NCCL path, then time it.

Usage (on the GPU machine, from the repository root; about 3-6 minutes on one H200)::

    python benchmarks/gpu_check.py --out "$OUT"          # NCCL, world size 1
    python benchmarks/gpu_check.py --device cpu --quick  # the same script on Gloo: a smoke test

1. **Correctness** (one rank, NCCL): a GPT wrapped with ``rf.fully_shard`` (blocks, then the
   root) trains a few AdamW steps and must equal the same model trained unwrapped on the same
   device (fp32, TF32 off: max relative error per tensor <= 1e-5; bf16 mixed precision: the
   loss curve within 2% of fp32's). A DCP checkpoint of the sharded model is saved, loaded into a
   freshly wrapped model and compared bit for bit. **CPU offload**: the same model wrapped with
   ``offload_policy=CPUOffloadPolicy(pin_memory=True)`` trains the same steps and must equal the
   run without it (max relative error per tensor <= 1e-5) and, on CUDA, peak at fewer bytes
   (``torch.cuda.max_memory_allocated`` of each run's own allocations, both reported). On CPU the
   policy is met as is (nothing to copy), so ``--device cpu`` only smoke-tests the script there.
2. **Timing**: ``raggedfsdp bench`` (raggedfsdp, FSDP2, DDP and the compute floor interleaved, as
   on CPU) at world size 1 for gpt-medium and gpt-ref; medians and ratios.

Everything it measured goes to ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` (copy the figures
into docs/results/runtime.md with the command). The exit status is 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

import raggedfsdp as rf
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.spawn import run_on_ranks

STEPS = 5
BATCH = 8
FP32_TOLERANCE = 1e-5
BF16_LOSS_TOLERANCE = 0.02


def _batches(cfg, device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def _train(model: torch.nn.Module, batches) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _wrap(
    model: torch.nn.Module,
    mp_policy: rf.MixedPrecisionPolicy | None,
    offload: CPUOffloadPolicy | None = None,
) -> None:
    for block in model.blocks:
        rf.fully_shard(block, mp_policy=mp_policy, offload_policy=offload)
    rf.fully_shard(model, mp_policy=mp_policy, offload_policy=offload)


def _relative_errors(got: dict, want: dict) -> float:
    """The largest per-tensor max |got - want| / max |want|."""
    return max(
        ((got[k].float() - want[k].float().cpu()).abs().max() / want[k].abs().max()).item()
        for k in want
    )


def _offload_run(base: torch.nn.Module, batches, offload: CPUOffloadPolicy | None) -> tuple:
    """``base`` wrapped (with ``offload`` or without) and trained: its full state, losses, and
    the device bytes it peaks at in training (what it keeps there included, what other objects
    hold not; None off CUDA)."""
    cuda = next(base.parameters()).device.type == "cuda"
    gc.collect()
    floor = torch.cuda.memory_allocated() if cuda else 0  # what other objects hold
    model = copy.deepcopy(base)
    _wrap(model, None, offload)
    gc.collect()  # the copy's unsharded originals, gone with wrapping
    if cuda:  # from here: what the wrapped model keeps on the device, and its training's peak
        torch.cuda.reset_peak_memory_stats()
    losses = _train(model, batches)
    peak = torch.cuda.max_memory_allocated() - floor if cuda else None
    return rf.full_state_dict(model), losses, peak


def _offload_check(base: torch.nn.Module, batches) -> dict:
    """CPU offload (pinned) against the same training without: parameters and device peaks."""
    plain, plain_losses, plain_peak = _offload_run(base, batches, None)
    offloaded, losses, peak = _offload_run(base, batches, CPUOffloadPolicy(pin_memory=True))
    return {
        "offload_max_relative_error": _relative_errors(offloaded, plain),
        "offload_losses": losses,
        "no_offload_losses": plain_losses,
        "offload_peak_bytes": peak,
        "no_offload_peak_bytes": plain_peak,
    }


def _correctness(rank: int, world: int, model_name: str, device_type: str) -> dict:
    """On the rank: fp32 parity with the unwrapped model, bf16 loss curve, DCP round trip."""
    import torch.distributed.checkpoint as dcp

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    device = device or torch.device("cpu")
    cfg = GPT_CONFIGS[model_name]
    torch.manual_seed(0)
    base = GPT(cfg, device=device)
    batches = _batches(cfg, device, STEPS)
    reference = copy.deepcopy(base)
    ref_losses = _train(reference, batches)
    sharded = copy.deepcopy(base)
    _wrap(sharded, None)
    losses = _train(sharded, batches)
    full = rf.full_state_dict(sharded)
    fp32_error = _relative_errors(full, reference.state_dict())
    bf16 = copy.deepcopy(base)
    _wrap(bf16, rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    bf16_losses = _train(bf16, batches)
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(sharded.state_dict(), checkpoint_id=tmp)
        fresh = GPT(cfg, device=device)
        _wrap(fresh, None)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=tmp)
        fresh.load_state_dict(state)
        reloaded = rf.full_state_dict(fresh)
    bitwise = all(torch.equal(reloaded[k], full[k]) for k in full)
    return {
        "device": str(device),
        "backend": torch.distributed.get_backend(),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "fp32_max_relative_error": fp32_error,
        "fp32_losses": losses,
        "reference_losses": ref_losses,
        "bf16_losses": bf16_losses,
        "bf16_max_loss_gap": max(abs(a - b) / b for a, b in zip(bf16_losses, losses, strict=True)),
        "dcp_round_trip_bitwise": bitwise,
        "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
    } | _offload_check(base, batches)


def _bench(model: str, steps: int, timeout: float) -> dict:
    cmd = [
        sys.executable, "-m", "raggedfsdp.cli", "bench", "--model", model, "--world", "1",
        "--steps", str(steps), "--systems", "raggedfsdp,fsdp2,ddp,floor", "--no-profile", "--json",
    ]  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        return {"command": " ".join(cmd), "error": out.stderr[-2000:]}
    result = json.loads(out.stdout)
    return {"command": " ".join(cmd), "seconds": time.perf_counter() - start, "result": result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="gpt-tiny only, no gpt-ref bench")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    # CPU offload reduces host tensors too (gradient norms, full state dicts), as FSDP2's does:
    # Gloo for those beside NCCL
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    model = "gpt-tiny" if args.quick else "gpt-small"
    [check] = run_on_ranks(_correctness, 1, model, args.device, backend=backend, timeout=600)
    check["passed"] = (
        check["fp32_max_relative_error"] <= FP32_TOLERANCE
        and check["bf16_max_loss_gap"] <= BF16_LOSS_TOLERANCE
        and check["dcp_round_trip_bitwise"]
        and check["offload_max_relative_error"] <= FP32_TOLERANCE
        and (args.device != "cuda" or check["offload_peak_bytes"] < check["no_offload_peak_bytes"])
    )
    report["correctness"] = check
    print(json.dumps(check, indent=2), flush=True)
    benches = ["gpt-tiny"] if args.quick else ["gpt-medium", "gpt-ref"]
    report["bench"] = {m: _bench(m, 4 if args.quick else 10, 900) for m in benches}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (args.out / "gpu_check.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0 if check["passed"] else 1


def _markdown(report: dict) -> str:
    check = report["correctness"]
    lines = [
        f"torch {report['torch']}, CUDA {report['cuda']}, {check['gpu'] or check['device']}, "
        f"backend {check['backend']}",
        "",
        f"- fp32 parity with the unwrapped model: max relative error "
        f"{check['fp32_max_relative_error']:.2e} (tolerance {FP32_TOLERANCE:g})",
        f"- bf16 mixed precision: loss within {check['bf16_max_loss_gap']:.2%} of fp32",
        f"- DCP round trip bit for bit: {check['dcp_round_trip_bitwise']}",
        f"- CPUOffloadPolicy(pin_memory=True) vs none: max relative error "
        f"{check['offload_max_relative_error']:.2e} (tolerance {FP32_TOLERANCE:g}); device peak "
        f"{_mib(check['offload_peak_bytes'])} vs {_mib(check['no_offload_peak_bytes'])} MiB",
        f"- passed: {check['passed']}",
        "",
    ]
    for model, bench in report["bench"].items():
        lines.append(f"### bench {model}: `{bench['command']}`")
        lines.append("")
        if "error" in bench:
            lines += ["```", bench["error"], "```", ""]
            continue
        systems = bench["result"]["systems"]
        fsdp2 = systems.get("fsdp2", {}).get("step_s")
        lines += ["| system | median step s | best step s | vs FSDP2 | tensor peak MiB |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        for name, entry in systems.items():
            ratio = f"{entry['step_s'] / fsdp2:.3f}" if fsdp2 else ""
            peak = entry.get("memory", {}).get("max_tensor_peak_bytes")
            peak_mib = f"{peak / 2**20:.1f}" if peak else ""
            lines.append(
                f"| {name} | {entry['step_s']:.4f} | {entry['best_step_s']:.4f} | {ratio} "
                f"| {peak_mib} |"
            )
        lines.append("")
    return "\n".join(lines)


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


if __name__ == "__main__":
    sys.exit(main())
