"""What the launcher checks before it starts any worker, and the ``--dry-run`` report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .._console import format_bytes
from .._host import available_ram_bytes
from ..capacity.capacity import DEFAULT_RESERVE
from ..capacity.cost import (
    MemoryBreakdown,
    StepShape,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from ..capacity.lora import LoRABytes
from ..capacity.parallel import UnsplittableModel, split_model
from ..capacity.shapes import ModelShape, model_shape
from ..data import load_corpus
from ..facts import ParallelDims
from ..models import hf
from ..planner import ShardPlan, model_buckets, wrap_units
from .build import build_planner, job_mesh, meta_model, mp_policy, wrap_policy
from .checkpoints import check_entries, check_rank_files, read_meta
from .config import TrainConfig
from .lora_meter import predicted_lora, predicted_lora_bytes
from .mesh import JobMesh
from .run_dir import check_out_dir, free_space, resume_checkpoint

__all__ = [
    "STATE_BYTES_PER_PARAM",
    "check_corpus",
    "check_data_path",
    "check_disk",
    "check_memory",
    "check_plan",
    "check_ties",
    "dry_run_report",
    "preflight",
]


def check_data_path(path: str | None) -> None:
    """The cheap part of ``load_corpus``'s checks: a missing path or an empty file."""
    if path is None:
        return
    data = Path(path)
    if not data.exists():
        raise ValueError(f"data: corpus path {str(data)!r} does not exist")
    if not data.is_dir() and not data.is_file():
        raise ValueError(f"data: corpus path {str(data)!r} is neither a regular file nor a folder")
    if data.is_file() and data.stat().st_size == 0:
        raise ValueError(f"data: corpus file {str(data)!r} is empty")
    if data.is_dir() and not any(p.is_file() for p in data.rglob("*")):
        raise ValueError(f"data: corpus folder {str(data)!r} has no files")


