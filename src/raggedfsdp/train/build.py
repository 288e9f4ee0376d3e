"""What a training run is made of, from its config.

The planner, the sharded model, the optimizer, the learning-rate schedule. Used by the job, by
``--dry-run`` and by the tests.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .. import optim
from ..facts import stage_indices, stages_per_rank
from ..layout import RaggedShard
from ..models import GPT, GPT_CONFIGS, hf
from ..models.lora import apply_lora
from ..planner import StructAwarePlanner, WrapPolicy
from ..runtime import MixedPrecisionPolicy
from ..tensor import local_piece
from .config import TrainConfig
from .mesh import JobMesh, check_model, device_mesh_of, shard_model
from .stages import StageSet, check_pipeline, cut

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = [
    "BETAS",
    "apply_activation_checkpointing",
    "build_model",
    "build_optimizer",
    "build_pipeline",
    "build_planner",
    "compile_blocks",
    "job_mesh",
    "lr_factor",
    "meta_model",
    "mp_policy",
    "new_model",
    "new_model_of",
    "optimizer_bytes",
    "transformer_blocks",
    "wrap_policy",
]

#: Betas of every Adam-style update (nanoGPT's choice for small GPTs).
BETAS = (0.9, 0.95)


def build_planner(cfg: TrainConfig) -> StructAwarePlanner:
    """The shard planner: the user's block policy, plus the optimizer's and the compression's
    blocks kept whole."""
    options = (
        {"max_preconditioner_dim": cfg.max_preconditioner_dim} if cfg.optimizer == "shampoo" else {}
    )
    return StructAwarePlanner(
        optimizer_type=cfg.optimizer,
        shard_policy=RaggedShard(block_size=cfg.parsed_block_size()),
        compression=cfg.comm_compression(),
        **options,
    )


def mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy | None:
    if cfg.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def new_model(cfg: TrainConfig, device: torch.device | str) -> nn.Module:
    """The run's model, unsharded: ``--hf-config``'s Hugging Face model, else ``--model``'s
    GPT; initialised from torch's global generator (on the meta device: not at all). With
    ``--lora-rank``: frozen, with adapters beside the blocks' linears (their base in NF4 with
    ``--base-weights nf4``)."""
    return new_model_of(cfg.model, cfg.hf_config, device, lora=cfg.to_dict())


def new_model_of(
    model: str,
    hf_config: str | Mapping[str, Any] | None,
    device: torch.device | str,
    *,
    lora: Mapping[str, Any] | None = None,
) -> nn.Module:
    """:func:`new_model` from the options a checkpoint's config records: the two that choose
    the model (``hf_config`` may be the config itself, :func:`raggedfsdp.models.hf.config_record`)
    and, in ``lora``, ``lora_rank``, ``base_weights`` and ``nf4_block_size`` if set."""
    if hf_config is not None:
        built = hf.build_hf_model(hf_config, device)
    else:
        built = GPT(GPT_CONFIGS[model], device=device)
    rank = (lora or {}).get("lora_rank")
    if rank is not None:
        assert lora is not None
        block = lora["nf4_block_size"] if lora.get("base_weights") == "nf4" else None
        apply_lora(built, transformer_blocks(built), rank, block)
    return built


def meta_model(cfg: TrainConfig) -> nn.Module:
    """The run's model on the meta device: its shapes, for plans and checks."""
    return new_model(cfg, "meta")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: its FSDP units below the root (a GPT's ``blocks``, an HF model's
    decoder layers; a pipeline's: its stages')."""
    if isinstance(model, StageSet):
        return [block for stage in model.stages for block in transformer_blocks(stage)]
    if hf.is_hf_model(model):
        return hf.decoder_layers(model)
    return cast(GPT, model).block_list()


def wrap_policy(model: nn.Module, *, stage: bool = False) -> WrapPolicy:
    """The units ``FSDPBackend`` and the planner take: the decoder layers of an HF model (an
    ``nn.ModuleList`` of experts, as older ``transformers`` build them, stays inside its
    layer), the default (each ``nn.ModuleList`` element) for a GPT; a pipeline ``stage``'s
    layers, whatever the model."""
    if not (stage or hf.is_hf_model(model)):
        return None
    layers = {id(m) for m in transformer_blocks(model)}
    return lambda module: id(module) in layers


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in backward. The block's ``forward`` is replaced on the
    instance (not wrapped in another module), so parameter names - and checkpoints - do not
    change; the FSDP hooks of the block still run around it and unshard before recomputation."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_blocks(blocks: list[nn.Module]) -> None:
    """``torch.compile`` each block, as torchtitan does, but its ``forward`` on the instance
    rather than the module in an ``OptimizedModule``: parameter names (and so checkpoints) stay
    those of the eager model, and the FSDP hooks, which the block's ``__call__`` runs around
    ``forward``, stay eager (they all-gather and reduce-scatter)."""
    for block in blocks:
        block.forward = torch.compile(block.forward)


def job_mesh(cfg: TrainConfig, world_size: int, rank: int = 0) -> JobMesh:
    """Where ``rank`` sits in the run's mesh of ``world_size`` ranks (``--tp``, ``--ep``,
    ``--pp``), the model checked on the meta device against it: a ``ValueError`` naming the
    fault, before any rank meets another."""
    cfg.check_world(world_size)
    mesh = JobMesh(world_size, rank, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp)
    if mesh.parallel:
        model = meta_model(cfg)
        if mesh.pp > 1:
            check_pipeline(model, mesh.pp, cfg.pp_schedule, cfg.model_name)
        check_model(model, mesh, cfg.model_name)
    return mesh


def _prepare_blocks(model: nn.Module, cfg: TrainConfig) -> None:
    """Activation checkpointing and ``--compile`` on the model's blocks, if asked."""
    blocks = transformer_blocks(model)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(blocks)
    if cfg.compile:
        compile_blocks(blocks)


