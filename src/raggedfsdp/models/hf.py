"""Hugging Face causal LMs and vision-language models for ``raggedfsdp train --hf-config``.

Any causal-LM architecture of ``transformers`` (an optional dependency, imported only here), or an
image-text-to-text one of :data:`VLM_TYPES`, built from its config with random weights, no download.
The job's data are bytes, so the vocabulary is replaced by byte ids (:data:`BYTE_VOCAB`; a VLM's
image tokens after them, :data:`VLM_VOCAB`), and the class is extended by :class:`_ByteTargets` so
that ``model(x, targets[, pixels])`` returns the mean next-token loss as the GPT does (the job's
one calling convention); everything else stays Hugging Face's own.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..digits import ImageFormat

__all__ = [
    "BYTE_VOCAB",
    "INSTALL_HINT",
    "TINY_CONFIGS",
    "VLM_TYPES",
    "VLM_VOCAB",
    "build_hf_model",
    "config_record",
    "decoder_layers",
    "experts_per_token",
    "hf_config",
    "hf_seq_len",
    "image_format",
    "is_hf_model",
    "is_vlm",
    "mean_token_loss",
    "text_config",
    "text_layers",
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
_TEXT_SHAPE = {**_SHAPE, "max_position_embeddings": 64}  # a digit's sample is 26-36 tokens
TINY_CONFIGS.update(
    {
        # A CLIP tower (Conv2d patch embedding, 2 encoder layers; 16x16 images of 4x4 patches:
        # 16 image tokens), LLaVA's two-layer projector, a Llama text model. The last encoder
        # layer's features (LLaVA's default, -2, would leave that layer unused).
        "tiny-llava": {
            "model_type": "llava",
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": 16,
                "patch_size": 4,
            },
            "text_config": {"model_type": "llama", **_TEXT_SHAPE},
            "vision_feature_layer": -1,
            "tie_word_embeddings": False,
        },
        # Qwen2-VL's tower (Conv3d patch embedding over 2 frames, 2 blocks, 2x2 patch merger; a
        # 16x16 image of 4x4 patches is 4 image tokens) and a Qwen2 text model whose M-RoPE
        # sections (temporal, height, width) split its 8 rotary frequencies.
        "tiny-qwen2-vl": {
            "model_type": "qwen2_vl",
            "vision_config": {
                "depth": 2,
                "embed_dim": 32,
                "hidden_size": 64,
                "num_heads": 4,
                "mlp_ratio": 2,
                "patch_size": 4,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            "text_config": {
                **_TEXT_SHAPE,
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            },
            "tie_word_embeddings": False,
        },
    }
)
"""Built-in configs for ``--hf-config NAME``: two decoder layers of width 64 (keyword arguments of
``AutoConfig.for_model``); the MoEs route each token to 2 of 4 experts; the VLMs add a two-layer
vision tower of width 32 and take 16x16 images."""

VLM_TYPES: dict[str, tuple[str, ...]] = {
    "llava": ("image_token_id",),
    "qwen2_vl": (
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ),
}
VLM_TYPES["qwen2_5_vl"] = VLM_TYPES["qwen2_vl"]
"""The ``model_type`` of each image-text-to-text model the job feeds, with its special-token ids
(given the ids after the bytes, in this order)."""

VLM_VOCAB = BYTE_VOCAB + 8
"""A VLM's vocabulary: the bytes, then its special tokens (:data:`VLM_TYPES`), padded to a
multiple of 8 so that ``--tp`` 2, 4 or 8 divides it."""


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
    _check_architecture(spec, config, transformers)
    text = text_config(config)
    _check_shape(spec, text)
    vocab = BYTE_VOCAB
    if is_vlm(config):
        for index, key in enumerate(VLM_TYPES[config.model_type]):
            setattr(config, key, BYTE_VOCAB + index)
        vocab = VLM_VOCAB
    text.vocab_size = vocab
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, key, None)
        if isinstance(value, int) and not 0 <= value < BYTE_VOCAB:
            setattr(text, key, None)
    return config


def _vlm_classes(transformers: Any) -> list[str]:
    """The model classes of :data:`VLM_TYPES`, for messages."""
    mapping = transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    configs = [transformers.CONFIG_MAPPING[name] for name in VLM_TYPES]
    return [mapping[c].__name__ for c in configs if c in mapping]


def _check_architecture(spec: str, config: Any, transformers: Any) -> None:
    """``ValueError`` unless ``config`` is a causal LM or an image-text-to-text model the job
    feeds (:data:`VLM_TYPES`), naming the classes it takes."""
    if is_vlm(config) or type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    name = type(config).__name__
    vlms = ", ".join(_vlm_classes(transformers))
    kind = (
        "an image-text-to-text model the job cannot feed yet"
        if type(config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        else "neither a causal LM nor an image-text-to-text model"
    )
    raise ValueError(
        f"hf_config: {spec!r} ({name}) is {kind}; --hf-config takes any causal LM of "
        f"transformers (AutoModelForCausalLM) or one of the image-text-to-text models {vlms}"
    )


def is_vlm(config: Any) -> bool:
    """True for the config of a vision-language model the job feeds (:data:`VLM_TYPES`)."""
    return getattr(config, "model_type", None) in VLM_TYPES


def text_config(config: Any) -> Any:
    """The language model's config: a VLM's ``text_config``, a causal LM's config itself."""
    return config.get_text_config() if is_vlm(config) else config


