"""Parameter shapes of public large language and vision-language models, as ``nn.Module`` trees.

These models exist for *planning*: the planner walks ``named_parameters()`` of a model built on the
meta device (no storage), so a 405B- or 671B-parameter model can be planned on a laptop. Their
``forward`` raises ``NotImplementedError``; only the GPT entries run. Their parameter counts, and
why the ``-experts`` entries keep every expert separate: the comment at ``_PUBLIC_BUILDERS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raggedfsdp.models._zoo_parts import HFMLP, HFDecoder, PlanningOnly
from raggedfsdp.models.gpt import GPT, GPT_CONFIGS
from raggedfsdp.models.zoo_vlm import Llama32Vision, Qwen25VL

__all__ = [
    "DEEPSEEK_V2_LITE",
    "DEEPSEEK_V3",
    "GPTOSS",
    "GPTOSSHF",
    "GPT_OSS_120B",
    "MODEL_NAMES",
    "DeepSeekConfig",
    "DeepSeekHF",
    "DeepSeekV3",
    "GPTOSSConfig",
    "Llama3",
    "Llama32Vision",
    "Qwen25VL",
    "build_model",
]

DeviceLike = torch.device | str


# --------------------------------------------------------------------------------------------
# Llama 3 / 3.1
# --------------------------------------------------------------------------------------------


class _LlamaAttention(nn.Module):
    """Grouped-query attention projections (no biases)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, hidden, bias=False)


class _SwiGLU(nn.Module):
    """SwiGLU feed-forward projections: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)


class _LlamaBlock(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        self.attention = _LlamaAttention(hidden, n_heads, n_kv_heads, head_dim)
        self.feed_forward = _SwiGLU(hidden, ffn)
        self.attention_norm = nn.RMSNorm(hidden)
        self.ffn_norm = nn.RMSNorm(hidden)


class Llama3(PlanningOnly):
    """Llama 3 / 3.1 decoder shapes (Meta's reference ``model.py`` module names).

    Shapes from the public ``params.json`` / Hugging Face ``config.json`` of
    meta-llama/Meta-Llama-3.1-{8B,70B,405B}: ``dim`` 4096/8192/16384, ``n_layers`` 32/80/126,
    ``n_heads`` 32/64/128, ``n_kv_heads`` 8, head_dim 128, ``intermediate_size``
    14336/28672/53248, ``vocab_size`` 128256, ``tie_word_embeddings`` false.
    """

    def __init__(
        self,
        *,
        hidden: int,
        n_layers: int,
        n_heads: int,
        ffn: int,
        n_kv_heads: int = 8,
        vocab: int = 128256,
    ) -> None:
        super().__init__()
        # Attention heads, for the tensor-parallel split (capacity/parallel.py: tp divides both).
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        head_dim = hidden // n_heads
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            _LlamaBlock(hidden, n_heads, n_kv_heads, head_dim, ffn) for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)


# --------------------------------------------------------------------------------------------
# DeepSeek-V3
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeepSeekConfig:
    """Shape of a DeepSeek-V2/V3 model, the one source for both its layouts (:class:`DeepSeekV3`
    and :class:`DeepSeekHF`). Fields follow the checkpoint's ``config.json``.

    Attributes:
        hidden: ``hidden_size``.
        n_layers: ``num_hidden_layers``.
        n_dense_layers: ``first_k_dense_replace``: the first layers have a dense SwiGLU, the
            others a mixture of experts.
        dense_inner: ``intermediate_size``, the dense SwiGLU's width.
        moe_inner: ``moe_intermediate_size``, one expert's SwiGLU width.
        n_routed: ``n_routed_experts``.
        n_shared: ``n_shared_experts``, laid out as one SwiGLU ``n_shared`` times as wide.
        n_heads: ``num_attention_heads``.
        q_lora_rank: ``q_lora_rank``; ``None`` (null) for a plain query projection.
        kv_lora_rank: ``kv_lora_rank``.
        qk_nope_dim: ``qk_nope_head_dim``.
        qk_rope_dim: ``qk_rope_head_dim``.
        v_dim: ``v_head_dim``.
        vocab: ``vocab_size`` (embeddings untied, ``tie_word_embeddings`` false).
        correction_bias: the router's ``e_score_correction_bias`` buffer, which ``topk_method``
            ``noaux_tc`` has and ``greedy`` has not.
    """

    hidden: int
    n_layers: int
    n_dense_layers: int
    dense_inner: int
    moe_inner: int
    n_routed: int
    n_shared: int
    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    vocab: int
    correction_bias: bool


DEEPSEEK_V3 = DeepSeekConfig(
    hidden=7168,
    n_layers=61,
    n_dense_layers=3,
    dense_inner=18432,
    moe_inner=2048,
    n_routed=256,
    n_shared=1,
    n_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_dim=128,
    vocab=129280,
    correction_bias=True,
)
"""deepseek-ai/DeepSeek-V3's ``config.json``: 671B parameters, the main model (the
multi-token-prediction module, ``num_nextn_predict_layers`` 1, about 14B more, is not included)."""

DEEPSEEK_V2_LITE = DeepSeekConfig(
    hidden=2048,
    n_layers=27,
    n_dense_layers=1,
    dense_inner=10944,
    moe_inner=1408,
    n_routed=64,
    n_shared=2,
    n_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_dim=128,
    vocab=102400,
    correction_bias=False,
)
"""deepseek-ai/DeepSeek-V2-Lite's ``config.json``: 15.7B parameters (model card)."""


