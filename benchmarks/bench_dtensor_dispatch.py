"""What DTensor parameters cost a step: RaggedTensor dispatch, beside plain pieces and FSDP2.

Sharded parameters, their gradients and optimizer state are ``RaggedTensor`` DTensors ([Note:
ragged shards as DTensors]): every op the optimizer and the clip run on them passes through its
``__torch_dispatch__`` (one Python call per op, per list for ``_foreach_*``). On gpt-ref sharded
by ``rf.fully_shard`` per block and root at W ranks, after one real backward, this times, per
rank, interleaved and alternating which goes first:

- ``optimizer.step()`` of ``torch.optim.AdamW`` (foreach: torch's default; fused; for-loop) over
  the RaggedTensor parameters and gradients the runtime hands out, and over plain tensors that
  are the same storage (the local pieces: what the parameters were before they were DTensors);
- ``torch.nn.utils.clip_grad_norm_`` over the RaggedTensor gradients (DTensor partial norms) and
  ``rf.clip_grad_norm_`` (the local pieces, one all-reduce);
- the same AdamW step and clip on the same model sharded by torch's FSDP2 (its DTensor dispatch,
  Shard(0)), for comparison.

Medians over ``--repeats``, the max over ranks. Usage::

    python benchmarks/bench_dtensor_dispatch.py --world 2 --write-docs docs/results/runtime.md
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
import raggedfsdp as rf
from generated_docs import write_section
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.spawn import run_on_ranks

KINDS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sharded(shard: Callable[..., object], base: torch.nn.Module, seq_len: int) -> list:
    """``base`` copied, sharded per block and root by ``shard``, after one backward: its
    parameters with gradients."""
    model = copy.deepcopy(base)
    for block in model.blocks:
        shard(block)
    shard(model)
    idx = torch.randint(0, GPT_CONFIGS["gpt-ref"].vocab_size, (4, seq_len))
    model(idx, idx).backward()
    return [p for p in model.parameters() if p.grad is not None]


def _plain(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Plain parameters viewing the same local pieces, with plain gradients of the same storage."""
    out = []
    for p in params:
        plain = torch.nn.Parameter(p.to_local().detach())
        plain.grad = p.grad.to_local()
        out.append(plain)
    return out


def _rank(rank: int, world: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT_CONFIGS["gpt-ref"]
    base = GPT(cfg)
    ours = _sharded(rf.fully_shard, base, cfg.seq_len)
    plain = _plain(ours)
    fsdp2 = _sharded(fsdp2_fully_shard, base, cfg.seq_len)
    cases: dict[str, Callable[[], object]] = {}
    for kind, options in KINDS.items():
        for name, params in (("ragged", ours), ("plain", plain), ("fsdp2", fsdp2)):
            optimizer = torch.optim.AdamW(params, lr=0.0, **options)
            cases[f"{kind}:{name}"] = optimizer.step
    cases["clip:torch"] = lambda: torch.nn.utils.clip_grad_norm_(ours, 1e9)
    cases["clip:rf"] = lambda: rf.clip_grad_norm_(ours, 1e9)
    cases["clip:fsdp2"] = lambda: torch.nn.utils.clip_grad_norm_(fsdp2, 1e9)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up: optimizer state, allocator
        fn()
    for i in range(repeats):
        order = list(cases.items())
        for name, fn in order if i % 2 == 0 else reversed(order):
            torch.distributed.barrier()
            times[name].append(_timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def _table(per_rank: list[dict[str, float]], command: str) -> str:
    worst = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    rows = [
        "| gpt-ref, per rank (median, slowest rank) | RaggedTensor | plain pieces | "
        "difference | FSDP2 (DTensor) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind in KINDS:
        ragged, plain, fsdp2 = (worst[f"{kind}:{n}"] for n in ("ragged", "plain", "fsdp2"))
        rows.append(
            f"| AdamW ({kind}) `optimizer.step()` | {ragged * 1e3:.1f} ms | {plain * 1e3:.1f} ms "
            f"| {(ragged - plain) * 1e3:+.1f} ms | {fsdp2 * 1e3:.1f} ms |"
        )
    rows.append(
        f"| `clip_grad_norm_` (torch's; `rf.clip_grad_norm_` as plain) | "
        f"{worst['clip:torch'] * 1e3:.1f} ms | {worst['clip:rf'] * 1e3:.1f} ms | "
        f"{(worst['clip:torch'] - worst['clip:rf']) * 1e3:+.1f} ms | "
        f"{worst['clip:fsdp2'] * 1e3:.1f} ms |"
    )
    return "\n".join(rows) + f"\n\n`{command}`"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(_rank, args.world, args.repeats, backend="gloo")
    command = "python benchmarks/bench_dtensor_dispatch.py " + shlex.join(sys.argv[1:])
    table = _table(per_rank, command.strip())
    print(table)
    if args.write_docs is not None:
        write_section(args.write_docs, "bench_dtensor_dispatch", table)


if __name__ == "__main__":
    main()
