"""Parameter shapes of public vision-language models for planning, in transformers' module trees.

``model.visual`` / ``model.vision_model`` (the vision side, :func:`raggedfsdp.facts.is_vision`),
``model.language_model``, ``lm_head``; each docstring cites the ``config.json`` values it is built
from. Shape-only, as the rest of :mod:`raggedfsdp.models.zoo`.
"""

from __future__ import annotations

import torch
from torch import nn

from ._zoo_parts import HFMLP, HFDecoder, PlanningOnly

__all__ = ["Llama32Vision", "Qwen25VL"]


class _QwenVisionBlock(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.norm2 = nn.RMSNorm(hidden)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn.proj = nn.Linear(hidden, hidden)
        self.mlp = HFMLP(hidden, inner, bias=True)


class _DecoderLayer(nn.Module):
    """A Llama or Qwen2 (``qkv_bias``) decoder layer: grouped-query attention, SwiGLU."""

    def __init__(
        self, hidden: int, n_heads: int, n_kv_heads: int, inner: int, *, qkv_bias: bool
    ) -> None:
        super().__init__()
        head_dim = hidden // n_heads
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=qkv_bias)
        self.self_attn.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.self_attn.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.self_attn.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.mlp = HFMLP(hidden, inner)
        self.input_layernorm = nn.RMSNorm(hidden)
        self.post_attention_layernorm = nn.RMSNorm(hidden)


class Qwen25VL(PlanningOnly):
    """Qwen2.5-VL-72B: a 32-block ViT with a Conv3d patch embedding and a 2x2 patch merger,
    and a Qwen2.5-72B text model.

    From ``config.json`` of Qwen/Qwen2.5-VL-72B-Instruct (Hugging Face): ``vision_config``
    ``depth`` 32, ``hidden_size`` 1280, ``intermediate_size`` 3456, ``num_heads`` 16,
    ``in_chans`` 3, ``patch_size`` 14, ``temporal_patch_size`` 2, ``spatial_merge_size`` 2,
    ``out_hidden_size`` 8192; text ``hidden_size`` 8192, ``num_hidden_layers`` 80,
    ``num_attention_heads`` 64, ``num_key_value_heads`` 8, ``intermediate_size`` 29568,
    ``vocab_size`` 152064, ``tie_word_embeddings`` false. 73.4B parameters, 0.70B of them
    the vision side (the model card: "73.4B").
    """

    def __init__(self) -> None:
        super().__init__()
        vision, merged, hidden, vocab = 1280, 1280 * 2 * 2, 8192, 152064
        self.n_heads, self.n_kv_heads = 64, 8
        self.model = nn.Module()
        self.model.visual = nn.Module()
        self.model.visual.patch_embed = nn.Module()
        self.model.visual.patch_embed.proj = nn.Conv3d(
            3, vision, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False
        )
        self.model.visual.blocks = nn.ModuleList(_QwenVisionBlock(vision, 3456) for _ in range(32))
        self.model.visual.merger = nn.Module()
        self.model.visual.merger.ln_q = nn.RMSNorm(vision)
        self.model.visual.merger.mlp = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, hidden)
        )
        layers = [_DecoderLayer(hidden, 64, 8, 29568, qkv_bias=True) for _ in range(80)]
        self.model.language_model = HFDecoder(vocab, hidden, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


class _MllamaVisionLayer(nn.Module):
    """A CLIP-style layer of Mllama's tower (LayerNorms, GELU MLP); gated in its global part."""

    def __init__(self, hidden: int, inner: int, gated: bool) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            self.self_attn.add_module(name, nn.Linear(hidden, hidden, bias=False))
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, inner)
        self.mlp.fc2 = nn.Linear(inner, hidden)
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        if gated:
            self.gate_attn = nn.Parameter(torch.empty(1))
            self.gate_ffn = nn.Parameter(torch.empty(1))