class _MLA(nn.Module):
    """Multi-head latent attention: low-rank query and key/value paths (``wq`` when there is no
    query low-rank path, as in DeepSeek's reference ``model.py``)."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        q_out = cfg.n_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim)
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.hidden, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        # The rope part of the key is shared by all heads, so it rides along with the latent.
        self.wkv_a = nn.Linear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank)
        kv_out = cfg.n_heads * (cfg.qk_nope_dim + cfg.v_dim)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, kv_out, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_dim, cfg.hidden, bias=False)


class _FusedSwiGLUExperts(nn.Module):
    """``n`` SwiGLU experts stored as 3-D stacks ``[n, out, in]`` (one tensor per projection).

    Fused stacks are what grouped-GEMM MoE kernels consume, and they are the case the planner's
    ``[E, out, in]`` row rule exists for.
    """

    def __init__(self, n_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inner, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, inner))
        self.w3 = nn.Parameter(torch.empty(n_experts, inner, hidden))


class _DeepSeekMoE(nn.Module):
    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.n_routed, bias=False)
        # Auxiliary-loss-free balancing bias: adjusted by a rule, not by gradients, so it is a
        # buffer (it must not enter the optimizer or the gradient buckets).
        if cfg.correction_bias:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed))
        self.experts = _FusedSwiGLUExperts(cfg.n_routed, cfg.hidden, cfg.moe_inner)
        self.shared_experts = _SwiGLU(cfg.hidden, cfg.n_shared * cfg.moe_inner)


class _DeepSeekBlock(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, dense: bool) -> None:
        super().__init__()
        self.attn = _MLA(cfg)
        self.ffn = _SwiGLU(cfg.hidden, cfg.dense_inner) if dense else _DeepSeekMoE(cfg)
        self.attn_norm = nn.RMSNorm(cfg.hidden)
        self.ffn_norm = nn.RMSNorm(cfg.hidden)


class DeepSeekV3(PlanningOnly):
    """DeepSeek-V2/V3 shapes (by default V3's 671B, :data:`DEEPSEEK_V3`), module names after
    DeepSeek's reference inference ``model.py``."""

    def __init__(self, config: DeepSeekConfig = DEEPSEEK_V3) -> None:
        super().__init__()
        # Multi-head latent attention expands the latent into per-head keys and values, so it
        # has as many key/value heads as query heads (for the tensor-parallel split).
        self.n_heads = self.n_kv_heads = config.n_heads
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(
            _DeepSeekBlock(config, dense=i < config.n_dense_layers) for i in range(config.n_layers)
        )
        self.norm = nn.RMSNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)