def _model_entries(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """DCP keys and shapes of the model part of a checkpoint of this run."""
    model = meta_model(cfg)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def _num_params(model: torch.nn.Module) -> int:
    """Parameters of ``model``, a tied one counted once."""
    return sum(p.numel() for p in model.parameters())


def check_corpus(cfg: TrainConfig) -> None:
    """``--data`` holds enough text for one sequence in both the train and validation splits
    (the embedded default corpus always does, and is not read here)."""
    if cfg.data is None:
        return
    corpus = load_corpus(cfg.data, seed=cfg.seed)
    need = cfg.tokens_per_seq + 1
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if tokens.numel() < need:
            raise ValueError(
                f"data: the {split} split of {corpus.source} has {tokens.numel():,} bytes, "
                f"fewer than one sequence needs ({need:,} for --seq-len "
                f"{cfg.tokens_per_seq}); give more text or a shorter --seq-len"
            )


#: Optimizer-state bytes per fp32 parameter (AdamW: two moments; Muon: momentum, with Adam on
#: the rest; Shampoo: grafting moments and factors; AdamW8bit: two 8-bit moments and scales).
STATE_BYTES_PER_PARAM = {"adamw": 8, "muon": 6, "shampoo": 12, "adamw8bit": 3}


def check_disk(cfg: TrainConfig) -> None:
    """The file system of ``--out`` has room for one more checkpoint of this run (fp32
    parameters plus optimizer state, with 25% for metadata, the RNG files and file-system
    blocks)."""
    need = int(_num_params(meta_model(cfg)) * (4 + STATE_BYTES_PER_PARAM[cfg.optimizer]) * 1.25)
    where, free = free_space(cfg.out)
    if free < need:
        raise ValueError(
            f"out: {str(where)!r} has {format_bytes(free)} free, but one checkpoint of this run "
            f"needs about {format_bytes(need)}; free space or choose another --out"
        )


def check_ties(model: torch.nn.Module, name: str) -> None:
    """No parameter is tied across FSDP units (a Hugging Face model's decoder layers, or BERT's
    embeddings, beside the root): each unit shards its parameters on its own, so the workers
    would refuse the second place one is registered in (``name``: the model, for the
    message)."""
    units = {path for path, _ in wrap_units(model, wrap_policy(model)) if path}
    first: dict[int, tuple[str, str]] = {}  # id -> (fqn, unit) where a parameter was first met
    for fqn, param in model.named_parameters(remove_duplicate=False):
        parts = fqn.split(".")[:-1]
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        unit = next((p for p in prefixes if p in units), "")  # the innermost; "": the root
        seen, seen_unit = first.setdefault(id(param), (fqn, unit))
        if seen_unit != unit:
            raise ValueError(
                f"{name}: parameter {fqn!r} is tied to {seen!r} across FSDP units "
                f"({unit or 'the root'} and {seen_unit or 'the root'}), but each unit shards its "
                f'own parameters; untie them (a Hugging Face config: "tie_word_embeddings": '
                f"false)"
            )


@dataclass(frozen=True)
class _RunPlans:
    """The run's model on the meta device, its shard plans (a rank's pieces under ``--tp`` /
    ``--ep``, each bucket planned over its FSDP group, as the workers will) and its shape."""

    model: nn.Module
    plans: list[ShardPlan]
    shape: ModelShape


def _run_plans(cfg: TrainConfig, world_size: int) -> _RunPlans:
    """:class:`_RunPlans` of ``cfg`` at ``world_size``; ``ValueError`` for a block a split
    or a shard would cut (the split's own checks: :func:`~.build.job_mesh`, first)."""
    policy = mp_policy(cfg)
    dtype = policy.param_dtype if policy else None
    model = meta_model(cfg)
    planner = build_planner(cfg)
    experts = hf.experts_per_token(model)
    if cfg.tp == cfg.ep == 1:
        plans = planner.plan_model(model, world_size, dtype=dtype, wrap=wrap_policy(model))
        shape = model_shape(model, experts_per_token=experts, wrap=wrap_policy(model))
        return _RunPlans(model, plans, shape)
    split = split_model(
        model,
        ParallelDims(tp=cfg.tp, ep=cfg.ep),
        policy=planner.shard_policy,
        experts_per_token=experts,
        model_name=cfg.model_name,
    )
    wrap = split.wrap_policy or wrap_policy(model)
    buckets = model_buckets(model, param_dtype=dtype, wrap=wrap, local=split.local)
    plans = [planner.plan_bucket(b, split.fsdp_size(b.name, world_size)) for b in buckets]
    return _RunPlans(model, plans, model_shape(model, experts_per_token=experts, split=split))


def check_plan(cfg: TrainConfig, world_size: int) -> None:
    """The model can be split (``--tp``, ``--ep``) and sharded with ``--block-size`` and the
    optimizer's blocks (planned on the meta device, exactly as the workers will), with no
    parameter tied across units."""
    model = meta_model(cfg)
    check_ties(model, f"hf_config: {cfg.hf_config!r}" if cfg.hf_config else f"model {cfg.model}")
    job_mesh(cfg, world_size)
    try:
        _run_plans(cfg, world_size)
    except UnsplittableModel:
        raise
    except ValueError as err:
        raise ValueError(f"block_size {cfg.block_size}: {err}") from None


def preflight(
    cfg: TrainConfig,
    world_size: int,
    *,
    check_out: bool = True,
    ranks_per_node: int | None = None,
) -> None:
    """What can be checked before any worker starts (``ValueError`` naming the problem), so a
    refused start leaves ``--out`` untouched: the batch split, the data (its path, and that it
    holds a sequence), the shard plan, the memory each rank needs (:func:`check_memory`; this
    node runs ``ranks_per_node`` of them, default all), the output folder (``check_out``: only
    where the run starts, on one node) and, when resuming, that the newest checkpoint fits the
    model and optimizer and leaves steps to train."""
    cfg.check_world(world_size)
    check_data_path(cfg.data)
    check_plan(cfg, world_size)
    check_memory(cfg, world_size, ranks_per_node or world_size)
    check_corpus(cfg)
    if not check_out:
        return
    check_disk(cfg)
    check_out_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite)
    # The checkpoint the workers will resume from: the newest that verifies (run_dir).
    ckpt = resume_checkpoint(cfg.out, strict=cfg.strict_resume)[0] if cfg.resume else None
    if ckpt is not None:
        meta = read_meta(ckpt)
        saved = meta["config"].get("optimizer")
        if saved != cfg.optimizer:
            raise ValueError(
                f"checkpoint {str(ckpt)!r} was saved with --optimizer {saved}; this run uses "
                f"{cfg.optimizer}, whose state it does not have"
            )
        check_entries(ckpt, _model_entries(cfg), meta)
        check_rank_files(ckpt)
        if meta["step"] >= cfg.steps:
            raise ValueError(
                f"checkpoint {str(ckpt)!r} is at step {meta['step']}, not before --steps "
                f"{cfg.steps}: nothing to train; raise --steps to continue the run"
            )


#: Resident memory of a CPU rank's process beyond its tensors (Python, torch, Gloo): what
#: ``raggedfsdp bench`` measures as the RSS before a model exists, about 240 MB here, rounded up.
PROCESS_BYTES = 256 * 2**20


