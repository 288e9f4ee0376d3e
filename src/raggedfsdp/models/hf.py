"""Hugging Face causal language models for the training job (``raggedfsdp train --hf-config``).

Any causal-LM architecture of ``transformers`` (an optional dependency, imported only here) built
from its config with random weights, no download. The job's data are bytes, so the vocabulary is
replaced by :data:`BYTE_VOCAB` token ids (special-token ids that no longer fit dropped), and the
class is extended by :class:`_ByteTargets` so that ``model(x, targets)`` returns the mean next-token
loss as the GPT does (the job's one calling convention); everything else stays Hugging Face's own.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BYTE_VOCAB",
    "INSTALL_HINT",
    "TINY_CONFIGS",
    "build_hf_model",
    "config_record",
    "decoder_layers",
    "experts_per_token",
    "hf_config",
    "hf_seq_len",
    "is_hf_model",
]

BYTE_VOCAB = 256
"""Token ids of the job's byte-level data; every HF config gets this ``vocab_size``."""

MAX_DEFAULT_SEQ_LEN = 1024
"""Cap on the default sequence length of an HF model (its ``max_position_embeddings`` can be
100k and more, far beyond what a byte-level training step needs)."""

INSTALL_HINT = "--hf-config needs the transformers package: pip install 'raggedfsdp[hf]'"

_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", **_SHAPE, "tie_word_embeddings": False},
    "tiny-llama-tied": {"model_type": "llama", **_SHAPE, "tie_word_embeddings": True},
    "tiny-mixtral": {
        "model_type": "mixtral",
        **_SHAPE,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "tiny-qwen2-moe": {
        "model_type": "qwen2_moe",
        **_SHAPE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
    },
}
"""Built-in configs for ``--hf-config NAME``: two decoder layers of width 64 (keyword arguments of
``AutoConfig.for_model``); the MoEs route each token to 2 of 4 experts."""


def _transformers() -> Any:
    """The ``transformers`` module, or the one-line ``ValueError`` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return transformers


@functools.lru_cache(maxsize=8)
def hf_config(spec: str) -> Any:
    """The ``PretrainedConfig`` of ``spec`` (a name of :data:`TINY_CONFIGS`, a ``config.json``,
    or a folder holding one), with the byte vocabulary. Never downloads: a spec that is neither
    a built-in name nor an existing path is a ``ValueError``."""
    transformers = _transformers()
    # Offline: a typo in a path must not turn into a hub request for a model of that name.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec in TINY_CONFIGS:
        config = transformers.AutoConfig.for_model(**TINY_CONFIGS[spec])
    else:
        path = Path(spec)
        if not path.exists():
            raise ValueError(
                f"hf_config: {spec!r} is neither a config.json nor a folder holding one, nor a "
                f"built-in config ({', '.join(TINY_CONFIGS)})"
            )
        try:
            record, _ = transformers.PretrainedConfig.get_config_dict(
                str(path), local_files_only=True
            )
            _refuse_remote_code(record, transformers)
            config = transformers.AutoConfig.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"hf_config: {spec!r}: {' '.join(str(err).split())}") from None
    name = type(config).__name__
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"hf_config: {spec!r} ({name}) is not a causal-LM architecture")
    _check_shape(spec, config)
    config.vocab_size = BYTE_VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not 0 <= value < BYTE_VOCAB:
            setattr(config, key, None)
    return config


def _refuse_remote_code(record: Mapping[str, Any], transformers: Any) -> None:
    """``ValueError`` when the config (``record``: its JSON, read as data) points at code of
    its folder (``auto_map``): a model folder is data to raggedfsdp, never a program. Says
    how to build the class transformers already has for its ``model_type``, if any."""
    auto_map = record.get("auto_map")
    if not auto_map:
        return
    model_type = record.get("model_type")
    known = model_type in transformers.CONFIG_MAPPING
    fix = (
        f"delete 'auto_map' from its config.json to build transformers' own {model_type!r} classes"
        if known
        else f"its model_type {model_type!r} has no class in transformers; give a config of "
        f"one that does (a built-in --hf-config, or a model_type transformers knows)"
    )
    code = ", ".join(sorted({str(v) for v in dict(auto_map).values()}))
    raise ValueError(
        f"auto_map names code of the model folder ({code}); raggedfsdp runs no code from a "
        f"config (trust_remote_code=False): {fix}"
    )


#: Sizes a model cannot be built without: each a positive integer when the config sets it.
_POSITIVE = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
#: Keys that hold a size or a count (``moe_intermediate_size``, ``num_experts``, ``n_embd``, ...):
#: never negative.
_SIZE_KEY = re.compile(r"(_size|_dim)$|^(num|n)_")


def _check_shape(spec: str, config: Any) -> None:
    """``ValueError`` for a config that describes no model, before any worker builds it: a
    size that is not a positive integer (transformers builds a negative one into a tensor of
    negative shape, and reads ``max_position_embeddings: 0`` as unset), or key/value heads
    that do not divide the query heads (the attention fails at the first step)."""
    for key in _POSITIVE:
        value = getattr(config, key, None)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"hf_config: {spec!r}: {key} must be a positive integer, got {value!r}"
            )
    for key, value in config.to_dict().items():
        if _SIZE_KEY.search(key) and isinstance(value, int) and value < 0:
            raise ValueError(f"hf_config: {spec!r}: {key} must not be negative, got {value}")
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_key_value_heads", None)
    if heads and groups and heads % groups:
        raise ValueError(
            f"hf_config: {spec!r}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {groups} (each key/value head serves a whole group of query "
            f"heads)"
        )


def hf_seq_len(spec: str) -> int:
    """The longest sequence the model of ``spec`` takes, at most :data:`MAX_DEFAULT_SEQ_LEN`."""
    longest = getattr(hf_config(spec), "max_position_embeddings", None) or MAX_DEFAULT_SEQ_LEN
    return min(int(longest), MAX_DEFAULT_SEQ_LEN)


class _ByteTargets(nn.Module):
    """Mixed in before the HF model's class: ``forward(x, targets)`` returns the mean
    cross-entropy of the logits against ``targets`` (already the next tokens, as the job's
    batches hold them; HF's own ``labels`` would be shifted once more)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 2 and not kwargs:
            input_ids, targets = args
            logits = super().forward(input_ids=input_ids, use_cache=False).logits
            return F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )
        return super().forward(*args, **kwargs)


