"""Tensor parallelism's split of a decoder, by the name of the module that holds each parameter.

torchtitan's plans (``models/llama3/infra/parallelize.py``,
``models/deepseek_v3/infra/parallelize.py``, ``distributed/expert_parallel.py``), written once:
``models/tensor_parallel.py`` builds its ``parallelize_module`` plans from it and
``capacity/parallel.py`` each rank's shapes. Which module is split how: the comment at
:data:`TP_PLAN`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

__all__ = [
    "FUSED_EXPERTS",
    "PER_HEAD",
    "TOKEN_EMBEDDING",
    "TP_PLAN",
    "TPStyle",
    "tp_dim",
    "tp_style",
]


class TPStyle(Enum):
    """How tensor parallelism splits a module's parameters (torchtitan's parallel styles)."""

    COLWISE = "colwise"
    """``ColwiseParallel``: a ``[out, in]`` weight's rows (``Shard(0)``), and its bias."""
    ROWWISE = "rowwise"
    """``RowwiseParallel``: a ``[out, in]`` weight's columns (``Shard(1)``); the bias whole.
    On an ``nn.Embedding`` ``[vocab, d]``: its rows, the vocabulary."""
    REPLICATE = "replicate"
    """Whole on every tp rank (``NoParallel``, and what ``SequenceParallel`` keeps whole)."""


# - **column-parallel** (``ColwiseParallel``: ``Shard(0)`` of a ``[out, in]`` weight, and of its
#   bias): the attention's query, key and value projections (``wq wk wv``, DeepSeek's ``wq_b
#   wkv_b``, Hugging Face ``q_proj k_proj v_proj q_b_proj kv_b_proj``, as GPT's), the feed-forward's
#   ``w1 w3`` (``gate_proj up_proj``, GPT's ``fc``) and the output head (vocabulary-parallel: each
#   rank computes its columns of the logits);
# - **row-parallel** (``RowwiseParallel``: ``Shard(1)``, the bias replicated): ``wo w2`` (``o_proj
#   down_proj``, GPT's ``proj``); the token embedding is ``RowwiseParallel`` too, which for an
#   ``nn.Embedding`` is ``Shard(0)`` of ``[vocab, d]``: vocabulary-parallel
#   (:data:`TOKEN_EMBEDDING`);
# - **replicated** (``SequenceParallel``, ``NoParallel``): norms and other vectors, DeepSeek's
#   low-rank ``wq_a wkv_a`` (``q_a_proj kv_a_proj_with_mqa``), the router (``gate``, ``router``),
#   other embeddings (GPT's positions, as Megatron keeps them);
# - **routed experts** in fused stacks (:data:`FUSED_EXPERTS`): the same column/row split within
#   each expert (torchtitan's ``ExpertTensorParallel``); gpt-oss's attention sinks, one per head
#   (:data:`PER_HEAD`), split with the heads.
#: The style of each module by its name (the last part of its path). The output head is here
#: by name; the token embedding by its type (:data:`TOKEN_EMBEDDING`).
TP_PLAN: Mapping[str, TPStyle] = {
    **dict.fromkeys(("wq", "wk", "wv", "wq_b", "wkv_b"), TPStyle.COLWISE),
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"), TPStyle.COLWISE),
    **dict.fromkeys(("w1", "w3", "fc", "gate_proj", "up_proj"), TPStyle.COLWISE),
    **dict.fromkeys(("output", "head", "lm_head"), TPStyle.COLWISE),
    **dict.fromkeys(("wo", "w2", "proj", "o_proj", "down_proj"), TPStyle.ROWWISE),
    **dict.fromkeys(
        ("wq_a", "wkv_a", "q_a_proj", "kv_a_proj_with_mqa", "gate", "router"), TPStyle.REPLICATE
    ),
}

#: The model's token embedding (its first ``nn.Embedding``): vocabulary-parallel, by rows.
TOKEN_EMBEDDING = TPStyle.ROWWISE

#: Fused expert stacks, by parameter name: the dim tp splits. ``[E, out, in]`` (DeepSeek,
#: torchtitan's ``GroupedExperts``: ``w1 w3`` ``Shard(1)``, ``w2`` ``Shard(2)``), or gpt-oss's
#: Hugging Face ``[E, in, out]`` (``gate_up_proj`` on ``out``, ``down_proj`` on ``in``, and the
#: biases as the columns they add to). ``None``: replicated over tp.
FUSED_EXPERTS: Mapping[str, int | None] = {
    "w1": 1,
    "w3": 1,
    "w2": 2,
    "gate_up_proj": 2,
    "gate_up_proj_bias": 1,
    "down_proj": 1,
    "down_proj_bias": None,
}

#: Parameters with one entry per attention head (gpt-oss's attention sinks): split with the
#: heads, on dim 0.
PER_HEAD = frozenset({"sinks"})


def tp_style(module_name: str) -> TPStyle | None:
    """The style of the module named ``module_name`` (a path's last part), ``None``: no rule."""
    return TP_PLAN.get(module_name)


def tp_dim(style: TPStyle, *, bias: bool) -> int | None:
    """The dim ``style`` splits of a module's weight (``bias=False``) or bias; ``None``:
    whole on every tp rank."""
    if style is TPStyle.COLWISE:
        return 0
    if style is TPStyle.ROWWISE:
        return None if bias else 1
    return None