def predicted_memory(cfg: TrainConfig, world_size: int) -> MemoryBreakdown:
    """What one rank of this run holds at its peak (:mod:`raggedfsdp.capacity.cost`): the run's
    own plans, micro-batch, optimizer, mixed precision and activation checkpointing."""
    return _memory(cfg, world_size, _run_plans(cfg, world_size))


def _memory(cfg: TrainConfig, world_size: int, run: _RunPlans) -> MemoryBreakdown:
    """:func:`predicted_memory` from the run's plans, made already. A LoRA run's units are
    the runtime's (an NF4 base all-gathered as its codes and scales, outside the buckets) and
    its persistent terms the largest rank's own tensor bytes (:mod:`raggedfsdp.capacity.lora`):
    the base in NF4, gradients and AdamW's state for the adapters alone."""
    step = _step_shape(cfg, world_size)
    if cfg.lora_rank is None:
        plans = run.plans
        state = optimizer_state_bytes(plans, cfg.optimizer, shampoo_dim=cfg.max_preconditioner_dim)
        return memory_breakdown(run.shape, unit_bytes(plans), step, state, world_size=world_size)
    ranks, units = predicted_lora(cfg, world_size)
    top = _largest(ranks)
    memory = memory_breakdown(run.shape, units, step, top.optimizer, world_size=world_size)
    return replace(memory, params=top.base + top.frozen + top.adapters, grads=top.grads)


def _largest(ranks: list[LoRABytes]) -> LoRABytes:
    """The LoRA tensor bytes of the rank that holds the most (every rank must fit)."""
    return max(ranks, key=lambda r: r.total)


def _step_shape(cfg: TrainConfig, world_size: int) -> StepShape:
    """One rank's step of the run: its micro-batch, mixed precision and checkpointing."""
    policy = mp_policy(cfg)
    return StepShape(
        batch=_micro_batch(cfg, world_size),
        seq_len=cfg.tokens_per_seq,
        param_dtype=policy.param_dtype if policy is not None else torch.float32,
        reduce_dtype=policy.reduce_dtype if policy is not None else None,
        checkpointing=cfg.activation_checkpointing,
        gloo=not torch.cuda.is_available(),
    )


def _micro_batch(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per rank and micro-batch (tensor-parallel peers and a pipeline's stages
    compute on the same ones)."""
    return cfg.batch_size // _mesh(cfg, world_size).data_ranks // cfg.pipeline_microbatches


def _mesh(cfg: TrainConfig, world_size: int) -> JobMesh:
    return JobMesh(world_size, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp)


def _gpu_memory(index: int) -> tuple[int, int | None]:
    """``(total, free)`` bytes of this node's GPU ``index`` (free through NVML, so the launcher
    makes no CUDA context; ``None`` without it)."""
    total = torch.cuda.get_device_properties(index).total_memory
    try:
        return total, total - torch.cuda.device_memory_used(index)
    except (ImportError, RuntimeError):  # no pynvml: what is in use cannot be seen
        return total, None


def _memory_per_rank(
    ranks_per_node: int, *, read: Callable[[int], tuple[int, int | None]] = _gpu_memory
) -> tuple[int, str]:
    """Bytes one rank may use, and where the figure comes from. With GPUs, local rank ``i``
    computes on GPU ``i`` (``_host.local_device``), so each rank has its own GPU's free memory
    (``read``: ``(total, free)``, free ``None`` without NVML, then the total counts) and the
    tightest of the GPUs this node's ranks use bounds them all. Else this node's available RAM
    shared by its ranks, less each process's own overhead."""
    if torch.cuda.is_available():
        count = min(ranks_per_node, max(1, torch.cuda.device_count()))
        return _tightest_gpu([(index, *read(index)) for index in range(count)])
    available = available_ram_bytes()
    share = available // ranks_per_node - PROCESS_BYTES
    return share, (
        f"the available RAM, {format_bytes(available)}, shared by {ranks_per_node} rank(s), "
        f"less {format_bytes(PROCESS_BYTES)} per process"
    )


def _tightest_gpu(gpus: list[tuple[int, int, int | None]]) -> tuple[int, str]:
    """The budget of the GPU with the least memory of ``(index, total, free)`` (the first of
    equals), and how the error names it."""

    def budget(gpu: tuple[int, int, int | None]) -> int:
        _, total, free = gpu
        return total if free is None else free

    index, total, free = min(gpus, key=lambda gpu: (budget(gpu), gpu[0]))
    if free is None:
        source = f"GPU {index}'s total memory, {format_bytes(total)}"
    else:
        source = f"GPU {index}'s free memory, {format_bytes(free)} of {format_bytes(total)}"
    if len({budget(gpu) for gpu in gpus}) > 1:
        source += f" (the least of the {len(gpus)} GPUs this node's ranks use)"
    return budget((index, total, free)), source