# --------------------------------------------------------------------------------------------
# GPT-OSS
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GPTOSSConfig:
    """Shape of a GPT-OSS model, the one source for both its layouts (:class:`GPTOSS` and
    :class:`GPTOSSHF`). Fields follow the checkpoint's ``config.json``.

    Attributes:
        hidden: ``hidden_size``.
        n_layers: ``num_hidden_layers``.
        n_heads: ``num_attention_heads``.
        n_kv_heads: ``num_key_value_heads``.
        head_dim: ``head_dim``.
        n_experts: ``num_local_experts``.
        inner: ``intermediate_size``, one expert's SwiGLU width.
        vocab: ``vocab_size`` (embeddings untied, ``tie_word_embeddings`` false).
    """

    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    inner: int
    vocab: int


GPT_OSS_120B = GPTOSSConfig(
    hidden=2880,
    n_layers=36,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    n_experts=128,
    inner=2880,
    vocab=201088,
)
"""openai/gpt-oss-120b's ``config.json``: 116.8B parameters (model card)."""


class _GPTOSSAttention(nn.Module):
    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, q_out, bias=True)
        self.k_proj = nn.Linear(cfg.hidden, kv_out, bias=True)
        self.v_proj = nn.Linear(cfg.hidden, kv_out, bias=True)
        self.o_proj = nn.Linear(q_out, cfg.hidden, bias=True)
        # One learned "attention sink" logit per head.
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads))


class _GPTOSSExperts(nn.Module):
    """Fused experts in the Hugging Face layout ``[E, in, out]`` (gate and up interleaved)."""

    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.n_experts, cfg.hidden, cfg.inner
        self.gate_up_proj = nn.Parameter(torch.empty(n, hidden, 2 * inner))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(n, inner, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(n, hidden))


class _GPTOSSMoE(nn.Module):
    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=True)
        self.experts = _GPTOSSExperts(cfg)


class _GPTOSSBlock(nn.Module):
    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden)
        self.self_attn = _GPTOSSAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden)
        self.mlp = _GPTOSSMoE(cfg)


class GPTOSS(PlanningOnly):
    """GPT-OSS shapes (by default :data:`GPT_OSS_120B`), module names after the Hugging Face
    ``GptOssForCausalLM``: attention and expert projections carry biases, each layer has
    per-head attention sinks."""

    def __init__(self, config: GPTOSSConfig = GPT_OSS_120B) -> None:
        super().__init__()
        # Attention heads, for the tensor-parallel split (capacity/parallel.py: tp divides both).
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(_GPTOSSBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)


# --------------------------------------------------------------------------------------------
# Hugging Face layouts with one nn.Linear per expert and projection
# --------------------------------------------------------------------------------------------


class _NumberedModules(nn.Module):
    """Modules named ``0``, ``1``, ... (parameter names as an ``nn.ModuleList`` gives them), but
    not a ``ModuleList``: the default wrap policy would make every expert its own FSDP unit."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)

    def __len__(self) -> int:
        return len(self._modules)


class _HFMLA(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention, Hugging Face names (``q_proj`` when there is
    no query low-rank path, as in DeepSeek-V2-Lite)."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        q_out = cfg.n_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        kv_a_out = cfg.kv_lora_rank + cfg.qk_rope_dim
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden, kv_a_out, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank)
        kv_out = cfg.n_heads * (cfg.qk_nope_dim + cfg.v_dim)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, kv_out, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.v_dim, cfg.hidden, bias=False)


class _HFMoEGate(nn.Module):
    """The router: ``weight [n_routed, hidden]``; DeepSeek-V3's auxiliary-loss-free balancing
    bias ``e_score_correction_bias`` is a buffer (set by a rule, not trained by gradients)."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed, cfg.hidden))
        if cfg.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed))


