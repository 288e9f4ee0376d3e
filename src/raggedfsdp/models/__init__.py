"""Models: a small trainable GPT and shape-only public LLMs for sharding plans."""

from raggedfsdp.models.gpt import GPT, GPT_CONFIGS, GPTConfig
from raggedfsdp.models.zoo import MODEL_NAMES, build_model

__all__ = ["GPT", "GPT_CONFIGS", "MODEL_NAMES", "GPTConfig", "build_model"]
