"""Pipeline parallelism in the job (``--pp``): the model cut into stages, and torch's schedules.

Each stage is sharded by raggedfsdp inside torch's ``PipelineStage``. How stages are cut: the
comment at :func:`cut`; the schedules, and what a step measures: docs/pipeline.md ("In the job").
The settings are torchtitan's: no reshard after forward, the loss divided by the micro-batches per
micro-batch, ``scale_grads=False``.
"""

from __future__ import annotations

import contextlib
import copy
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor, Shard

from .._host import synchronize
from ..facts import is_looped, schedule_class, stages_per_rank
from ..models import GPT, hf
from ..tensor import local_piece, shard_info
from . import health

__all__ = ["Pipeline", "StageSet", "build_schedule", "check_pipeline", "cut", "stage_layers"]

# ---------------------------------------------------------------------------------------------
# Cutting the model.


@dataclass(frozen=True)
class _Parts:
    """Where a model's layers sit, and what only its first or last stage holds (paths)."""

    layers_owner: str  # the module whose attribute ``layers_attr`` holds the layers
    layers_attr: str
    first: tuple[str, ...]
    last: tuple[str, ...]


_GPT_PARTS = _Parts("", "blocks", ("tok_emb", "pos_emb"), ("ln_f", "head"))
_HF_PARTS = _Parts("model", "layers", ("model.embed_tokens",), ("model.norm", "lm_head"))
#: What a Llama-style Hugging Face causal LM must have for :func:`_hf_stage_forward`.
_HF_NEEDS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


def _parts(model: nn.Module) -> _Parts:
    return _GPT_PARTS if isinstance(model, GPT) else _HF_PARTS


def _layers(model: nn.Module) -> nn.Module:
    parts = _parts(model)
    return getattr(model.get_submodule(parts.layers_owner), parts.layers_attr)


def _check_hf(model: nn.Module, name: str) -> None:
    """``ValueError`` unless the Hugging Face model is a Llama-style causal LM the stages can
    run: embedding, decoder layers, norm, rotary embedding, head, and attention that is causal
    without a mask (``sdpa``)."""
    config: Any = getattr(model, "config", None)
    if hf.is_vlm(config):
        raise ValueError(
            f"pp: {name} is a vision-language model, which the job cannot cut into pipeline "
            f"stages yet; train it without --pp"
        )
    missing = [path for path in _HF_NEEDS if not _has(model, path)]
    if missing or not isinstance(_layers(model), nn.ModuleList):
        raise ValueError(
            f"pp: {name} ({type(model).__name__}) cannot be cut into pipeline stages: the job "
            f"cuts Llama-style causal LMs (model.embed_tokens, model.layers, model.norm, "
            f"model.rotary_emb, lm_head); it lacks {', '.join(missing) or 'a list of layers'}"
        )
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention != "sdpa":
        raise ValueError(
            f"pp: {name} uses {attention!r} attention; a pipeline stage runs its layers without "
            f"a mask, causal only under 'sdpa'"
        )


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_pipeline(model: nn.Module, pp: int, schedule: str, name: str) -> None:
    """``ValueError`` naming the fault unless ``model`` (on any device, meta too) can be cut
    into the ``pp x stages_per_rank(schedule)`` stages of the run: a GPT or a Llama-style
    Hugging Face causal LM, whose layers the stages divide. Before any rank meets another."""
    if not isinstance(model, GPT):
        _check_hf(model, name)
    stages = pp * stages_per_rank(schedule)
    layers = len(_layers(model))
    if layers % stages:
        per = stages_per_rank(schedule)
        how = f" ({pp} x {per} per rank, {schedule})" if per > 1 else ""
        fix = f"--pp whose {per} x pp stages divide" if per > 1 else "--pp that divides"
        raise ValueError(
            f"pp: {name} has {layers} layers, which {stages} pipeline stages{how} do not "
            f"divide; each stage holds an equal share: use a {fix} {layers}"
        )


