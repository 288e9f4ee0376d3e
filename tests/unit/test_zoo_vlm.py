"""The zoo's vision-language models and their capacity plans, the vision side and the language
model apart: each zoo model's parameters (names and shapes) are those of transformers' own class
built from the published config values the zoo cites; a plan's parts add up to the whole (bytes
per rank and per step), a vision block's bytes go to the vision side alone, and a model without a
vision side has no parts; tensor parallelism leaves the vision side whole."""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.capacity import CapacityOptions, capacity_report, hardware
from raggedfsdp.capacity.parallel import split_model, token_embedding
from raggedfsdp.facts import ParallelDims, is_vision
from raggedfsdp.models import build_model

VLMS = ("qwen2.5-vl-72b", "llama3.2-90b-vision")


def _transformers_model(name: str) -> torch.nn.Module:
    """transformers' class from the config values the zoo's docstrings cite."""
    transformers = pytest.importorskip("transformers")
    if name == "qwen2.5-vl-72b":
        config = transformers.Qwen2_5_VLConfig(
            vision_config={
                "depth": 32, "hidden_size": 1280, "intermediate_size": 3456, "num_heads": 16,
                "in_chans": 3, "out_hidden_size": 8192, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2,
            },
            text_config={
                "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                "tie_word_embeddings": False,
            },
            tie_word_embeddings=False,
        )  # fmt: skip
    else:
        config = transformers.MllamaConfig(
            vision_config={
                "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                "num_global_layers": 8, "attention_heads": 16, "image_size": 560,
                "patch_size": 14, "max_num_tiles": 4, "vision_output_dim": 7680,
            },
            text_config={
                "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 100,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                "cross_attention_layers": list(range(3, 100, 5)), "tie_word_embeddings": False,
            },
        )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForImageTextToText.from_config(config)


@pytest.mark.parametrize("name", VLMS)
def test_zoo_vlms_are_transformers_own_shapes(name):
    ours = {n: tuple(p.shape) for n, p in build_model(name).named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in _transformers_model(name).named_parameters()}
    assert ours == theirs


def test_token_embedding_is_the_language_models():
    """Mllama's tile embedding ``[9, 8197120]`` comes first; the hidden size is the text's."""
    model = build_model("llama3.2-90b-vision")
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert first.weight.shape == (9, 8_197_120)  # the negative control: it is not the token one
    assert token_embedding(model).weight.shape == (128264, 8192)


@pytest.mark.parametrize("name", VLMS)
def test_plan_parts_add_up_to_the_whole(name):
    options = CapacityOptions(batch=1, seq_len=4096)
    report = capacity_report(name, [16, 64], hardware("h100"), options, find_smallest=False)
    model = build_model(name)
    vision = sum(p.numel() for n, p in model.named_parameters() if is_vision(n))
    for world in report.worlds:
        for cost in world.systems.values():
            parts = {part.name: part for part in cost.parts}
            assert list(parts) == ["vision", "language model"]
            assert parts["vision"].param_numel == vision
            assert sum(p.param_numel for p in parts.values()) == report.param_numel
            whole = {
                "persistent": cost.memory.persistent,
                "all_gather_bytes": cost.bytes.all_gather_bytes,
                "reduce_scatter_bytes": cost.bytes.reduce_scatter_bytes,
            }
            for field, total in whole.items():
                summed = sum(getattr(p, field) for p in parts.values())
                assert abs(summed - total) <= 2, (field, summed, total)
            # The vision side holds about its share of the elements (padding moves it a little:
            # 1.07% for Mllama's 1.05% at W=64).
            share = parts["vision"].persistent / cost.memory.persistent
            assert share == pytest.approx(vision / report.param_numel, rel=0.05)


def test_a_model_without_vision_has_no_parts():
    options = CapacityOptions(batch=1, seq_len=1024)
    report = capacity_report("llama3-8b", [8], hardware("h100"), options, find_smallest=False)
    assert all(cost.parts == () for cost in report.worlds[0].systems.values())


def test_tensor_parallelism_keeps_the_vision_side_whole():
    split = split_model(build_model("qwen2.5-vl-72b"), ParallelDims(tp=8))
    for name, param in split.params.items():
        if is_vision(name):
            assert param.local == param.shape, name
    attention = split.params["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert attention.local == (1024, 8192)
    assert split.hidden == 8192