def check_memory(cfg: TrainConfig, world_size: int, ranks_per_node: int) -> None:
    """Each rank's predicted peak fits its memory with 10% in reserve, unless ``--force``."""
    if cfg.force:
        return
    budget, source = _memory_per_rank(ranks_per_node)
    if budget <= 0:  # the processes alone take it all: say so before any planning
        raise ValueError(f"memory: nothing is left for tensors: {source}; use fewer --nproc")
    memory = predicted_memory(cfg, world_size)
    usable = int(budget * (1 - DEFAULT_RESERVE))
    if memory.peak <= usable:
        return
    micro = _micro_batch(cfg, world_size)
    advice = [
        f"fewer sequences per rank (--batch-size, now {micro} per rank and micro-batch: "
        f"activations {format_bytes(memory.activations)}) or more --grad-accum"
    ]
    if not cfg.activation_checkpointing:
        advice.append("--activation-checkpointing")
    if cfg.mixed_precision == "none":
        advice.append("--mixed-precision bf16")
    advice.append(f"more ranks (persistent state {format_bytes(memory.persistent)} per rank)")
    held = "shards, gradients and optimizer state"
    if cfg.lora_rank is not None:
        held = "frozen base, adapters, their gradients and AdamW state"
    raise ValueError(
        f"memory: each rank needs about {format_bytes(memory.peak)} at its peak ({held} "
        f"{format_bytes(memory.persistent)}, unsharded parameters and gradients "
        f"{format_bytes(memory.unsharded)}, activations "
        f"{format_bytes(memory.activations)}), but {format_bytes(usable)} is usable: "
        f"{source}, with {100 * DEFAULT_RESERVE:.0f}% in reserve. Try "
        f"{', '.join(advice)}; or --force to start anyway"
    )


#: Where the peak lies (``MemoryBreakdown.phase``), as the dry run says it.
_PHASES = {
    "loss": "the loss's backward",
    "block": "last block's backward",
    "reduce": "the next block's backward, the last one's reduction in flight",
}


def dry_run_report(cfg: TrainConfig, world_size: int) -> str:
    """The shard plan of the model on the meta device and an estimate of memory per rank."""
    run = _run_plans(cfg, world_size)  # the same buckets as the run's (planner.bucketing)
    model, plans = run.model, run.plans
    where = f"{world_size} rank(s)"
    if cfg.tp > 1 or cfg.ep > 1 or cfg.pp > 1:
        where += f" ({_mesh(cfg, world_size)}; a rank's pieces)"
    shard = sum(p.shard_numel for p in plans)
    padding = sum(p.padding_numel for p in plans)
    numel = sum(p.param_numel for p in plans)
    lines = [
        f"{cfg.model_name}: {_num_params(model):,} parameters on {where}, "
        f"optimizer {cfg.optimizer}, block {cfg.block_size}",
        f"{'bucket':<28}{'params':>8}{'elements':>12}{'per rank':>12}{'padding':>10}",
    ]
    for plan in plans:
        lines.append(
            f"{plan.name:<28}{len(plan.entries):>8}{plan.param_numel:>12,}"
            f"{plan.shard_numel:>12,}{100 * plan.padding_ratio:>9.3f}%"
        )
    lines.append(
        f"{'total':<28}{'':>8}{numel:>12,}{shard:>12,}{100 * padding / max(1, numel):>9.3f}%"
    )
    # Per rank, the capacity planner's model of this run (docs/capacity.md), as the preflight
    # checks it: the peak frees the previous step's gradients (zero_grad) before forward. A
    # LoRA run's shards, gradients and optimizer state: its largest rank's, itemised below.
    memory = _memory(cfg, world_size, run)
    micro = _micro_batch(cfg, world_size)
    estimates = [
        ("parameters + gradients (shards)", memory.params + memory.grads),
        (f"optimizer state ({cfg.optimizer})", memory.optimizer),
        ("unsharded parameters + gradients at the peak", memory.unsharded),
        (f"activations at the peak (micro-batch of {micro})", memory.activations),
        (f"peak ({_PHASES[memory.phase]})", memory.peak),
    ]
    lines.append("estimated memory per rank:")
    lines += [f"  {name:<48}{n / 2**20:>10,.1f} MiB" for name, n in estimates]
    if cfg.lora_rank is not None:
        top = _largest(predicted_lora_bytes(cfg, world_size)[0])
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in top.as_dict().items())
        lines.append(f"LoRA tensors of the largest rank: {parts}")
    return "\n".join(lines)
