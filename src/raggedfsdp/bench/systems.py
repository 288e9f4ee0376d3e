"""The systems ``raggedfsdp bench`` compares, and one timed training step of each.

How each is built from the shared seed, the batches they all train on, and one timed training step
with the counters read around it.
"""

from __future__ import annotations

import functools
import gc
import resource
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .._host import synchronize
from ..data import sample_batch
from ..models import GPT, GPT_CONFIGS
from ..runtime import CommCompression, DBufferConfig, FSDPBackend

if TYPE_CHECKING:
    from .options import BenchOptions

__all__ = [
    "STEP_KEYS",
    "BatchSpec",
    "Runner",
    "build",
    "make_batches",
    "raggedfsdp_with",
]


class BatchSpec(Protocol):
    """What :func:`make_batches` reads from a benchmark's options (read-only, so frozen
    dataclasses qualify)."""

    @property
    def model(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def batch_size(self) -> int: ...


@dataclass
class Runner:
    """A model, its optimizer and how to read its own counters."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    stats: Callable[[], dict[str, float]] | None = None
    reset_stats: Callable[[], None] | None = None
    #: bytes of full original parameters still alive after wrapping (not the trained ones)
    retained_original_bytes: int = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One training step; wall times of its phases."""
        if self.reset_stats is not None:
            self.reset_stats()
        synchronize(self.device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        waited = _runqueue_seconds()
        cpu, main_cpu = _process_cpu_seconds(), time.thread_time()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(x, y)
        synchronize(self.device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(self.device)
        t2 = time.perf_counter()
        self.optimizer.step()
        synchronize(self.device)
        t3 = time.perf_counter()
        return {
            "total": t3 - t0,
            "fwd": t1 - t0,
            "bwd": t2 - t1,
            "opt": t3 - t2,
            # first touches of fresh pages: allocator churn (freed and re-mapped buffers)
            "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
            # time this thread was runnable but not running: contention (others' or our own
            # communication threads) stretching the step
            "runqueue": _runqueue_seconds() - waited,
            # CPU seconds the step burnt: the whole process (compute thread plus the
            # communication backend's threads) and the compute thread alone
            "cpu": _process_cpu_seconds() - cpu,
            "main_cpu": time.thread_time() - main_cpu,
            "loss": float(loss.detach()),
            "stats": self.stats() if self.stats is not None else None,
        }


STEP_KEYS = ("total", "fwd", "bwd", "opt", "page_faults", "runqueue", "cpu", "main_cpu")
"""The figures of :meth:`Runner.step` that are merged over ranks (their maximum)."""


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _runqueue_seconds() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def build(name: str, options: BenchOptions, device: torch.device) -> Runner:
    """Build ``name``'s model from the shared seed and wrap it."""

    torch.manual_seed(options.seed)
    model = GPT(GPT_CONFIGS[options.model], device=device)
    originals = [weakref.ref(p) for p in model.parameters()]
    stats = reset = None
    if name.startswith("raggedfsdp"):
        FSDPBackend(
            model,
            dbuffer_config=DBufferConfig(zero_copy=name != "raggedfsdp-copy"),
            compression=_COMPRESSION.get(name),
        )
        stats, reset = model.stats, model.reset_stats  # type: ignore[attr-defined]
    elif name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh, "mp_policy": mp} if name == "fsdp2-bf16" else {"mesh": mesh}
        blocks = list(model.blocks)  # type: ignore[attr-defined]
        for i, block in enumerate(blocks):
            keep = name == "fsdp2-last" and i == len(blocks) - 1
            fully_shard(block, reshard_after_forward=not keep, **kwargs)
        fully_shard(model, **kwargs)
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    elif name != "floor":
        raise ValueError(f"unknown system {name!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    gc.collect()
    # Bytes of the model's own (unwrapped, full) parameters that wrapping left alive: the
    # parameters themselves for DDP and the floor; for a sharded system, memory it should free.
    alive = [p for p in (ref() for ref in originals) if p is not None]
    own = {id(p) for p in model.parameters()}
    retained = sum(p.numel() * p.element_size() for p in alive if id(p) not in own)
    return Runner(name, model, optimizer, device, stats, reset, retained)


_COMPRESSION = {
    "raggedfsdp-fp8ag": CommCompression(all_gather=torch.float8_e4m3fn),
    "raggedfsdp-int8rs": CommCompression(reduce_scatter=torch.int8),
    "raggedfsdp-q": CommCompression(all_gather=torch.float8_e4m3fn, reduce_scatter=torch.int8),
}
"""The compressed systems' :class:`CommCompression` (blocks: the default policy's 256-element
runs)."""


def make_batches(
    spec: BatchSpec, count: int, rank: int, world: int, device: torch.device | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of global batches 0..count-1 (``spec.batch_size`` sequences per rank) of
    a random token stream for GPT shape ``spec.model``; the same for every system compared."""

    cfg = GPT_CONFIGS[spec.model]
    gen = torch.Generator().manual_seed(spec.seed)
    tokens = torch.randint(0, cfg.vocab_size, (1 << 20,), generator=gen, dtype=torch.int64)
    out = []
    for step in range(count):
        x, y = sample_batch(
            tokens,
            step,
            seq_len=cfg.seq_len,
            batch_size=spec.batch_size * world,
            seed=spec.seed,
            rank=rank,
            world_size=world,
        )
        out.append((x.to(device), y.to(device)) if device is not None else (x, y))
    return out


def raggedfsdp_with(optimizer: str) -> Callable[[str, BenchOptions, torch.device], Runner]:
    """A builder for :func:`~.memory.memory_phase`: the ``raggedfsdp`` system with another of
    raggedfsdp's optimizers (``"adamw8bit"``, ``"muon"``, ``"shampoo"``), its planner keeping
    that optimizer's blocks whole. The capacity planner's validation measures it."""
    return functools.partial(_build_raggedfsdp_with, optimizer=optimizer)


def _build_raggedfsdp_with(
    name: str, options: BenchOptions, device: torch.device, *, optimizer: str
) -> Runner:
    from .. import optim
    from ..planner import StructAwarePlanner

    torch.manual_seed(options.seed)
    model = GPT(GPT_CONFIGS[options.model], device=device)
    FSDPBackend(model, planner=StructAwarePlanner(optimizer_type=optimizer))  # type: ignore[arg-type]
    classes = {"adamw8bit": optim.AdamW8bit, "muon": optim.Muon, "shampoo": optim.Shampoo}
    if optimizer not in classes:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {', '.join(classes)}")
    opt = classes[optimizer](model.parameters(), lr=options.lr)
    return Runner(name, model, opt, device, model.stats, model.reset_stats)  # type: ignore[attr-defined]