class _HFDeepSeekMoE(nn.Module):
    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        experts = [HFMLP(cfg.hidden, cfg.moe_inner) for _ in range(cfg.n_routed)]
        self.experts = _NumberedModules(experts)
        self.gate = _HFMoEGate(cfg)
        self.shared_experts = HFMLP(cfg.hidden, cfg.n_shared * cfg.moe_inner)


class _HFDeepSeekLayer(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, dense: bool) -> None:
        super().__init__()
        self.self_attn = _HFMLA(cfg)
        self.mlp = HFMLP(cfg.hidden, cfg.dense_inner) if dense else _HFDeepSeekMoE(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden)


class DeepSeekHF(PlanningOnly):
    """DeepSeek-V2/V3 in the Hugging Face checkpoint layout, one ``nn.Linear`` per expert.

    Parameter names as in the public checkpoints (``model.layers.N.self_attn.q_a_proj.weight``,
    ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, ``mlp.shared_experts.*``,
    ``mlp.gate.weight``, ``lm_head.weight``). By default V3's shape, :data:`DEEPSEEK_V3` (as
    :class:`DeepSeekV3`, so the same 671B); ``deepseek-v2-lite`` is :data:`DEEPSEEK_V2_LITE`.
    """

    def __init__(self, config: DeepSeekConfig = DEEPSEEK_V3) -> None:
        super().__init__()
        self.n_heads = self.n_kv_heads = config.n_heads  # as DeepSeekV3's
        layers: list[nn.Module] = [
            _HFDeepSeekLayer(config, dense=i < config.n_dense_layers)
            for i in range(config.n_layers)
        ]
        self.model = HFDecoder(config.vocab, config.hidden, layers)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)


class _HFGPTOSSRouter(nn.Module):
    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.hidden))
        self.bias = nn.Parameter(torch.empty(cfg.n_experts))


class _HFGPTOSSMoE(nn.Module):
    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        self.router = _HFGPTOSSRouter(cfg)
        experts = [HFMLP(cfg.hidden, cfg.inner, bias=True) for _ in range(cfg.n_experts)]
        self.experts = _NumberedModules(experts)


class _HFGPTOSSLayer(nn.Module):
    def __init__(self, cfg: GPTOSSConfig) -> None:
        super().__init__()
        self.self_attn = _GPTOSSAttention(cfg)
        self.mlp = _HFGPTOSSMoE(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden)


class GPTOSSHF(PlanningOnly):
    """GPT-OSS with its experts unfused: one ``nn.Linear`` (with bias) per expert and
    projection, in the Hugging Face module tree (``model.layers.N.self_attn.q_proj.weight``,
    ``model.layers.N.mlp.router.weight``, ``lm_head.weight``).

    The public checkpoint fuses the experts (``mlp.experts.gate_up_proj [128, 2880, 5760]`` with
    gate and up interleaved, ``down_proj [128, 2880, 2880]``, as :class:`GPTOSS` has them); no
    public checkpoint stores them apart, so the unfused names follow the Hugging Face MoE
    convention (Mixtral, Qwen-MoE, DeepSeek): ``mlp.experts.E.gate_proj`` / ``up_proj``
    ``[2880, 2880]`` and ``down_proj [2880, 2880]``, each with its ``bias [2880]``. By default
    :data:`GPT_OSS_120B`, as :class:`GPTOSS`, so the same 116.8B parameters.
    """

    def __init__(self, config: GPTOSSConfig = GPT_OSS_120B) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads  # as GPTOSS's
        layers: list[nn.Module] = [_HFGPTOSSLayer(config) for _ in range(config.n_layers)]
        self.model = HFDecoder(config.vocab, config.hidden, layers)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)


