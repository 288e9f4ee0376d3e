"""What the capacity planner reads from a model's shapes: its units, their FLOPs and activations.

Pure Python over parameter shapes (models on the meta device): a model's FSDP units, how much each
one computes per token, and how many activation elements it keeps for backward. The rules, stated
once, are the comment at :func:`model_shape`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..planner import WrapPolicy, model_buckets
from .parallel import ModelSplit, token_embedding
from .units import unit_path

__all__ = ["EXPERTS_PER_TOKEN", "ModelShape", "UnitShape", "model_shape"]

#: Routed experts each token visits, for the zoo's mixture-of-experts models (``config.json``:
#: DeepSeek-V3 ``num_experts_per_tok`` 8, gpt-oss-120b ``num_experts_per_tok`` 4,
#: DeepSeek-V2-Lite ``num_experts_per_tok`` 6), in either layout.
EXPERTS_PER_TOKEN: dict[str, int] = {
    "deepseek-v3-671b": 8,
    "deepseek-v3-671b-experts": 8,
    "gpt-oss-120b": 4,
    "gpt-oss-120b-experts": 4,
    "deepseek-v2-lite": 6,
}

_EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")


@dataclass(frozen=True)
class UnitShape:
    """One FSDP unit (``path`` ``""`` is the root).

    Attributes:
        path: the unit's module path.
        param_numel: elements of the parameters it holds (not those of nested units).
        matmul_numel: matrix elements each token is multiplied by (experts weighted by use).
        activation_per_token: elements a block keeps for backward per token (0 for the root,
            whose activations :class:`ModelShape` states separately).
        widest_per_token: the widest projection output per token (a block's largest
            intermediate: the MLP's hidden width).
        is_block: whether it is a transformer block: a unit directly under the root (attention
            FLOPs; its input is what checkpointing keeps). A unit nested in one (an expert made
            a unit of its own) computes and keeps activations as part of its block.
    """

    path: str
    param_numel: int
    matmul_numel: float
    activation_per_token: float
    widest_per_token: int
    is_block: bool


@dataclass(frozen=True)
class ModelShape:
    """A model as the capacity planner sees it: units in the order ``plan_model`` plans them
    (nested units first, the root last)."""

    hidden: int
    vocab: int
    units: tuple[UnitShape, ...]
    #: elements of an embedding shared with the output head (0 if untied): its gradient from the
    #: head waits, whole, until the embedding's adds to it at the end of backward
    tied_numel: int = 0

    @property
    def blocks(self) -> tuple[UnitShape, ...]:
        return tuple(u for u in self.units if u.is_block)

    @property
    def root(self) -> UnitShape:
        return self.units[-1]

    @property
    def inner(self) -> tuple[UnitShape, ...]:
        """Every unit but the root: the blocks and the units nested in them."""
        return self.units[:-1]

    def block_activation_per_token(self, block: UnitShape) -> float:
        """What ``block`` keeps per token, its nested units included."""
        inside = block.path + "."
        return sum(
            u.activation_per_token
            for u in self.inner
            if u.path == block.path or u.path.startswith(inside)
        )

    def forward_flops_per_token(self, unit: UnitShape, seq_len: int) -> float:
        """Forward FLOPs per token of ``unit`` (backward is twice this)."""
        attention = 2 * seq_len * self.hidden if unit.is_block else 0
        return 2 * unit.matmul_numel + attention

    def step_flops(self, tokens: int, seq_len: int, *, checkpointing: bool = False) -> float:
        """FLOPs of one training step over ``tokens`` tokens: forward, backward (twice the
        forward) and, with activation checkpointing, the blocks' forward once more."""
        total = 0.0
        for unit in self.units:
            forward = self.forward_flops_per_token(unit, seq_len) * tokens
            total += 3 * forward + (forward if checkpointing and unit is not self.root else 0)
        return total


#: Projections that read the input their sibling projections of one module read: queries, keys
#: and values (DeepSeek's low-rank query and key-value inputs), a gated feed-forward's two input
#: projections. The block keeps that input once.
_SHARED_INPUT = frozenset(
    {
        *("q_proj", "k_proj", "v_proj", "wq", "wk", "wv"),
        *("wq_a", "wkv_a", "q_a_proj", "kv_a_proj_with_mqa"),
        *("gate_proj", "up_proj", "w1", "w3"),
    }
)


def _shared_input(name: str, shape: tuple[int, ...]) -> tuple[str, int] | None:
    """``(module, width)`` of the input a sibling projection may have counted already (a
    ``Linear``'s weight, or a fused stack of experts ``[E, out, in]`` named by its role), or
    ``None`` for a matrix whose input is its own."""
    parts = name.split(".")
    named_weight = len(parts) >= 2 and parts[-1] == "weight"
    role, module = (parts[-2], parts[:-2]) if named_weight else (parts[-1], parts[:-1])
    if role not in _SHARED_INPUT:
        return None
    return ".".join(module), shape[-1]


def _matrix_terms(
    name: str,
    shape: tuple[int, ...],
    expert_counts: Mapping[str, int],
    experts_per_token: int,
    counted: bool = False,
) -> tuple[float, float, int]:
    """(matmul elements, activation elements, output width) per token of one parameter of
    two or more dimensions (the activation: its output, and its input unless ``counted``
    already by a sibling projection)."""
    if len(shape) == 3:  # a fused stack of E experts [E, out, in]
        share = experts_per_token / shape[0]
        return (
            share * math.prod(shape),
            experts_per_token * (shape[1] + (0 if counted else shape[2])),
            max(shape[1], shape[2]),
        )
    match = _EXPERT_RE.search(name)
    share = 1.0
    if match is not None:
        share = experts_per_token / expert_counts[name[: match.start()]]
    rows, cols = shape[0], math.prod(shape[1:])
    return share * rows * cols, share * (rows + (0 if counted else cols)), rows


def _expert_counts(names: list[str]) -> dict[str, int]:
    """Experts held as separate modules: ``prefix -> count`` of the ``experts.<i>`` under it."""
    found: dict[str, set[str]] = {}
    for name in names:
        match = _EXPERT_RE.search(name)
        if match is not None:
            found.setdefault(name[: match.start()], set()).add(match.group(1))
    return {prefix: len(indices) for prefix, indices in found.items()}


def _params_by_unit(
    module: nn.Module, wrap: WrapPolicy
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Each FSDP unit's parameters (name, parameter) by unit path (``""``: the root)."""
    by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for bucket in model_buckets(module, wrap=wrap):
        by_unit.setdefault(unit_path(bucket.name), []).extend(bucket.params.items())
    return by_unit


# The rules, stated once:
#
# - **hidden size** ``d`` and **vocabulary** ``V``: the token embedding's dimensions (the first
#   ``nn.Embedding`` outside a VLM's vision side).
# - **matmul elements per token** of a unit: every weight of two or more dimensions except
#   embeddings (one tied to the output head counts once, as the head), each a ``[out, in]`` matrix
#   applied once per token; a routed expert (a 3-D stack ``[E, a, b]`` or a module under
#   ``experts.<i>``) counts ``experts_per_token / E`` of it, since only that share of the experts
#   sees a token.
# - **FLOPs per token** of a unit: ``2 x`` its matmul elements forward (multiply and add), twice
#   that backward; attention adds ``2 T d`` forward per block (``Q Kᵀ`` and ``A V``, ``2 T d`` each,
#   halved by the causal mask) for sequence length ``T``.
# - **activations** kept per token by a block (no activation checkpointing, flash attention, no
#   dropout): ``sum over its matrices of (in + out)`` elements, each projection's input and output
#   (an output projection's output standing for the residual sum it is added into). For the plain
#   GPT block that is ``16 d``, exactly what it keeps: ``ln1`` (d), ``q k v`` (3d), the attention
#   output (d), the residual sum (d), ``ln2`` (d), ``fc`` (4d), GELU (4d), the next residual sum
#   (d). Projections that read one input (queries, keys and values; a gated feed-forward's two input
#   projections) count it once. Per-token statistics (LayerNorm mean and rstd, the attention's
#   log-sum-exp: under 0.5% of the total) are left out. With activation checkpointing a block keeps
#   only its input, ``d`` per token, and recomputes the rest in its backward.
# - **under tensor and expert parallelism** (a :class:`~.parallel.ModelSplit`): the matmul elements
#   are the rank's own pieces' (a replicated matrix whole, a split one ``1 / tp``; its ``E / ep``
#   experts see ``k / (E / ep)`` of its tokens each, the same work as before); the activations, the
#   widest projection, the hidden size and the vocabulary of the loss are the whole model's over
#   ``tp``, a first-order model: exact for sequence parallelism, where every activation is split
#   over tp (Korthikanti et al. 2022, eq. 2: ``sbh (34 / t + 5 a s / (h t))``; without it the norms'
#   inputs and the residual stream, ``10 sbh`` of Megatron's ``34``, stay whole). A tied embedding's
#   gradient is the rank's vocabulary slice.
def model_shape(
    module: nn.Module,
    *,
    experts_per_token: int | None = None,
    wrap: WrapPolicy = None,
    split: ModelSplit | None = None,
) -> ModelShape:
    """The :class:`ModelShape` of ``module`` (best on the meta device).

    Args:
        module: a transformer with an ``nn.Embedding`` and its blocks in an ``nn.ModuleList``
            (or the units ``wrap`` picks).
        experts_per_token: routed experts per token, needed when the model has experts.
        wrap: the FSDP units, as for :func:`~raggedfsdp.planner.model_buckets` (``None`` with
            ``split``: its units).
        split: what one rank holds under tensor and expert parallelism (module doc); ``None``:
            the whole model.

    Raises:
        ValueError: no embedding, or experts without ``experts_per_token``.
    """
    embedding = token_embedding(module)
    if embedding is None:
        raise ValueError(
            f"{type(module).__name__} has no nn.Embedding: the capacity planner reads the hidden "
            f"size and vocabulary from it"
        )
    # An embedding is a lookup, no matmul; tied to the output head it is one (counted once).
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    lookups = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights
    }
    by_unit = _params_by_unit(
        module, wrap if wrap is not None or split is None else split.wrap_policy
    )
    # Experts counted over the whole model: each may be an FSDP unit of its own.
    named = list(module.named_parameters())
    counts = _expert_counts([n for n, _ in named])
    if (counts or any(p.dim() == 3 for _, p in named)) and experts_per_token is None:
        raise ValueError(
            f"{type(module).__name__} has routed experts: give experts_per_token (how many "
            f"experts each token visits)"
        )
    pieces = _Pieces(split, counts, named, experts_per_token or 1)
    units = [
        _unit_shape(path, params, by_unit, lookups, pieces) for path, params in by_unit.items()
    ]
    tied = embedding.weight.numel() if id(embedding.weight) in linear_weights else 0
    hidden, vocab = embedding.embedding_dim, embedding.num_embeddings
    if split is not None:
        tp = split.dims.tp
        hidden, vocab = -(-hidden // tp), -(-vocab // tp)
        tied = math.prod(pieces.local(embedding.weight)) if tied else 0
    return ModelShape(hidden, vocab, tuple(units), tied)


def _unit_shape(
    path: str,
    params: list[tuple[str, nn.Parameter]],
    by_unit: Mapping[str, object],
    lookups: set[int],
    pieces: _Pieces,
) -> UnitShape:
    """One unit's :class:`UnitShape` from its parameters (``lookups``: embeddings that are no
    matmul)."""
    matmul = activation = 0.0
    widest = 0
    inputs: set[tuple[str, int]] = set()  # inputs that sibling projections counted
    for name, p in params:
        if p.dim() >= 2 and id(p) not in lookups:
            shared = _shared_input(name, tuple(p.shape))
            m, a, out = pieces.terms(name, tuple(p.shape), counted=shared in inputs)
            matmul, activation, widest = matmul + m, activation + a, max(widest, out)
            if shared is not None:
                inputs.add(shared)
    nested = any(path.startswith(other + ".") for other in by_unit if other)
    return UnitShape(
        path=path,
        param_numel=sum(p.numel() for _, p in params),
        matmul_numel=matmul,
        activation_per_token=activation if path else 0.0,
        widest_per_token=widest,
        is_block=bool(path) and not nested,
    )


class _Pieces:
    """Each matrix's per-token terms (:func:`_matrix_terms`) on one rank: the matmul of its
    local piece (the experts the rank holds counted among themselves), the activations and
    output width of the whole matrix over ``tp`` (module doc); the whole model without a
    split."""

    def __init__(
        self,
        split: ModelSplit | None,
        counts: Mapping[str, int],
        named: list[tuple[str, nn.Parameter]],
        experts_per_token: int,
    ) -> None:
        self.split, self.counts, self.k = split, counts, experts_per_token
        self.names = {id(p): n for n, p in named}
        held = [n for n, _ in named if split is None or split.local_shape(n) is not None]
        self.local_counts = _expert_counts(held) if split is not None else counts

    def local(self, param: nn.Parameter) -> tuple[int, ...]:
        """The rank's piece of ``param`` (``()``: none)."""
        assert self.split is not None
        return self.split.local_shape(self.names[id(param)]) or ()

    def terms(
        self, name: str, shape: tuple[int, ...], *, counted: bool = False
    ) -> tuple[float, float, int]:
        """(matmul elements, activation elements, output width) per token on this rank;
        ``counted``: a sibling projection counted the input already (the output alone)."""
        matmul, activation, out = _matrix_terms(name, shape, self.counts, self.k, counted)
        if self.split is None:
            return matmul, activation, out
        tp = self.split.dims.tp
        local = self.split.local_shape(name)
        mine = 0.0 if local is None else _matrix_terms(name, local, self.local_counts, self.k)[0]
        return mine, activation / tp, -(-out // tp)
