"""The model cut into pipeline stages (``--pp``), and the checks a model must pass first.

Which layers and ends each stage holds: the comment at :func:`cut`. Only ``torch.nn`` here: the
launch's preflight and a run without ``--pp`` never load torch's pipelining (:mod:`.pipeline`
runs the stages in its schedules).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..facts import stages_per_rank
from ..models import GPT, hf

__all__ = ["StageSet", "check_pipeline", "cut", "holds", "stage_layers"]


@dataclass(frozen=True)
class _Parts:
    """Where a model's layers sit, and what only its first or last stage holds (paths)."""

    layers_owner: str  # the module whose attribute ``layers_attr`` holds the layers
    layers_attr: str
    first: tuple[str, ...]
    last: tuple[str, ...]


_GPT_PARTS = _Parts("", "blocks", ("tok_emb", "pos_emb"), ("ln_f", "head"))
_HF_PARTS = _Parts("model", "layers", ("model.embed_tokens",), ("model.norm", "lm_head"))
#: What a Llama-style Hugging Face causal LM must have for :func:`_hf_stage_forward`.
_HF_NEEDS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


def _parts(model: nn.Module) -> _Parts:
    return _GPT_PARTS if isinstance(model, GPT) else _HF_PARTS


def _layers(model: nn.Module) -> nn.Module:
    parts = _parts(model)
    return getattr(model.get_submodule(parts.layers_owner), parts.layers_attr)


def _check_hf(model: nn.Module, name: str) -> None:
    """``ValueError`` unless the Hugging Face model is a Llama-style causal LM the stages can
    run: embedding, decoder layers, norm, rotary embedding, head, and attention that is causal
    without a mask (``sdpa``)."""
    config: Any = getattr(model, "config", None)
    if hf.is_vlm(config):
        raise ValueError(
            f"pp: {name} is a vision-language model, which the job cannot cut into pipeline "
            f"stages yet; train it without --pp"
        )
    missing = [path for path in _HF_NEEDS if not _has(model, path)]
    if missing or not isinstance(_layers(model), nn.ModuleList):
        raise ValueError(
            f"pp: {name} ({type(model).__name__}) cannot be cut into pipeline stages: the job "
            f"cuts Llama-style causal LMs (model.embed_tokens, model.layers, model.norm, "
            f"model.rotary_emb, lm_head); it lacks {', '.join(missing) or 'a list of layers'}"
        )
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention != "sdpa":
        raise ValueError(
            f"pp: {name} uses {attention!r} attention; a pipeline stage runs its layers without "
            f"a mask, causal only under 'sdpa'"
        )


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_pipeline(model: nn.Module, pp: int, schedule: str, name: str) -> None:
    """``ValueError`` naming the fault unless ``model`` (on any device, meta too) can be cut
    into the ``pp x stages_per_rank(schedule)`` stages of the run: a GPT or a Llama-style
    Hugging Face causal LM, whose layers the stages divide. Before any rank meets another."""
    if not isinstance(model, GPT):
        _check_hf(model, name)
    stages = pp * stages_per_rank(schedule)
    layers = len(_layers(model))
    if layers % stages:
        per = stages_per_rank(schedule)
        how = f" ({pp} x {per} per rank, {schedule})" if per > 1 else ""
        fix = f"--pp whose {per} x pp stages divide" if per > 1 else "--pp that divides"
        raise ValueError(
            f"pp: {name} has {layers} layers, which {stages} pipeline stages{how} do not "
            f"divide; each stage holds an equal share: use a {fix} {layers}"
        )