def _fsdp_options(cfg: TrainConfig) -> dict[str, Any]:
    """What ``FSDPBackend`` takes from the config: the planner and the mixed precision."""
    return {"planner": build_planner(cfg), "mp_policy": mp_policy(cfg)}


def build_model(cfg: TrainConfig, device: torch.device, mesh: JobMesh | None = None) -> nn.Module:
    """The same model on every rank (seeded by ``cfg.seed``), split over ``mesh`` (default:
    FSDP over every rank of the process group) and sharded by raggedfsdp: each block (then the
    root), after activation checkpointing and ``--compile`` if asked. Needs the process
    group."""
    torch.manual_seed(cfg.seed)
    model = new_model(cfg, device)
    _prepare_blocks(model, cfg)
    shard_model(
        model,
        mesh or JobMesh(dist.get_world_size() if dist.is_initialized() else 1),
        device,
        wrap=wrap_policy(model),
        **_fsdp_options(cfg),
    )
    return model


def build_pipeline(cfg: TrainConfig, device: torch.device, mesh: JobMesh) -> Pipeline:
    """:func:`build_model`'s model cut into this rank's pipeline stages
    (:func:`~.stages.cut`), each prepared, split and sharded as that model is (over the
    stage's data-parallel ranks, no reshard after forward: torchtitan's setting under PP), under
    ``--pp-schedule``. Needs the process group."""
    from .pipeline import build_schedule  # torch's pipelining loads torch._dynamo: only under --pp

    torch.manual_seed(cfg.seed)
    model = new_model(cfg, device)
    device_mesh = device_mesh_of(mesh, device)
    mine = stage_indices(mesh.pp_rank, mesh.pp, cfg.pp_schedule)
    n_stages = mesh.pp * stages_per_rank(cfg.pp_schedule)
    stages = []
    for index in mine:
        stage = cut(model, index, n_stages)
        _prepare_blocks(stage, cfg)
        options = {"wrap": wrap_policy(stage, stage=True), "reshard_after_forward": False}
        shard_model(stage, mesh, device, device_mesh=device_mesh, **options, **_fsdp_options(cfg))
        stages.append(stage)
    return build_schedule(
        model,
        stages,
        mine,
        pp_mesh=device_mesh["pp"],
        schedule=cfg.pp_schedule,
        microbatches=cfg.pipeline_microbatches,
        device=device,
    )


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``--optimizer``, with weight decay on matrices only. Muon takes the
    blocks' matrices; embeddings and vectors go to its auxiliary AdamW. Every group records its
    peak learning rate as ``initial_lr`` (the schedule scales it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if p.dim() >= 2]
    vectors = [p for n, p in named if p.dim() < 2]
    decay = {"params": matrices, "weight_decay": cfg.weight_decay}
    no_decay = {"params": vectors, "weight_decay": 0.0}
    optimizer: torch.optim.Optimizer
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW([decay, no_decay], lr=cfg.lr, betas=BETAS)
    else:
        if cfg.optimizer == "muon":
            inside = {id(p) for block in transformer_blocks(model) for p in block.parameters()}
            in_blocks = [p for p in matrices if id(p) in inside]
            embeddings = [p for p in matrices if id(p) not in inside]
            optimizer = optim.Muon(
                [
                    {"params": in_blocks},
                    {"params": embeddings, "use_muon": False, "weight_decay": cfg.weight_decay},
                    {"params": vectors, "use_muon": False, "weight_decay": 0.0},
                ],
                lr=cfg.muon_lr,
                weight_decay=cfg.weight_decay,
                adamw_lr=cfg.lr,
                adamw_betas=BETAS,
            )
        elif cfg.optimizer == "shampoo":
            optimizer = optim.Shampoo(
                [decay, no_decay],
                lr=cfg.lr,
                betas=BETAS,
                max_preconditioner_dim=cfg.max_preconditioner_dim,
            )
        else:
            optimizer = optim.AdamW8bit([decay, no_decay], lr=cfg.lr, betas=BETAS)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier of step ``step`` (0-based): linear warm-up, then cosine decay to
    ``min_lr_ratio``. A function of the step alone, so resuming needs no scheduler state."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s state on this rank (a sharded entry counts its local piece)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            values = value if isinstance(value, (list, tuple)) else [value]
            pieces = [local_piece(v) for v in values if torch.is_tensor(v)]  # this rank's bytes
            total += sum(v.numel() * v.element_size() for v in pieces)
    return total