# Built on a real device, the zoo models hold torch's default initialisation for Linear, Embedding
# and RMSNorm layers and uninitialised memory (``torch.empty``) for the fused expert tensors.
#
# Parameter counts (untied embeddings, this module's shapes):
#
# ==================  ==================  ==========================================
# name                parameters          public figure
# ==================  ==================  ==========================================
# llama3-8b           8,030,261,248       8.03B
# llama3-70b          70,553,706,496      70.6B
# llama3-405b         405,853,388,800     405.9B (reported as 405B)
# deepseek-v3-671b    671,026,404,352     671B (main model, without the 14B MTP module)
# gpt-oss-120b        116,829,156,672     116.8B
# ==================  ==================  ==========================================
#
# The ``-experts`` entries and ``deepseek-v2-lite`` keep every expert's projections as separate
# ``nn.Linear`` modules, named as the Hugging Face checkpoints name them
# (``model.layers.N.mlp.experts.E.gate_proj.weight``): a layer bucket then holds hundreds of
# same-shaped matrices, the case the planner's grouping of identical tensors exists for. Their
# expert containers are plain modules with numbered children, not ``nn.ModuleList`` (the default
# wrap policy makes every ``ModuleList`` element an FSDP unit; a decoder layer is the unit here).
#
# ==========================  ==================  ==========================================
# name                        parameters          public figure
# ==========================  ==================  ==========================================
# deepseek-v3-671b-experts    671,026,404,352     671B (as ``deepseek-v3-671b``)
# gpt-oss-120b-experts        116,829,156,672     116.8B (as ``gpt-oss-120b``)
# deepseek-v2-lite            15,706,484,224      15.7B
# ==========================  ==================  ==========================================
#
# The vision-language models (their vision side: tower and projector, by
# :func:`raggedfsdp.facts.is_vision`):
#
# ==========================  ==================  ==================  ========================
# name                        parameters          of them vision      public figure
# ==========================  ==================  ==================  ========================
# qwen2.5-vl-72b              73,410,777,344      704,573,696         73.4B
# llama3.2-90b-vision         88,593,355,323      926,490,131         88.6B
# ==========================  ==================  ==================  ========================
_PUBLIC_BUILDERS = {
    "llama3-8b": lambda: Llama3(hidden=4096, n_layers=32, n_heads=32, ffn=14336),
    "llama3-70b": lambda: Llama3(hidden=8192, n_layers=80, n_heads=64, ffn=28672),
    "llama3-405b": lambda: Llama3(hidden=16384, n_layers=126, n_heads=128, ffn=53248),
    "deepseek-v3-671b": DeepSeekV3,
    "gpt-oss-120b": GPTOSS,
    "deepseek-v3-671b-experts": DeepSeekHF,
    "gpt-oss-120b-experts": GPTOSSHF,
    "deepseek-v2-lite": lambda: DeepSeekHF(DEEPSEEK_V2_LITE),
    "qwen2.5-vl-72b": Qwen25VL,
    "llama3.2-90b-vision": Llama32Vision,
}

MODEL_NAMES: tuple[str, ...] = (*GPT_CONFIGS, *_PUBLIC_BUILDERS)
"""Every name :func:`build_model` accepts."""


def build_model(name: str, device: DeviceLike = "meta") -> nn.Module:
    """Build a named model; on the meta device (no storage) by default.

    Args:
        name: one of :data:`MODEL_NAMES`.
        device: where to put the parameters. GPT models built on a real device are initialised
            by :meth:`GPT.init_weights`; the public models are meant for the meta device (a real
            device would need their full size in memory).

    Raises:
        ValueError: unknown ``name`` (the message lists the known names).
    """
    if name in GPT_CONFIGS:
        return GPT(GPT_CONFIGS[name], device=device)
    builder = _PUBLIC_BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    with torch.device(device):
        return builder()