class _GatedEmbedding(nn.Module):
    """A tile-position embedding ``[aspect ratios, tiles * width]`` and its gate."""

    def __init__(self, ratios: int, width: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(1))
        self.embedding = nn.Embedding(ratios, width)


class _MllamaVision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        hidden, patches, tiles, ratios = 1280, (560 // 14) ** 2 + 1, 4, 9
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(3, hidden, kernel_size=14, stride=14, bias=False)
        self.gated_positional_embedding = nn.Module()
        positions = self.gated_positional_embedding
        positions.gate = nn.Parameter(torch.empty(1))
        positions.embedding = nn.Parameter(torch.empty(patches, hidden))
        positions.tile_embedding = nn.Embedding(ratios, tiles * patches * hidden)
        self.pre_tile_positional_embedding = _GatedEmbedding(ratios, tiles * hidden)
        self.post_tile_positional_embedding = _GatedEmbedding(ratios, tiles * hidden)
        self.layernorm_pre = nn.LayerNorm(hidden)
        self.layernorm_post = nn.LayerNorm(hidden)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(
            _MllamaVisionLayer(hidden, 5120, gated=False) for _ in range(32)
        )
        self.global_transformer = nn.Module()
        self.global_transformer.layers = nn.ModuleList(
            _MllamaVisionLayer(hidden, 5120, gated=True) for _ in range(8)
        )


class _MllamaCrossLayer(nn.Module):
    """A gated cross-attention layer of the text model: its queries from the text, keys and
    values from the projected image features."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, inner: int) -> None:
        super().__init__()
        head_dim = hidden // n_heads
        self.cross_attn = nn.Module()
        self.cross_attn.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.cross_attn.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.cross_attn.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.cross_attn.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.cross_attn.q_norm = nn.RMSNorm(head_dim)
        self.cross_attn.k_norm = nn.RMSNorm(head_dim)
        self.input_layernorm = nn.RMSNorm(hidden)
        self.cross_attn_attn_gate = nn.Parameter(torch.empty(1))
        self.mlp = HFMLP(hidden, inner)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.cross_attn_mlp_gate = nn.Parameter(torch.empty(1))


class Llama32Vision(PlanningOnly):
    """Llama-3.2-90B-Vision (Mllama): a 32 + 8-layer ViT-H/14 over up to 4 tiles of 560x560, a
    linear projector, and Llama 3.1 70B with 20 gated cross-attention layers among its 100.

    From ``config.json`` of meta-llama/Llama-3.2-90B-Vision (Hugging Face): ``vision_config``
    ``hidden_size`` 1280, ``intermediate_size`` 5120, ``num_hidden_layers`` 32,
    ``num_global_layers`` 8, ``attention_heads`` 16, ``image_size`` 560, ``patch_size`` 14,
    ``max_num_tiles`` 4, 8 ``supported_aspect_ratios``, ``vision_output_dim`` 7680; text
    ``hidden_size`` 8192, ``num_hidden_layers`` 100, ``cross_attention_layers`` [3, 8, ..., 98]
    (every fifth from 3), ``num_attention_heads`` 64, ``num_key_value_heads`` 8,
    ``intermediate_size`` 28672, ``vocab_size`` 128256 (the embedding 8 rows more: the image
    tokens), ``tie_word_embeddings`` false. 88.6B parameters, 0.93B of them the vision side
    (the model card: "88.6B").
    """

    def __init__(self) -> None:
        super().__init__()
        hidden, vocab = 8192, 128256
        self.n_heads, self.n_kv_heads = 64, 8
        cross = set(range(3, 100, 5))
        layers = [
            _MllamaCrossLayer(hidden, 64, 8, 28672)
            if i in cross
            else _DecoderLayer(hidden, 64, 8, 28672, qkv_bias=False)
            for i in range(100)
        ]
        self.model = nn.Module()
        self.model.vision_model = _MllamaVision()
        self.model.language_model = HFDecoder(vocab + 8, hidden, layers)
        self.model.multi_modal_projector = nn.Linear(7680, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
