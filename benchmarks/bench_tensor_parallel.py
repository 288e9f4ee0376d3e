"""dp x tp step time: raggedfsdp beside FSDP2, each over mesh["dp"] after tensor parallelism.

One launch of ``dp * tp`` Gloo ranks builds a small Llama-style decoder (RMSNorm, attention with
separate q/k/v/o projections, SwiGLU MLP), applies torchtitan's tensor-parallel plan to every
block over mesh["tp"] (q, k, v, w1, w3 ``ColwiseParallel``; o, w2 ``RowwiseParallel``; local
heads), then shards each block and the root over mesh["dp"] -- once with ``rf.fully_shard``,
once with FSDP2's -- from the same initial weights. Each step is forward, cross-entropy,
backward and ``torch.optim.AdamW.step()`` on this dp rank's batch; the two systems alternate step
by step (and which goes first), after a barrier, so both see the same machine. Medians over
``--steps``, the slowest rank; the first loss of each system shows they train the same model.

Usage::

    python benchmarks/bench_tensor_parallel.py --dp 2 --tp 2 --write-docs docs/results/runtime.md
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
import raggedfsdp as rf
from generated_docs import write_section
from raggedfsdp.spawn import run_on_ranks

SYSTEMS: dict[str, Callable[..., Any]] = {"raggedfsdp": rf.fully_shard, "fsdp2": fsdp2_fully_shard}
TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "mlp.w1": ColwiseParallel(),
    "mlp.w3": ColwiseParallel(),
    "mlp.w2": RowwiseParallel(),
}


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: the local heads under tensor parallelism (torchtitan's way).
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, head_dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, head_dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


def _parallelize(shard: Callable[..., Any], model: Decoder, mesh: DeviceMesh) -> Decoder:
    """torchtitan's order: tensor parallelism over mesh["tp"], then FSDP over mesh["dp"]."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    return model


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    generator = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    systems = {}
    for name, shard in SYSTEMS.items():
        torch.manual_seed(0)
        model = _parallelize(shard, Decoder(args.vocab, args.dim, args.layers, 64), mesh)
        systems[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(name: str) -> float:
        model, optimizer = systems[name]
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    first = {name: step(name) for name in systems}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(args.steps):
        order = list(systems) if i % 2 == 0 else list(reversed(systems))
        for name in order:
            torch.distributed.barrier()
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    return {"first_loss": first, "step_s": {n: statistics.median(t) for n, t in times.items()}}


def _table(per_rank: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    worst = {n: max(r["step_s"][n] for r in per_rank) for n in SYSTEMS}
    losses = per_rank[0]["first_loss"]
    rows = [
        f"dp={args.dp} x tp={args.tp} Gloo ranks on this machine; decoder of {args.layers} blocks, "
        f"dim {args.dim}, vocab {args.vocab}, batch {args.batch} x {args.seq} per dp rank; "
        f"median of {args.steps} interleaved steps, slowest rank.",
        "",
        "| system | step (median) | FSDP2+TP / system | first loss |",
        "| --- | --- | --- | --- |",
    ]
    for name in SYSTEMS:
        rows.append(
            f"| {name} + TP | {worst[name] * 1e3:.1f} ms | {worst['fsdp2'] / worst[name]:.3f}x "
            f"| {losses[name]:.6f} |"
        )
    return "\n".join(rows) + f"\n\n`{command}`"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(_rank, args.dp * args.tp, args, backend="gloo", timeout=1800)
    command = "python benchmarks/bench_tensor_parallel.py " + shlex.join(sys.argv[1:])
    table = _table(per_rank, args, command.strip())
    print(table)
    if args.write_docs is not None:
        write_section(args.write_docs, "bench_tensor_parallel", table)


if __name__ == "__main__":
    main()
