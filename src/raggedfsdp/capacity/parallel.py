"""Tensor and expert parallelism as the capacity planner sees them: what each rank holds.

Which piece of each parameter one rank holds (rank 0's, ``torch.chunk``'s first: the largest when a
dimension does not divide), and the checks a ``(tp, ep)`` must pass before anything is planned. The
split and the mesh it assumes (torchtitan's) are the comment at :func:`split_model`. Pure Python
over shapes; no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..facts import (
    FUSED_EXPERTS,
    PER_HEAD,
    TP_PLAN,
    ParallelDims,
    TPStyle,
    check_cut,
    is_vision,
    tp_dim,
)
from ..layout import RaggedShard
from ..planner import WrapPolicy

__all__ = [
    "ModelSplit",
    "ParallelDims",
    "ParamSplit",
    "UnsplittableModel",
    "split_model",
    "token_embedding",
]


class UnsplittableModel(ValueError):
    """A ``(tp, ep)`` the model's shapes cannot take: no experts to split, a degree that does not
    divide its heads or experts, a policy block a split would cut, a matrix with no rule."""


@dataclass(frozen=True)
class ParamSplit:
    """One parameter under the split.

    Attributes:
        shape: the global tensor's.
        local: what one rank holds (rank 0's piece, the largest), ``None`` when it holds none
            (an expert of another ep rank).
        tp_dim: the dim split over tp; ``None``: replicated over tp.
        expert: a routed expert: split over ep (its stack's dim 0, or its module index).
    """

    shape: tuple[int, ...]
    local: tuple[int, ...] | None
    tp_dim: int | None
    expert: bool


@dataclass(frozen=True)
class ModelSplit:
    """A model under ``dims``: each parameter's :class:`ParamSplit`, its expert units, and what
    the communication model reads (:mod:`.parallel_comm`).

    Attributes:
        dims: the degrees.
        params: by fully qualified name (tied parameters once, as ``named_parameters``).
        expert_units: module paths of the expert containers (``...experts``): FSDP units of
            their own with ``ep > 1``, sharded over ``dp`` rather than ``dp x ep``.
        hidden: the model's hidden size (its first embedding's width).
        moe_layers: the layers with routed experts (one container each).
        experts_per_token: routed experts each token visits (0 without experts).
    """

    dims: ParallelDims
    params: Mapping[str, ParamSplit]
    expert_units: frozenset[str]
    hidden: int
    moe_layers: int
    experts_per_token: int
    #: ids of the FSDP units' modules with ``ep > 1`` (the blocks and expert containers)
    unit_ids: frozenset[int] = frozenset()

    @classmethod
    def whole(cls) -> ModelSplit:
        """No tensor or expert parallelism: every rank's pieces are the whole parameters (the
        buckets and units of plain FSDP; nothing here is looked up)."""
        return cls(ParallelDims(), {}, frozenset(), 0, 0, 0)

    @property
    def splits(self) -> bool:
        """Whether any parameter is split (``tp`` or ``ep`` above 1)."""
        return self.dims.model_parallel > 1

    def local_shape(self, name: str) -> tuple[int, ...] | None:
        """What one rank holds of ``name`` (``None``: nothing)."""
        return self.params[name].local

    def local(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        """The rank's piece of ``param`` as a meta tensor (the planner's
        :data:`~raggedfsdp.planner.bucketing.LocalPiece`)."""
        shape = self.local_shape(name)
        if shape is None:
            return None
        piece = torch.empty(shape, dtype=param.dtype, device="meta")
        return piece.requires_grad_(param.requires_grad)

    def wrap(self, module: nn.Module) -> bool:
        """The FSDP units with ``ep > 1``: the blocks and the expert containers."""
        return id(module) in self.unit_ids

    @property
    def wrap_policy(self) -> WrapPolicy:
        """:meth:`wrap`, or ``None`` (the default units) when no experts are split apart."""
        return self.wrap if self.unit_ids else None

    def fsdp_size(self, bucket_name: str, world_size: int) -> int:
        """The ranks bucket ``bucket_name`` is FSDP-sharded over at ``world_size``."""
        unit = bucket_name.rsplit("/", 3 if "/frozen/" in bucket_name else 2)[0]
        dims = self.dims.at_world(world_size)
        if unit in self.expert_units and dims.ep > 1:
            return dims.dp_shard_mod_ep
        return dims.dp_shard


def _expert_containers(module: nn.Module) -> dict[str, int]:
    """``path -> E`` of every module named ``experts`` holding routed experts: a fused stack
    (``[E, ...]`` parameters of its own) or ``E`` numbered expert modules."""
    found = {}
    for path, sub in module.named_modules():
        if path.rsplit(".", 1)[-1] != "experts":
            continue
        own = [p for p in sub.parameters(recurse=False) if p.dim() >= 2]
        count = own[0].shape[0] if own else len(list(sub.children()))
        if count:
            found[path] = int(count)
    return found


def _heads(module: nn.Module) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` of the model: the zoo's ``n_heads`` / ``n_kv_heads``
    attributes, a GPT config's ``n_head`` or a Hugging Face config's ``num_attention_heads`` /
    ``num_key_value_heads``; ``None`` if it says nothing."""
    cfg = getattr(module, "cfg", None)
    if hasattr(cfg, "n_head"):
        return int(cfg.n_head), int(cfg.n_head)
    config = getattr(module, "config", None)  # a Hugging Face model's (a VLM's: its text model's)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "num_attention_heads", None):
        heads = int(config.num_attention_heads)
        return heads, int(getattr(config, "num_key_value_heads", None) or heads)
    heads = getattr(module, "n_heads", None)
    if heads is None:
        return None
    return int(heads), int(getattr(module, "n_kv_heads", heads))