def config_record(spec: str) -> dict[str, Any]:
    """The config of ``spec`` as a JSON-able dict, for a checkpoint to carry: a model can be
    built from it (:func:`build_hf_model`) wherever the checkpoint goes, without the file
    ``spec`` named (a relative path, a file since moved)."""
    return hf_config(spec).to_dict()


def build_hf_model(spec: str | Mapping[str, Any], device: torch.device | str) -> nn.Module:
    """The causal LM of ``spec`` (as :func:`hf_config` takes it, or a :func:`config_record`) on
    ``device``, in fp32, initialised by HF's own scheme from torch's global generator (seed it
    first: every rank then holds the same weights). On the meta device nothing is initialised
    (for plans and checks)."""
    transformers = _transformers()
    if isinstance(spec, Mapping):
        record = dict(spec)
        try:
            _refuse_remote_code(record, transformers)
        except ValueError as err:
            raise ValueError(f"hf_config of the checkpoint: {err}") from None
        config = transformers.AutoConfig.for_model(record.pop("model_type"), **record)
    else:
        config = hf_config(spec)
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=False
            )
    else:  # on the host, so the values do not depend on the device's generator
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, trust_remote_code=False
        )
        model = model.to(device)
    cls = type(model)
    model.__class__ = type(cls.__name__, (_ByteTargets, cls), {})
    return model


def is_hf_model(model: nn.Module) -> bool:
    """True for a model of :func:`build_hf_model`."""
    return isinstance(model, _ByteTargets)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF model (the classes its ``_no_split_modules`` names), in
    model order: its FSDP units, and what ``--compile`` and activation checkpointing wrap."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    # Through the class's bases: fully_shard extends the class of a module it shards.
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found (its _no_split_modules names "
            f"{sorted(names)})"
        )
    return layers


def experts_per_token(model: nn.Module) -> int | None:
    """Routed experts each token visits in an HF MoE (None for a dense model)."""
    config = getattr(model, "config", None)
    value = getattr(config, "num_experts_per_tok", None)
    return int(value) if value else None
