"""Tests for raggedfsdp.models: the GPT and the shape-only model zoo."""

from __future__ import annotations

import math

import pytest
import torch

from raggedfsdp.models import GPT, GPT_CONFIGS, MODEL_NAMES, GPTConfig, build_model
from raggedfsdp.models.gpt import init_parameter_
from raggedfsdp.models.zoo import DEEPSEEK_V2_LITE, DeepSeekHF, DeepSeekV3

TINY = GPT_CONFIGS["gpt-tiny"]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_forward_shapes_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    logits = model(idx)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    # Shorter sequences than seq_len work too (positions are a prefix of the table).
    assert model(idx[:, :5]).shape == (3, 5, TINY.vocab_size)
    loss = model(idx, torch.randint(0, TINY.vocab_size, (3, TINY.seq_len)))
    assert loss.ndim == 0
    assert torch.isfinite(loss)
    # Small init => nearly uniform predictions => loss close to ln(vocab).
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_sequence_too_long() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="seq_len=64"):
        model(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_tied_weights_share_storage() -> None:
    model = GPT(TINY)
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=1, d_model=8, tie_embeddings=False)
    untied = GPT(cfg)
    assert "head.weight" in dict(untied.named_parameters())
    assert untied.head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


def test_init_weights_equals_per_parameter_init() -> None:
    torch.manual_seed(123)
    built = GPT(TINY)  # the constructor's only RNG use is init_weights

    torch.manual_seed(123)
    meta = GPT(TINY, device="meta")
    meta.to_empty(device="cpu")
    meta.tie_weights()
    for name, param in meta.named_parameters():
        init_parameter_(name, param, TINY)

    torch.manual_seed(123)
    reinit = GPT(TINY, device="meta")
    reinit.to_empty(device="cpu")
    reinit.tie_weights()
    reinit.init_weights()

    for key, value in _state(built).items():
        torch.testing.assert_close(meta.state_dict()[key], value, rtol=0, atol=0)
        torch.testing.assert_close(reinit.state_dict()[key], value, rtol=0, atol=0)


def test_init_statistics() -> None:
    torch.manual_seed(0)
    cfg = GPT_CONFIGS["gpt-small"]
    model = GPT(cfg)
    assert torch.equal(model.ln_f.weight, torch.ones(cfg.d_model))
    assert torch.equal(model.blocks[0].ln1.bias, torch.zeros(cfg.d_model))
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 2e-3
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - resid) < 1e-3


def test_init_parameter_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"'blocks\.0\.nope\.weight'"):
        init_parameter_("blocks.0.nope.weight", torch.empty(2, 2), TINY)


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"d_model": 65}, "65"),
        ({"n_layer": 0}, "0"),
        ({"n_head": -2}, "-2"),
    ],
)
def test_config_validation(kwargs: dict[str, int], bad: str) -> None:
    base = {"vocab_size": 256, "seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64}
    with pytest.raises(ValueError, match=bad):
        GPTConfig(**(base | kwargs))


def test_gpt_num_params() -> None:
    model = GPT(TINY, device="meta")
    d, v, t, L = TINY.d_model, TINY.vocab_size, TINY.seq_len, TINY.n_layer
    per_block = 4 * d + 3 * d * d + d * d + 2 * 4 * d * d
    assert model.num_params() == v * d + t * d + L * per_block + 2 * d


# Public figures: Meta's model cards (8.03B, 70.6B, 405.9B), DeepSeek-V3's 671B main model
# (685B on the hub includes the 14B MTP module), OpenAI's gpt-oss-120b card (116.8B),
# DeepSeek-V2-Lite's card (15.7B), the Hugging Face model pages of Qwen2.5-VL-72B-Instruct (73.4B)
# and Llama-3.2-90B-Vision (88.6B).
PUBLIC_COUNTS = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "deepseek-v3-671b": 671e9,
    "gpt-oss-120b": 116.8e9,
    "deepseek-v2-lite": 15.7e9,
    "qwen2.5-vl-72b": 73.4e9,
    "llama3.2-90b-vision": 88.6e9,
}


@pytest.mark.parametrize("name", sorted(PUBLIC_COUNTS))
def test_zoo_parameter_counts(name: str) -> None:
    model = build_model(name)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    total = sum(p.numel() for p in params)
    assert abs(total - PUBLIC_COUNTS[name]) / PUBLIC_COUNTS[name] < 0.01, total


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("separate", "fused"),
    [("deepseek-v3-671b-experts", "deepseek-v3-671b"), ("gpt-oss-120b-experts", "gpt-oss-120b")],
)
def test_separate_experts_have_the_fused_models_parameters(separate: str, fused: str) -> None:
    """The two layouts of one config lay out the same parameters under other names: the counts
    are equal to the element."""
    assert _numel(build_model(separate)) == _numel(build_model(fused))


def test_deepseek_reference_layout_of_v2_lite() -> None:
    """One config serves both DeepSeek layouts: V2-Lite's (no query low-rank path, no
    correction bias) gives the reference layout a plain ``wq``, no buffer, and the parameters of
    its Hugging Face layout."""
    with torch.device("meta"):
        fused, separate = DeepSeekV3(DEEPSEEK_V2_LITE), DeepSeekHF(DEEPSEEK_V2_LITE)
    params = dict(fused.named_parameters())
    assert params["layers.0.attn.wq.weight"].shape == (16 * (128 + 64), 2048)
    assert not any(".wq_a." in name or ".q_norm." in name for name in params)
    assert list(fused.buffers()) == []
    assert _numel(fused) == _numel(separate)


def test_zoo_shapes() -> None:
    llama = dict(build_model("llama3-8b").named_parameters())
    assert llama["layers.0.attention.wk.weight"].shape == (1024, 4096)
    assert llama["output.weight"].shape == (128256, 4096)
    ds = dict(build_model("deepseek-v3-671b").named_parameters())
    assert ds["layers.0.ffn.w1.weight"].shape == (18432, 7168)
    assert ds["layers.3.ffn.experts.w2"].shape == (256, 7168, 2048)
    assert ds["layers.60.attn.wkv_b.weight"].shape == (32768, 512)
    oss = dict(build_model("gpt-oss-120b").named_parameters())
    assert oss["layers.0.mlp.experts.gate_up_proj"].shape == (128, 2880, 5760)
    assert oss["layers.0.self_attn.sinks"].shape == (64,)


def test_meta_allocates_nothing() -> None:
    for name in MODEL_NAMES:
        model = build_model(name)
        tensors = [*model.parameters(), *model.buffers()]
        assert all(t.is_meta for t in tensors), name
    with pytest.raises(NotImplementedError):
        build_model("llama3-8b")(torch.zeros(1, 1, dtype=torch.long))


def test_gpt_names_in_zoo() -> None:
    model = build_model("gpt-tiny", device="cpu")
    assert isinstance(model, GPT)
    assert not next(model.parameters()).is_meta


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match="llama3-405b") as err:
        build_model("llama9")
    assert "'llama9'" in str(err.value)