def token_embedding(module: nn.Module) -> nn.Embedding | None:
    """The model's token embedding: its first ``nn.Embedding`` outside a VLM's vision side
    (whose position and tile embeddings come first); ``None`` if it has none."""
    return next(
        (
            m
            for path, m in module.named_modules()
            if isinstance(m, nn.Embedding) and not is_vision(path)
        ),
        None,
    )


def _check_degrees(
    module: nn.Module, dims: ParallelDims, experts: Mapping[str, int], model: str
) -> None:
    """ep needs experts it divides, tp needs heads it divides: one line naming the fault."""
    if dims.ep > 1 and not experts:
        raise UnsplittableModel(
            f"ep={dims.ep}: {model} has no routed experts, so there is nothing for expert "
            f"parallelism to split; use ep=1 (or a mixture-of-experts model)"
        )
    for path, count in experts.items():
        if count % dims.ep:
            raise UnsplittableModel(
                f"ep={dims.ep} does not divide the {count} routed experts of {model} ({path!r}); "
                f"use an ep that divides {count}"
            )
    if dims.tp == 1:
        return
    heads = _heads(module)
    if heads is None:
        raise UnsplittableModel(
            f"tp={dims.tp}: {model} does not say how many attention heads it has (an n_heads "
            f"attribute, or cfg.n_head), so its tensor-parallel split cannot be checked"
        )
    for count, what in zip(heads, ("attention heads", "key/value heads"), strict=True):
        if count % dims.tp:
            raise UnsplittableModel(
                f"tp={dims.tp} does not divide the {count} {what} of {model}: tensor "
                f"parallelism gives each rank whole heads; use a tp that divides {count}"
            )


def _tp_dim(name: str, shape: tuple[int, ...], owner: nn.Module, vocab: bool) -> int | None:
    """The dim tp splits (:mod:`raggedfsdp.facts.tp_plan`), or ``None``: replicated.

    Raises:
        UnsplittableModel: a matrix no rule covers.
    """
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in FUSED_EXPERTS:
        return FUSED_EXPERTS[parts[-1]]
    if isinstance(owner, nn.Embedding):
        return 0 if vocab else None  # the vocabulary's rows; positions stay whole
    role = parts[-2] if len(parts) >= 2 and parts[-1] in ("weight", "bias") else parts[-1]
    style = TP_PLAN.get(role)
    if style is not None:
        return tp_dim(style, bias=parts[-1] == "bias")
    if role in PER_HEAD:
        return 0
    if len(shape) < 2:
        return None  # norms and vectors no rule names: replicated, as SequenceParallel keeps them
    named = {
        what: ", ".join(sorted(k for k, v in TP_PLAN.items() if v is style))
        for what, style in (
            ("column-parallel", TPStyle.COLWISE),
            ("row-parallel", TPStyle.ROWWISE),
            ("replicated", TPStyle.REPLICATE),
        )
    }
    raise UnsplittableModel(
        f"parameter {name!r} of shape {list(shape)}: no tensor-parallel rule for a module named "
        f"{role!r} ({'; '.join(f'{what}: {names}' for what, names in named.items())})"
    )


def _expert_index(name: str, experts: Mapping[str, int]) -> tuple[str, int | None] | None:
    """``(container, expert index)`` of an expert's parameter (index ``None`` in a fused
    stack), or ``None`` for a dense one (``shared_experts`` is dense)."""
    parts = name.split(".")
    for j, part in enumerate(parts[:-1]):
        container = ".".join(parts[: j + 1])
        if part == "experts" and container in experts:
            following = parts[j + 1]
            return container, int(following) if following.isdigit() else None
    return None


