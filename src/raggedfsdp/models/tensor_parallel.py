"""Tensor parallelism for the job's models: Megatron's split, as torchtitan's plans write it.

For a :class:`~raggedfsdp.models.gpt.GPT` and a Llama-style Hugging Face decoder, each projection's
style looked up in :mod:`raggedfsdp.facts.tp_plan` (the table the capacity planner costs, so
``raggedfsdp plan --tp`` and the preflight describe the run the job makes); the split itself is the
comment at :func:`parallelize_tensor`. :func:`check_tensor_parallel` refuses, before any collective,
a degree that does not divide the heads, hidden units or vocabulary, and a decoder layer of another
shape (a mixture of experts: ``--ep`` splits those).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ..facts import TOKEN_EMBEDDING, TPStyle, tp_style
from . import hf
from .gpt import GPT

__all__ = ["check_tensor_parallel", "parallelize_tensor"]

#: The projections a GPT block splits (:class:`~raggedfsdp.models.gpt.Block`).
_GPT_BLOCK = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.proj", "mlp.fc", "mlp.proj")
#: The projections a Llama-style Hugging Face decoder layer splits (Llama, Mistral, Qwen2, ...).
_HF_LAYER = (
    *("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
)
#: torch's parallel style of each split style of the table.
_STYLES: dict[TPStyle, type[ParallelStyle]] = {
    TPStyle.COLWISE: ColwiseParallel,
    TPStyle.ROWWISE: RowwiseParallel,
}


def _style(module_name: str) -> TPStyle:
    """The table's style of the module at ``module_name``'s last part: one that splits."""
    style = tp_style(module_name.rsplit(".", 1)[-1])
    assert style in _STYLES, f"{module_name}: {style}"  # the paths above are all split ones
    return style


def _blocks_and_plan(model: nn.Module) -> tuple[list[nn.Module], dict[str, TPStyle]]:
    """The model's blocks and the plan each takes: each projection's style from the table."""
    if isinstance(model, GPT):
        return model.block_list(), {path: _style(path) for path in _GPT_BLOCK}
    if hf.is_hf_model(model):  # a VLM's language model: its vision tower stays whole
        return hf.text_layers(model), {path: _style(path) for path in _HF_LAYER}
    raise ValueError(
        f"tp: tensor parallelism splits a GPT or a Llama-style Hugging Face model, not a "
        f"{type(model).__name__}"
    )


def _sizes(model: nn.Module) -> dict[str, int]:
    """What tp must divide: the heads (each rank computes whole heads), the feed-forward's
    hidden units and the vocabulary (the embedding's rows, the head's columns)."""
    if isinstance(model, GPT):
        cfg = model.cfg
        return {
            "attention heads": cfg.n_head,
            "feed-forward units": cfg.mlp_ratio * cfg.d_model,
            "vocabulary entries": cfg.vocab_size,
        }
    config: Any = hf.text_config(model.config)
    return {
        "attention heads": config.num_attention_heads,
        "key/value heads": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "feed-forward units": config.intermediate_size,
        "vocabulary entries": config.vocab_size,
    }


def _vocabulary(model: nn.Module) -> tuple[nn.Embedding | None, nn.Linear | None]:
    """The token embedding and the output head (None: an HF model without one, or a pipeline
    stage that does not hold it)."""
    if isinstance(model, GPT):
        return model.tok_emb, model.head
    return model.get_input_embeddings(), model.get_output_embeddings()


def _head_name(model: nn.Module) -> str:
    """The output head's module name: GPT's ``head``, a Hugging Face model's ``lm_head``."""
    return "head" if isinstance(model, GPT) else "lm_head"


def check_tensor_parallel(model: nn.Module, tp: int, *, name: str | None = None) -> None:
    """``ValueError`` naming the fault unless :func:`parallelize_tensor` can split ``model``
    over ``tp`` ranks: a GPT or a Hugging Face decoder whose every layer holds the Llama-style
    projections, and heads, hidden units and vocabulary that ``tp`` divides. Reads shapes only
    (a meta-device model does)."""
    what = name or type(model).__name__
    blocks, plan = _blocks_and_plan(model)
    for index, block in enumerate(blocks):
        modules = dict(block.named_modules())
        missing = [path for path in plan if not isinstance(modules.get(path), nn.Linear)]
        if missing:
            raise ValueError(
                f"tp: layer {index} of {what} has no {', '.join(missing)} (an nn.Linear each): "
                f"tensor parallelism splits Llama-style layers; a mixture of experts takes --ep"
            )
    for what_size, count in _sizes(model).items():
        if count % tp:
            raise ValueError(
                f"tp={tp} does not divide the {count} {what_size} of {what}: each rank holds an "
                f"equal slice; use a tp that divides {count}"
            )


# In every block the query, key and value projections and the feed-forward's input projections are
# column-parallel (``ColwiseParallel``: each rank holds whole heads, or a slice of the hidden
# units), the attention's and the feed-forward's output projections row-parallel
# (``RowwiseParallel``: their outputs are summed over tp); the token embedding is split by
# vocabulary rows and the output head by vocabulary columns, its logits gathered (no loss
# parallelism); norms and a GPT's learned positions stay whole on every rank. Each projection's
def parallelize_tensor(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh`` in place (module doc); returns it. Every rank
    must hold the same full model (the same seed): each keeps its slices. Call
    :func:`check_tensor_parallel` first, before any rank meets the others."""
    blocks, plan = _blocks_and_plan(model)
    for block in blocks:
        parallelize_module(block, tp_mesh, {path: _STYLES[style]() for path, style in plan.items()})
    embedding, head = _vocabulary(model)
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    # The vocabulary over tp: each rank looks up its rows (the others' ids give zeros, summed
    # over tp); the head computes its columns of the logits, gathered whole for the loss.
    if embedding is not None:
        embedding_style = _STYLES[TOKEN_EMBEDDING](input_layouts=Replicate())
        parallelize_module(embedding, tp_mesh, embedding_style)
    if head is not None:
        head_style = _STYLES[_style(_head_name(model))](output_layouts=Replicate())
        parallelize_module(head, tp_mesh, head_style)
        if tied:  # both held the one weight; each style made a DTensor of its own
            head.weight = embedding.weight  # type: ignore[union-attr]
    return model