# How stages are cut (torchtitan's way): a copy of the whole model per stage keeps the stage's
# share of the layers under their own names (an ``nn.ModuleDict`` keyed by their indices in place of
# the list), the embedding with the first stage and the final norm and head with the last; what a
# stage lacks is ``None`` and its forward skips it. State-dict keys, optimizer-state names and
# checkpoints are the whole model's, so a checkpoint moves between pp degrees. A weight tied across
# stages (GPT's head and embedding) is one parameter per stage: :class:`_Tie` keeps them one.
def cut(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of ``model`` (a GPT or a model :func:`check_pipeline`
    passed): a copy holding the stage's layers and parts (comment above)."""
    parts = _parts(model)
    part = copy.deepcopy(model)
    owner = part.get_submodule(parts.layers_owner)
    layers = getattr(owner, parts.layers_attr)
    kept = {str(i): layers[i] for i in _stage_range(len(layers), stage, stages)}
    setattr(owner, parts.layers_attr, nn.ModuleDict(kept))
    dropped = (parts.first if stage else ()) + (parts.last if stage != stages - 1 else ())
    for path in dropped:
        parent, _, attr = path.rpartition(".")
        setattr(part.get_submodule(parent), attr, None)
    if not isinstance(part, GPT):
        part.forward = types.MethodType(_hf_stage_forward, part)  # type: ignore[method-assign]
    return part


def _stage_range(layers: int, stage: int, stages: int) -> range:
    """The layers stage ``stage`` of ``stages`` holds: an equal share (:func:`check_pipeline`
    refuses a count the stages do not divide)."""
    per = layers // stages
    return range(stage * per, (stage + 1) * per)


def _hf_stage_forward(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A Hugging Face stage's forward: token ids (first stage) or the residual stream in, the
    residual stream or the logits (last stage) out; each layer as the model's own forward
    calls it, with the rotary embedding of the positions and no mask (causal under sdpa)."""
    inner: Any = self.model
    if inner.embed_tokens is not None:
        h = inner.embed_tokens(h)
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    rotary = inner.rotary_emb(h, position_ids=positions)
    for layer in inner.layers.values():
        out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        h = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
    lm_head: Any = self.lm_head  # type: ignore[union-attr]
    return h if lm_head is None else lm_head(inner.norm(h))


def stage_layers(stage: nn.Module) -> list[nn.Module]:
    """The layers a stage holds, in order: its FSDP units."""
    return list(_layers(stage).values())


# ---------------------------------------------------------------------------------------------
# The stages a rank holds, as one model.


def _merge(modules: Sequence[nn.Module]) -> nn.Module:
    """One module whose children are those of ``modules`` (the same objects), a child that
    several hold merged again: the stages' trees laid over each other."""
    if len(modules) == 1:
        return modules[0]
    merged = nn.ModuleDict() if isinstance(modules[0], nn.ModuleDict) else nn.Module()
    names = dict.fromkeys(n for m in modules for n, c in m.named_children() if c is not None)
    for name in names:
        held = [c for m in modules if (c := getattr(m, name, None)) is not None]
        own = [c for c in held if next(c.parameters(recurse=False), None) is not None]
        # A module with parameters of its own is one stage's; one without (a rotary
        # embedding's copies, a container) is merged or taken from the first stage.
        merged.add_module(name, own[0] if own else _merge(held))
    return merged


class StageSet(nn.Module):
    """The stages one rank holds as one model for what the job does with a model outside the
    schedule: ``named_parameters`` and ``state_dict`` under the whole model's names (the
    optimizer, checkpoints, the finiteness checks), the runtime's ``stats`` summed over the
    stages. The stages themselves run in the schedule. ``copies``: the ids of tied weights'
    copies (:class:`_Tie`), which ``named_parameters`` leaves out (each weight once: the
    optimizer updates the owner, whose values reach the copies)."""

    def __init__(self, stages: Sequence[nn.Module], copies: set[int] | None = None) -> None:
        super().__init__()
        self._stages = list(stages)  # a plain list: not children, so no names of their own
        self._copies = set(copies or ())
        merged = _merge(self._stages)
        for name, child in merged.named_children():
            self.add_module(name, child)

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(p) not in self._copies:
                yield name, p

    @property
    def stages(self) -> list[nn.Module]:
        return self._stages

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Every stage's ``state_dict()`` (through its own hooks), merged: the whole model's
        keys of what this rank holds."""
        out: dict[str, Any] = {}
        for stage in self._stages:
            out.update(stage.state_dict(*args, **kwargs))
        return out

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        """Each stage loads its own keys of ``state``."""
        for stage in self._stages:
            mine = stage.state_dict().keys()
            stage.load_state_dict({k: state[k] for k in mine}, strict=strict, assign=assign)

    def stats(self) -> dict[str, float]:
        """The stages' runtime counters summed (peaks: the largest)."""
        out: dict[str, float] = {}
        for stage in self._stages:
            for key, value in stage.stats().items():  # type: ignore[operator]
                peak = key.startswith("process_peak") or key.startswith("cuda_max")
                out[key] = max(out.get(key, 0), value) if peak else out.get(key, 0) + value
        return out

    def reset_stats(self) -> None:
        for stage in self._stages:
            stage.reset_stats()  # type: ignore[operator]

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("the stages of a pipeline run in its schedule, not as one model")


def holds(model: nn.Module, names: list[str], stage: int, stages: int) -> bool:
    """Whether stage ``stage`` holds one of ``names`` (the whole model's names)."""
    parts = _parts(model)
    layers = f"{parts.layers_owner}.{parts.layers_attr}.".lstrip(".")
    held = _stage_range(len(_layers(model)), stage, stages)
    for name in names:
        if name.startswith(layers):
            if int(name[len(layers) :].split(".", 1)[0]) in held:
                return True
        elif any(name.startswith(p + ".") for p in parts.first):
            if stage == 0:
                return True
        elif any(name.startswith(p + ".") for p in parts.last):
            if stage == stages - 1:
                return True
        else:
            return True  # neither a layer's nor the ends': every stage holds it
    return False
