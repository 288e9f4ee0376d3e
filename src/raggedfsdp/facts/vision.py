"""Which parameters of a vision-language model belong to its vision side, by module name.

The vision tower (its patch embedding and blocks) and the projector that maps its features into
the language model: tensor parallelism leaves them whole on every tp rank (the job splits the
language model alone, as torchtitan's multimodal plans do), and ``raggedfsdp plan`` costs them
apart from the language model.
"""

from __future__ import annotations

__all__ = ["VISION_MODULES", "is_vision"]

#: Module names that hold a VLM's vision side: transformers' LLaVA (``vision_tower``,
#: ``multi_modal_projector``), Qwen2-VL and Qwen2.5-VL (``visual``, its ``merger`` inside), Mllama
#: (``vision_model``, ``multi_modal_projector``).
VISION_MODULES = frozenset({"vision_tower", "visual", "vision_model", "multi_modal_projector"})


def is_vision(name: str) -> bool:
    """Whether the parameter (or module) at path ``name`` lies in a VLM's vision side."""
    return any(part in VISION_MODULES for part in name.split("."))
