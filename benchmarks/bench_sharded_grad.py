"""What making torch's clip_grad_norm_ work costs a step: ``ShardedGrad`` gradients.

Sharded gradients are ``ShardedGrad`` tensors ([Note: torch's clip_grad_norm_ over ragged
shards]); every torch call on them passes through ``__torch_function__``. On gpt-ref sharded by
``rf.fully_shard`` per block and root at W ranks, after one real backward, this times, per rank,
interleaved and alternating which goes first:

- ``optimizer.step()`` of ``torch.optim.AdamW`` (foreach, torch's default) and of
  ``rf.optim.Muon``, with the gradients as the runtime hands them out (``ShardedGrad``) and as
  plain views of the same storage (what they were before);
- handing out the gradients (``DBuffer.as_grad`` for every parameter, what each step adds);
- the clip: ``torch.nn.utils.clip_grad_norm_`` over ``ShardedGrad`` vs ``rf.clip_grad_norm_``.

Medians over ``--repeats``, the max over ranks. Usage::

    python benchmarks/bench_sharded_grad.py --world 2 --write-docs docs/results/runtime.md
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
import raggedfsdp as rf
from generated_docs import write_section
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.runtime._hooks import states_under
from raggedfsdp.spawn import run_on_ranks


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank(rank: int, world: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT_CONFIGS["gpt-ref"]
    model = GPT(cfg)
    for block in model.blocks:
        rf.fully_shard(block)
    rf.fully_shard(model)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    model(idx, idx).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad for p in params]
    plain = [g.as_subclass(torch.Tensor) for g in sharded]
    buckets = [(b, p) for s in states_under(model) for b in s.group.buckets for p in b.params]

    def use(grads: list[torch.Tensor]) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    adamw = torch.optim.AdamW(params, lr=0.0)
    matrices = [p for p in params if len(rf.layout_of(p).global_shape) >= 2]
    vectors = [p for p in params if len(rf.layout_of(p).global_shape) < 2]
    groups = [{"params": matrices}, {"params": vectors, "use_muon": False}]
    muon = rf.optim.Muon(groups, lr=0.0, adamw_lr=0.0)
    cases: dict[str, Callable[[], object]] = {
        "adamw:sharded": lambda: (use(sharded), adamw.step()),
        "adamw:plain": lambda: (use(plain), adamw.step()),
        "muon:sharded": lambda: (use(sharded), muon.step()),
        "muon:plain": lambda: (use(plain), muon.step()),
        "as_grad": lambda: [b.as_grad(p.sharded.grad) for b, p in buckets],
        "clip:torch": lambda: (use(sharded), torch.nn.utils.clip_grad_norm_(params, 1e9)),
        "clip:rf": lambda: (use(sharded), rf.clip_grad_norm_(params, 1e9)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up: optimizer state, allocator
        fn()
    for i in range(repeats):
        order = list(cases.items())
        for name, fn in order if i % 2 == 0 else reversed(order):
            torch.distributed.barrier()
            times[name].append(_timed(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return medians | {f"{name}:min": min(t) for name, t in times.items()}


def _table(per_rank: list[dict[str, float]], command: str) -> str:
    worst = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    rows = [
        "| what (gpt-ref, per rank; median, and min in brackets) | ShardedGrad | plain | "
        "difference |",
        "| --- | --- | --- | --- |",
    ]
    for kind in ("adamw", "muon"):
        ours, plain = worst[f"{kind}:sharded"], worst[f"{kind}:plain"]
        ours_min, plain_min = worst[f"{kind}:sharded:min"], worst[f"{kind}:plain:min"]
        rows.append(
            f"| `{kind}` optimizer.step() | {ours * 1e3:.1f} ({ours_min * 1e3:.1f}) ms | "
            f"{plain * 1e3:.1f} ({plain_min * 1e3:.1f}) ms | {(ours - plain) * 1e3:+.2f} "
            f"({(ours_min - plain_min) * 1e3:+.2f}) ms |"
        )
    rows.append(
        f"| handing out the gradients (`as_grad`, every parameter) | "
        f"{worst['as_grad'] * 1e3:.2f} ms | — | {worst['as_grad'] * 1e3:+.2f} ms |"
    )
    rows.append(
        f"| clip: `torch.nn.utils.clip_grad_norm_` vs `rf.clip_grad_norm_` | "
        f"{worst['clip:torch'] * 1e3:.1f} ms | {worst['clip:rf'] * 1e3:.1f} ms | "
        f"{(worst['clip:torch'] - worst['clip:rf']) * 1e3:+.2f} ms |"
    )
    return "\n".join(rows) + f"\n\n`{command}`"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(_rank, args.world, args.repeats, backend="gloo")
    command = "python benchmarks/bench_sharded_grad.py " + shlex.join(sys.argv[1:])
    table = _table(per_rank, command.strip())
    print(table)
    if args.write_docs is not None:
        write_section(args.write_docs, "bench_sharded_grad", table)


if __name__ == "__main__":
    main()