def image_format(spec: str, image_size: int | None = None) -> ImageFormat:
    """How the VLM of ``spec`` takes one image: the tokens that stand for it, and its side in
    pixels (``image_size``, default the tower's own). ``ValueError`` for an image size that does
    not fit the tower: one other than a LLaVA tower's (its position embeddings are that many
    patches) or, for Qwen2-VL, not a multiple of its patch times its merge size."""
    config = hf_config(spec)
    if not is_vlm(config):
        raise ValueError(f"image_size: {spec!r} is not a vision-language model; it takes no image")
    vision = config.vision_config
    patch = int(vision.patch_size)
    if config.model_type == "llava":
        tower = int(vision.image_size)
        size = tower if image_size is None else image_size
        if size != tower or tower % patch:
            raise ValueError(
                f"image_size: {size} does not fit the vision tower of {spec!r}: it takes "
                f"{tower}x{tower} images of {patch}x{patch} patches"
            )
        tokens = (size // patch) ** 2
        if config.vision_feature_select_strategy == "full":  # the class token's feature too
            tokens += 1
        prefix = (config.image_token_id,) * tokens
    else:
        side = patch * int(vision.spatial_merge_size)  # one image token covers side x side
        size = 2 * side if image_size is None else image_size
        if size < side or size % side:
            raise ValueError(
                f"image_size: {size} does not fit the vision tower of {spec!r}: a multiple of "
                f"{side} pixels ({patch}-pixel patches, merged {vision.spatial_merge_size}x"
                f"{vision.spatial_merge_size} into one token)"
            )
        tokens = (size // side) ** 2
        image = (config.image_token_id,) * tokens
        prefix = (config.vision_start_token_id, *image, config.vision_end_token_id)
    channels = int(getattr(vision, "num_channels", None) or getattr(vision, "in_channels", 3))
    return ImageFormat(prefix=prefix, size=size, channels=channels)


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
    config = text_config(hf_config(spec))
    longest = getattr(config, "max_position_embeddings", None) or MAX_DEFAULT_SEQ_LEN
    return min(int(longest), MAX_DEFAULT_SEQ_LEN)


def mean_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` against ``targets`` summed in fp32 over every position
    and divided by their count: a target of -100 counts zero, yet in the count
    (:class:`_ByteTargets`); without such targets, the mean a GPT's forward returns."""
    summed = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    return summed / targets.numel()


class _ByteTargets(nn.Module):
    """Mixed in before the HF model's class: ``forward(x, targets)`` returns the mean
    cross-entropy of the logits against ``targets`` (already the next tokens, as the job's
    batches hold them; HF's own ``labels`` would be shifted once more). A target of -100 (an
    image token's, padding's) counts zero, yet in the mean's count: the loss of a batch is then
    the mean of its rows' whatever their mix, so ranks' losses average to one process's on the
    global batch. A VLM's ``forward(x, targets, pixels)`` also takes one image per row
    (:class:`_Images`); ``targets=None`` returns the logits instead (the digit accuracy)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if 2 <= len(args) <= 3 and not kwargs:
            input_ids, targets, *pixels = args
            inputs = self._image_inputs(input_ids, pixels[0]) if pixels else {}
            logits = super().forward(input_ids=input_ids, use_cache=False, **inputs).logits
            if targets is None:
                return logits
            return mean_token_loss(logits, targets)
        return super().forward(*args, **kwargs)

    def _image_inputs(self, input_ids: torch.Tensor, pixels: torch.Tensor) -> dict[str, Any]:
        raise ValueError(f"{type(self).__name__} is a causal LM: it takes no images")


class _Images(_ByteTargets):
    """A VLM's images: ``pixels[i]`` (``[rows, C, H, W]``) is row ``i``'s image when the row
    holds the image tokens, and ignored otherwise; a batch without one runs no vision tower."""

    def _image_inputs(self, input_ids: torch.Tensor, pixels: torch.Tensor) -> dict[str, Any]:
        config: Any = self.config
        rows = (input_ids == config.image_token_id).any(dim=1)
        if not bool(rows.any()):
            return {}
        images = pixels[rows].to(self.dtype)
        if config.model_type == "llava":
            return {"pixel_values": images}
        return _qwen_patches(images, config, input_ids)


def _qwen_patches(images: torch.Tensor, config: Any, input_ids: torch.Tensor) -> dict[str, Any]:
    """Qwen2-VL's inputs for ``images`` (``[n, C, H, W]``), as its image processor makes them:
    each image repeated over the ``temporal_patch_size`` frames of a Conv3d patch, its patches
    flattened in merge-window order, their grid ``(t, h, w)`` per image, and the token types
    that place the M-RoPE positions (1 on image tokens)."""
    vision = config.vision_config
    patch, merge, frames = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    n, channels, height, width = images.shape
    grid_h, grid_w = height // patch, width // patch
    x = images[:, None].expand(n, frames, channels, height, width)
    x = x.reshape(n, frames, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = x.reshape(n * grid_h * grid_w, channels * frames * patch * patch)
    grid = torch.tensor([[1, grid_h, grid_w]] * n, device=images.device)
    token_types = (input_ids == config.image_token_id).int()
    return {"pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": token_types}


def config_record(spec: str) -> dict[str, Any]:
    """The config of ``spec`` as a JSON-able dict, for a checkpoint to carry: a model can be
    built from it (:func:`build_hf_model`) wherever the checkpoint goes, without the file
    ``spec`` named (a relative path, a file since moved)."""
    return hf_config(spec).to_dict()


def build_hf_model(spec: str | Mapping[str, Any], device: torch.device | str) -> nn.Module:
    """The causal LM or VLM of ``spec`` (as :func:`hf_config` takes it, or a
    :func:`config_record`) on ``device``, in fp32, initialised by HF's own scheme from torch's
    global generator (seed it first: every rank then holds the same weights). On the meta
    device nothing is initialised (for plans and checks)."""
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
    vlm = is_vlm(config)
    auto = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
    if device.type == "meta":
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
    else:  # on the host, so the values do not depend on the device's generator
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
        model = model.to(device)
    cls = type(model)
    model.__class__ = type(cls.__name__, (_Images if vlm else _ByteTargets, cls), {})
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


def text_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers (of :func:`decoder_layers`, a VLM's tower's blocks
    left out): what ``--tp`` splits."""
    layers = decoder_layers(model)
    if not is_vlm(getattr(model, "config", None)):
        return layers
    language = cast(Any, model).model.language_model
    inside = {id(m) for m in language.modules()}
    return [layer for layer in layers if id(layer) in inside]


def experts_per_token(model: nn.Module) -> int | None:
    """Routed experts each token visits in an HF MoE (None for a dense model)."""
    config = getattr(model, "config", None)
    value = getattr(text_config(config), "num_experts_per_tok", None)
    return int(value) if value else None