# How stages are cut (torchtitan's way): a copy of the whole model per stage keeps the stage's
# share of the layers under their own names (an ``nn.ModuleDict`` keyed by their indices in place of
# the list), the embedding with the first stage and the final norm and head with the last; what a
# stage lacks is ``None`` and its forward skips it. State-dict keys, optimizer-state names and
# checkpoints are the whole model's, so a checkpoint moves between pp degrees. A weight tied across
# stages (GPT's head and embedding) is one parameter per stage: :class:`_Tie` keeps them one.
def cut(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of ``model`` (a GPT or a model :func:`check_pipeline`
    passed): a copy holding the stage's layers and parts (comment above)."""
    parts = _parts(model)
    part = copy.deepcopy(model)
    owner = part.get_submodule(parts.layers_owner)
    layers = getattr(owner, parts.layers_attr)
    kept = {str(i): layers[i] for i in _stage_range(len(layers), stage, stages)}
    setattr(owner, parts.layers_attr, nn.ModuleDict(kept))
    dropped = (parts.first if stage else ()) + (parts.last if stage != stages - 1 else ())
    for path in dropped:
        parent, _, attr = path.rpartition(".")
        setattr(part.get_submodule(parent), attr, None)
    if not isinstance(part, GPT):
        part.forward = types.MethodType(_hf_stage_forward, part)  # type: ignore[method-assign]
    return part


def _stage_range(layers: int, stage: int, stages: int) -> range:
    """The layers stage ``stage`` of ``stages`` holds: an equal share (:func:`check_pipeline`
    refuses a count the stages do not divide)."""
    per = layers // stages
    return range(stage * per, (stage + 1) * per)


def _hf_stage_forward(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A Hugging Face stage's forward: token ids (first stage) or the residual stream in, the
    residual stream or the logits (last stage) out; each layer as the model's own forward
    calls it, with the rotary embedding of the positions and no mask (causal under sdpa)."""
    inner: Any = self.model
    if inner.embed_tokens is not None:
        h = inner.embed_tokens(h)
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    rotary = inner.rotary_emb(h, position_ids=positions)
    for layer in inner.layers.values():
        out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        h = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
    lm_head: Any = self.lm_head  # type: ignore[union-attr]
    return h if lm_head is None else lm_head(inner.norm(h))


def stage_layers(stage: nn.Module) -> list[nn.Module]:
    """The layers a stage holds, in order: its FSDP units."""
    return list(_layers(stage).values())


# ---------------------------------------------------------------------------------------------
# The stages a rank holds, as one model.


def _merge(modules: Sequence[nn.Module]) -> nn.Module:
    """One module whose children are those of ``modules`` (the same objects), a child that
    several hold merged again: the stages' trees laid over each other."""
    if len(modules) == 1:
        return modules[0]
    merged = nn.ModuleDict() if isinstance(modules[0], nn.ModuleDict) else nn.Module()
    names = dict.fromkeys(n for m in modules for n, c in m.named_children() if c is not None)
    for name in names:
        held = [c for m in modules if (c := getattr(m, name, None)) is not None]
        own = [c for c in held if next(c.parameters(recurse=False), None) is not None]
        # A module with parameters of its own is one stage's; one without (a rotary
        # embedding's copies, a container) is merged or taken from the first stage.
        merged.add_module(name, own[0] if own else _merge(held))
    return merged


class StageSet(nn.Module):
    """The stages one rank holds as one model for what the job does with a model outside the
    schedule: ``named_parameters`` and ``state_dict`` under the whole model's names (the
    optimizer, checkpoints, the finiteness checks), the runtime's ``stats`` summed over the
    stages. The stages themselves run in the schedule. ``copies``: the ids of tied weights'
    copies (:class:`_Tie`), which ``named_parameters`` leaves out (each weight once: the
    optimizer updates the owner, whose values reach the copies)."""

    def __init__(self, stages: Sequence[nn.Module], copies: set[int] | None = None) -> None:
        super().__init__()
        self._stages = list(stages)  # a plain list: not children, so no names of their own
        self._copies = set(copies or ())
        merged = _merge(self._stages)
        for name, child in merged.named_children():
            self.add_module(name, child)

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(p) not in self._copies:
                yield name, p

    @property
    def stages(self) -> list[nn.Module]:
        return self._stages

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Every stage's ``state_dict()`` (through its own hooks), merged: the whole model's
        keys of what this rank holds."""
        out: dict[str, Any] = {}
        for stage in self._stages:
            out.update(stage.state_dict(*args, **kwargs))
        return out

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        """Each stage loads its own keys of ``state``."""
        for stage in self._stages:
            mine = stage.state_dict().keys()
            stage.load_state_dict({k: state[k] for k in mine}, strict=strict, assign=assign)

    def stats(self) -> dict[str, float]:
        """The stages' runtime counters summed (peaks: the largest)."""
        out: dict[str, float] = {}
        for stage in self._stages:
            for key, value in stage.stats().items():  # type: ignore[operator]
                peak = key.startswith("process_peak") or key.startswith("cuda_max")
                out[key] = max(out.get(key, 0), value) if peak else out.get(key, 0) + value
        return out

    def reset_stats(self) -> None:
        for stage in self._stages:
            stage.reset_stats()  # type: ignore[operator]

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("the stages of a pipeline run in its schedule, not as one model")


# ---------------------------------------------------------------------------------------------
# Weights tied across stages.


@dataclass
class _Tie:
    """One weight the whole model ties (GPT's embedding and head), held by several stages: the
    first holder's parameter is the weight (the optimizer's), the others are copies. After
    backward every holder's gradient is summed into the owner's; after the update the owner's
    values go to the copies. Whole tensors over ``group`` (the ranks of this data and tensor
    coordinate that hold it; None: this rank alone): the holders' shards need not match."""

    owner: torch.Tensor | None
    copies: list[torch.Tensor]
    group: dist.ProcessGroup | None
    owner_rank: int  # the global rank that holds the owner

    @torch.no_grad()
    def sum_grads(self) -> None:
        held = [p for p in [self.owner, *self.copies] if p is not None]
        total = torch.zeros(held[0].shape, dtype=held[0].dtype, device=held[0].device)
        for p in held:
            if p.grad is not None:
                total += _whole(p.grad)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        if self.owner is not None:
            if self.owner.grad is None:
                self.owner.grad = torch.zeros_like(self.owner)
            _set_piece(self.owner.grad, self.owner, total)
        for p in self.copies:
            p.grad = None  # counted once, in the owner's (clipping, the optimizer)

    @torch.no_grad()
    def copy_weights(self) -> None:
        held = self.owner if self.owner is not None else self.copies[0]
        value = _whole(held)
        if self.group is not None:
            dist.broadcast(value, src=self.owner_rank, group=self.group)
        for p in self.copies:
            _set_piece(p, p, value)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole, a fresh tensor (a collective over its shard group when sharded)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _set_piece(target: torch.Tensor, like: torch.Tensor, whole: torch.Tensor) -> None:
    """Write this rank's piece of ``whole`` into ``target``, placed as ``like``: its tensor-
    parallel slice (``Shard``: torch's chunks), then its ragged shard of that."""
    piece = whole
    if isinstance(like, DTensor):
        mesh, coordinate = like.device_mesh, like.device_mesh.get_coordinate() or []
        for dim, placement in enumerate(like.placements):
            if isinstance(placement, Shard):
                piece = piece.chunk(mesh.size(dim), placement.dim)[coordinate[dim]]
    info = shard_info(like)
    if info is not None:
        piece = info.layout.to_local(piece, info.rank)
    local_piece(target).copy_(piece.reshape(local_piece(target).shape))


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several names, in order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _ties(
    model: nn.Module,
    stages: list[nn.Module],
    mine: list[int],
    n_stages: int,
    pp_mesh: DeviceMesh,
) -> list[_Tie]:
    """The ties of ``model`` its stages split (each stage holds one of the names), and this
    rank's part of each; every rank makes the same groups (a collective)."""
    out = []
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    ranks = tuple(dist.get_process_group_ranks(pp_mesh.get_group()))  # this pipeline's ranks
    for names in _tied_names(model):
        holders = [s for s in range(n_stages) if _holds(model, names, s, n_stages)]
        if len(holders) < 2:
            continue  # one stage holds every name: still one parameter
        owner_stage = holders[0]
        pp_ranks = sorted({s % pp for s in holders})
        group = None
        if len(pp_ranks) > 1:
            for coordinate in _pp_groups(pp_mesh):  # every rank creates every group
                new = dist.new_group([coordinate[r] for r in pp_ranks])
                if coordinate == ranks:
                    group = new
        params = [
            (index, _param_by_names(stage, names))
            for index, stage in zip(mine, stages, strict=True)
            if index in holders
        ]
        if not params and pp_rank not in pp_ranks:
            continue
        owner = next((p for i, p in params if i == owner_stage), None)
        copies = [p for i, p in params if i != owner_stage]
        out.append(_Tie(owner, copies, group, ranks[owner_stage % pp]))
    return out


def _pp_groups(pp_mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """The global ranks of every pipeline (one per data and tensor coordinate), each in
    stage order: the same list on every rank."""
    mine = tuple(dist.get_process_group_ranks(pp_mesh.get_group()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted(set(everyone))


def _holds(model: nn.Module, names: list[str], stage: int, stages: int) -> bool:
    """Whether stage ``stage`` holds one of ``names`` (the whole model's names)."""
    parts = _parts(model)
    layers = f"{parts.layers_owner}.{parts.layers_attr}.".lstrip(".")
    held = _stage_range(len(_layers(model)), stage, stages)
    for name in names:
        if name.startswith(layers):
            if int(name[len(layers) :].split(".", 1)[0]) in held:
                return True
        elif any(name.startswith(p + ".") for p in parts.first):
            if stage == 0:
                return True
        elif any(name.startswith(p + ".") for p in parts.last):
            if stage == stages - 1:
                return True
        else:
            return True  # neither a layer's nor the ends': every stage holds it
    return False


def _param_by_names(stage: nn.Module, names: list[str]) -> torch.Tensor:
    held = dict(stage.named_parameters(remove_duplicate=False))
    return next(held[n] for n in names if n in held)


# ---------------------------------------------------------------------------------------------
# The schedule and one step.


class _TimedStage(PipelineStage):
    """torch's ``PipelineStage``, timing the compute it runs for the schedule: each chunk's
    forward, backward and (zero-bubble) weight backward, the device synchronised after each,
    so that the rest of a step is the stage's idle time (its bubble)."""

    busy_s: float = 0.0

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.busy_s += time.perf_counter() - started

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().backward_weight_one_chunk(*args, **kwargs)


@dataclass
class Pipeline:
    """This rank's stages under their schedule: one step's forward and backward, the loss,
    the ties, the evaluation, and what the step measured."""

    model: StageSet
    indices: list[int]
    n_stages: int
    schedule: Any
    stages: list[_TimedStage]
    pp_mesh: DeviceMesh
    ties: list[_Tie] = field(default_factory=list)
    span_s: float = 0.0
    """Seconds of the last :meth:`forward_backward` (the schedule's step)."""

    @property
    def first(self) -> bool:
        return 0 in self.indices

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.indices

    @property
    def busy_s(self) -> float:
        """Seconds this rank's stages computed in the last step (forward and backward)."""
        return sum(stage.busy_s for stage in self.stages)

    def _run(self, batch: Sequence[torch.Tensor], *, train: bool) -> torch.Tensor:
        x, y = batch
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        target = y if self.last else None
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses if self.last else None)
        if not self.last:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    def forward_backward(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batch`` (``(x, y)`` on the device)
        under the schedule; this rank's summed loss (the last stage's; 0 elsewhere). Gradients
        are reduced once per unit (the schedule's end), the tied ones summed."""
        for stage in self.stages:
            stage.busy_s = 0.0
        started = time.perf_counter()
        loss = self._run(batch, train=True)
        synchronize(batch[0].device)
        self.span_s = time.perf_counter() - started
        for tie in self.ties:
            tie.sum_grads()
        return loss

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean loss over the last stage's ranks, on every rank (a collective): the
        world's mean of ``pp x`` each rank's (0 off the last stage), non-finite anywhere
        making it ``nan`` everywhere."""
        return health.global_loss(loss * self.pp_mesh.size())

    def after_update(self) -> None:
        """The copies of tied weights take the updated values."""
        for tie in self.ties:
            tie.copy_weights()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Sequence[torch.Tensor]], device: torch.device) -> float:
        """Mean loss over ``batches`` (forward only, under the schedule) and the data ranks."""
        total = torch.zeros((), device=device)
        for batch in batches:
            total += self._run([t.to(device) for t in batch], train=False)
        return self.global_loss(total) / len(batches)


def build_schedule(
    model: nn.Module,
    stages: list[nn.Module],
    mine: list[int],
    *,
    pp_mesh: DeviceMesh,
    schedule: str,
    microbatches: int,
    device: torch.device,
) -> Pipeline:
    """The :class:`Pipeline` of this rank's sharded ``stages`` (indices ``mine``) of
    ``model`` (the unsharded whole, for its ties) under ``schedule``, torchtitan's settings."""
    n_stages = pp_mesh.size() * stages_per_rank(schedule)
    group = pp_mesh.get_group()
    timed = [
        _TimedStage(stage, index, n_stages, device, group=group)
        for stage, index in zip(stages, mine, strict=True)
    ]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return hf.mean_token_loss(logits, targets) / microbatches

    cls = getattr(schedules, schedule_class(schedule))
    options = {"n_microbatches": microbatches, "loss_fn": loss_fn, "scale_grads": False}
    run = cls(timed, **options) if is_looped(schedule) else cls(timed[0], **options)
    ties = _ties(model, stages, mine, n_stages, pp_mesh)
    copies = {id(p) for tie in ties for p in tie.copies}
    return Pipeline(StageSet(stages, copies), mine, n_stages, run, timed, pp_mesh, ties)
