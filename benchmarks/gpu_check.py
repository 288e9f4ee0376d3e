"""One command for a session that is lent a GPU: check the CUDA/NCCL path, count what it makes
the host wait for, train, and time it against FSDP2, in phases that each fit a short command.

Usage (on the GPU machine, from the repository root; at most 8 minutes on one GPU)::

    python benchmarks/gpu_check.py --out "$OUT"           # NCCL, world size 1
    python benchmarks/gpu_check.py --device cpu --quick   # the dry run on Gloo, this machine

Four phases, each in fresh processes with its own time limit (at most 2 minutes; the script
stops starting phases once 8 minutes are spent). After every phase ``OUT/gpu_check.json`` and
``OUT/gpu_check.md`` are rewritten with everything so far, so a command cut short keeps the
phases it finished.

1. **correctness** (W=1): a GPT wrapped with ``rf.fully_shard`` (blocks, then the root)
   trains 5 steps against the same model unwrapped: fp32 AdamW (max relative error per tensor
   <= 1e-5, then a DCP round trip bit for bit), ``rf.optim.Muon``, ``Shampoo`` and
   ``AdamW8bit`` (<= 1e-4); bf16 mixed precision (loss within 2% of fp32) and fp8 all-gather +
   int8 reduce-scatter (within 5%); ``CPUOffloadPolicy(pin_memory=True)`` against none (<=
   1e-5, and on CUDA a lower device peak).
2. **syncs**: one step per setting (plain, bf16, compressed with torch's AdamW; plain with
   each ``rf.optim`` optimizer), forward+backward and optimizer step apart: the profiler's
   CUDA runtime calls that block the host (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
   ``cudaEventSynchronize``, synchronous ``cudaMemcpy``), ``cudaMemcpyAsync`` and kernel
   launches, and :class:`raggedfsdp.runtime.HostSyncCounter`'s count (the CPU tests' budget).
3. **train**: ``raggedfsdp train --nproc 1 --steps 20``, its ``metrics.jsonl`` summarised
   (loss, tokens/s, exposed communication timed by CUDA events, the device's peak per window).
4. **bench**: ``raggedfsdp bench --world 1`` of raggedfsdp against FSDP2. At W=1 FSDP2 skips
   its collectives (its unshard returns before any all-gather and its reduce copies the
   gradient instead of reduce-scattering it: ``world_size == 1`` in torch's
   ``_fsdp_param_group.py`` and ``_fsdp_collectives.py``), while raggedfsdp still calls its
   one-rank all-gather and reduce-scatter: the ratio is framework overhead, not communication.

The exit status is 1 when a correctness check fails or a phase does not finish.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raggedfsdp.spawn import run_on_ranks

#: The script's whole budget: a command on the device machine may run 10 minutes.
TOTAL_LIMIT_S = 480.0
#: A phase is not started with less than this left.
MIN_PHASE_S = 30.0


@dataclass(frozen=True)
class Phase:
    name: str
    limit_s: float  # at most this long, and no longer than what is left of the total
    run: Callable[[argparse.Namespace, float], dict[str, Any]]


def _backend(args: argparse.Namespace) -> str:
    # CPU offload reduces host tensors too (gradient norms, full state dicts), as FSDP2's
    # does: Gloo for those beside NCCL.
    return "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"


def _model(args: argparse.Namespace) -> str:
    return "gpt-tiny" if args.quick else "gpt-small"


def _correctness(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    from gpu_check_ranks import correctness

    [result] = run_on_ranks(
        correctness, 1, _model(args), args.device, backend=_backend(args), timeout=timeout
    )
    return result


def _syncs(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    from gpu_check_ranks import sync_counts

    [result] = run_on_ranks(
        sync_counts, 1, _model(args), args.device, backend=_backend(args), timeout=timeout
    )
    return {"settings": result, "passed": not any("error" in r for r in result.values())}


def _train(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    from raggedfsdp.train.monitor import read_metrics

    out = args.out / "train"
    cmd = [
        sys.executable, "-m", "raggedfsdp.cli", "train", "--nproc", "1", "--steps", "20",
        "--model", _model(args), "--out", str(out), "--overwrite", "--log-every", "5",
        "--no-tensorboard",
    ]  # fmt: skip
    if args.quick:
        cmd += ["--batch-size", "4"]
    result = _command(cmd, timeout)
    records = [r for r in read_metrics(out) if r.get("kind") == "train"]
    keys = ("step", "loss", "tokens_per_s", "step_s", "comm_exposed_s", "comm_fraction")
    keys += ("cuda_peak_bytes", "peak_rss_bytes")
    result["records"] = [{k: r[k] for k in keys if k in r} for r in records]
    result["passed"] = result["returncode"] == 0 and len(records) > 0
    return result


def _bench(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    model, steps = ("gpt-tiny", "2") if args.quick else ("gpt-ref", "10")
    cmd = [
        sys.executable, "-m", "raggedfsdp.cli", "bench", "--model", model, "--world", "1",
        "--steps", steps, "--warmup", "1", "--systems", "raggedfsdp,fsdp2", "--no-profile",
        "--json", "--timeout", str(int(timeout)),
    ]  # fmt: skip
    if args.quick:
        cmd.append("--no-memory")
    result = _command(cmd, timeout)
    if result["returncode"] == 0:
        result["result"] = json.loads(result.pop("stdout"))
    result["note"] = (
        "W=1: FSDP2 skips its all-gather and reduce-scatter (world_size == 1), raggedfsdp "
        "calls its one-rank collectives; the ratio is framework overhead, not communication"
    )
    result["passed"] = result["returncode"] == 0
    return result


def _command(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run ``cmd`` in a session of its own, killed whole (workers included) at ``timeout``."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = -9
    return {
        "command": " ".join(cmd),
        "returncode": code,
        "seconds": round(time.perf_counter() - start, 1),
        "stdout": stdout,
        "stderr_tail": stderr[-2000:],
    }


PHASES = (
    Phase("correctness", 120.0, _correctness),
    Phase("syncs", 90.0, _syncs),
    Phase("train", 120.0, _train),
    Phase("bench", 120.0, _bench),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="gpt-tiny everywhere")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (--device cpu --quick is the dry run)", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "device": args.device,
        "quick": args.quick,
        "phases": {},
    }
    deadline = time.perf_counter() + TOTAL_LIMIT_S
    for phase in PHASES:
        left = deadline - time.perf_counter()
        if left < MIN_PHASE_S:
            report["phases"][phase.name] = {"passed": False, "skipped": "8 minutes spent"}
        else:
            report["phases"][phase.name] = _run_phase(phase, args, min(phase.limit_s, left))
        _write(report, args.out)  # before the next phase starts
    print(_markdown(report))
    return 0 if all(p.get("passed") for p in report["phases"].values()) else 1


def _run_phase(phase: Phase, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    print(f"gpu_check: phase {phase.name} (at most {timeout:.0f} s)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        result = phase.run(args, timeout)
    except Exception:  # a phase that breaks or times out leaves the next ones their time
        result = {"passed": False, "error": traceback.format_exc()[-3000:]}
    result["phase_seconds"] = round(time.perf_counter() - start, 1)
    return result


def _write(report: dict[str, Any], out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(_markdown(report))


def _markdown(report: dict[str, Any]) -> str:
    phases = report["phases"]
    lines = [
        f"gpu_check {report['date']}: torch {report['torch']}, CUDA {report['cuda']}, "
        f"{report['gpu'] or report['device']}{' (--quick)' if report['quick'] else ''}",
        "",
        "| phase | passed | seconds |",
        "| --- | --- | ---: |",
    ]
    lines += [
        f"| {name} | {p.get('passed')} | {p.get('phase_seconds', '-')} |"
        for name, p in phases.items()
    ]
    if "correctness" in phases and "backend" in phases["correctness"]:
        lines += ["", "| check | passed | figure |", "| --- | --- | --- |"]
        for name, check in phases["correctness"].items():
            if isinstance(check, dict):
                lines.append(f"| {name} | {check.get('passed')} | {_figure(check)} |")
    if "settings" in phases.get("syncs", {}):
        lines += [
            "",
            "| setting (one step) | fwd+bwd syncs / launches | optimizer syncs / launches |",
        ]
        lines += ["| --- | --- | --- |"]
        for name, counts in phases["syncs"]["settings"].items():
            lines.append(f"| {name} | {_calls(counts, 'forward_backward')} | "
                         f"{_calls(counts, 'optimizer')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _figure(check: dict[str, Any]) -> str:
    if "error" in check:
        return "error: " + check["error"].strip().splitlines()[-1][:120]
    if "max_relative_error" in check:
        return f"max relative error {check['max_relative_error']:.2e}"
    return f"max loss gap {check['max_loss_gap']:.2%}"


def _calls(counts: dict[str, Any], phase: str) -> str:
    if phase not in counts:
        return "error"
    c = counts[phase]
    return (
        f"{c['host_syncs']} profiler / {c['dispatch_syncs']} counted syncs, "
        f"{c['kernel_launches']} launches"
    )


if __name__ == "__main__":
    sys.exit(main())