def _local_shape(
    shape: tuple[int, ...],
    tp_dim: int | None,
    expert: tuple[str, int | None] | None,
    dims: ParallelDims,
    count: int,
) -> tuple[int, ...] | None:
    """Rank 0's piece: ``ceil(n / tp)`` of the tp dim, ``E / ep`` of a stack's experts, and
    no piece of another ep rank's expert module."""
    local = list(shape)
    if expert is not None:
        _, index = expert
        if index is None and shape:
            local[0] = shape[0] // dims.ep
        elif index is not None and index >= count // dims.ep:
            return None
    if tp_dim is not None and local:
        local[tp_dim] = -(-local[tp_dim] // dims.tp)
    return tuple(local)


# The split is torchtitan's plan as :mod:`raggedfsdp.facts.tp_plan` writes it (column-, row-,
# vocabulary-parallel or whole, by module name), which the job's ``models/tensor_parallel.py``
# builds its plans from too; **routed experts** are ``Shard(0)`` over ``ep`` on the expert dimension
# (fused stacks ``[E, ...]``, or the first ``E / ep`` of the ``experts.<i>`` modules), and within an
# expert the same column/row split over ``tp`` (torchtitan's ``ExpertTensorParallel``). The dense
# parts of a mixture-of-experts model (attention, shared experts, dense layers) split as Llama's. No
# split may cut a block of the shard policy (:mod:`raggedfsdp.facts.cuts`, the rule ``fully_shard``
# applies).
#
# **The mesh** (:class:`~raggedfsdp.facts.ParallelDims`: torchtitan's with ``etp = tp``, "partial dp
# -> ep"): ``world = dp_shard x tp`` with the ``tp`` ranks innermost (consecutive: inside a node up
# to 8), and expert parallelism borrows from ``dp_shard = dp x ep``. Dense parameters are
# FSDP-sharded over ``dp_shard = world / tp`` ranks, routed experts over ``dp_shard_mod_ep = world /
# (tp x ep)``, and with ``ep > 1`` each layer's experts are an FSDP unit of their own (torchtitan's
# ``apply_fsdp`` shards ``moe.experts`` on the ``dp_shard_mod_ep`` mesh). torchtitan's default ``etp
# = 1``, where ``ep`` borrows the ``tp`` ranks too and experts are not tensor-parallel, is not
# modelled.
def split_model(
    module: nn.Module,
    dims: ParallelDims,
    *,
    policy: RaggedShard | None = None,
    experts_per_token: int | None = None,
    model_name: str | None = None,
) -> ModelSplit:
    """``module``'s parameters under ``dims`` (best on the meta device).

    Args:
        policy: the shard policy whose blocks no split may cut (default: element: any cut).
        experts_per_token: routed experts per token (the all-to-alls' tokens).
        model_name: how errors name the model (default: its class).

    Raises:
        UnsplittableModel: ``ep > 1`` without experts, a degree that does not divide the
            experts or heads, a matrix with no rule, a split that cuts a policy block.
    """
    model = model_name or type(module).__name__
    for name in ("dp_replicate", "cp", "pp"):
        if getattr(dims, name) != 1:
            raise UnsplittableModel(
                f"{name}={getattr(dims, name)}: the capacity planner models FSDP beside tensor "
                f"and expert parallelism only; use {name}=1"
            )
    experts = _expert_containers(module)
    _check_degrees(module, dims, experts, model)
    policy = policy or RaggedShard()
    owners = dict(module.named_modules())
    embedding = token_embedding(module)
    params = {}
    for name, p in module.named_parameters():
        shape = tuple(p.shape)
        owner = owners[name.rpartition(".")[0]]
        expert = _expert_index(name, experts)
        split_dim = None
        if dims.tp > 1 and not is_vision(name):  # a vision tower stays whole over tp
            split_dim = _tp_dim(name, shape, owner, owner is embedding)
            if split_dim is not None:
                by = f"tensor parallelism (tp={dims.tp})"
                check_cut(name, shape, split_dim, dims.tp, policy, by=by, error=UnsplittableModel)
        count = experts[expert[0]] if expert else 0
        if expert and expert[1] is None and dims.ep > 1:
            by = f"expert parallelism (ep={dims.ep})"
            check_cut(name, shape, 0, dims.ep, policy, by=by, error=UnsplittableModel)
        local = _local_shape(shape, split_dim, expert, dims, count)
        params[name] = ParamSplit(shape, local, split_dim, expert is not None)
    return ModelSplit(
        dims=dims,
        params=params,
        expert_units=frozenset(experts),
        hidden=embedding.embedding_dim if embedding is not None else 0,
        moe_layers=len(experts),
        experts_per_token=(experts_per_token or 0) if experts else 0,
        unit_ids=_unit_ids(module, experts) if dims.ep > 1 else frozenset(),
    )


def _unit_ids(module: nn.Module, experts: Mapping[str, int]) -> frozenset[int]:
    """The default units (every ``nn.ModuleList`` element) and the expert containers."""
    blocks = {id(c) for sub in module.modules() if isinstance(sub, nn.ModuleList) for c in sub}
    containers = {id(m) for path, m in module.named_modules() if path in experts}
    return frozenset(blocks | containers)
