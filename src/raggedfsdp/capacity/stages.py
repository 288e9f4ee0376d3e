"""How the capacity model cuts a decoder into pipeline stages: torchtitan's cut, by layers.

:func:`stage_layers` shares the layers out among the stages; :class:`StageCut` finds a model's
blocks and what goes with the first stage (the embedding) and the last (the norm and head), and
builds a rank's stages as one module, and its shape, for the planner. Pure Python over shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..facts import is_vision
from .parallel import UnsplittableModel
from .shapes import ModelShape, UnitShape

__all__ = ["StageCut", "stage_layers"]


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The transformer layers of each stage, as torchtitan cuts them
    (``generate_llm_fqn_per_model_part`` in ``torchtitan/distributed/pipeline_parallel.py``,
    ``input_weight = output_weight = 1``): the embedding and the norm with the head each count as
    one layer, ``num_layers + 2`` are shared out evenly, the first stages one more where they do
    not divide; the first stage's share less the embedding, the last's less the head.

    Raises:
        ValueError: more stages than that count, or a stage left with no layer.
    """
    if stages == 1:
        return [range(num_layers)]
    effective = num_layers + 2
    per, extra = divmod(effective, stages)
    if per < 2:
        raise ValueError(
            f"{stages} pipeline stages for {num_layers} layers: torchtitan's cut counts the "
            f"embedding and the head as a layer each, so each stage needs 2 or more of the "
            f"{effective}; use at most {effective // 2} stages"
        )
    cuts, start = [], 0
    for stage in range(stages):
        count = per + (stage < extra) - (stage == 0) - (stage == stages - 1)
        cuts.append(range(start, start + count))
        start += count
    return cuts


@dataclass(frozen=True)
class StageCut:
    """How a model divides into stages: its blocks' container (a ``ModuleList``, or a
    ``ModuleDict`` as torchtitan's models hold them) and the root's other children, those before
    it (with the first stage) and after it (with the last). :meth:`of` finds it."""

    module: nn.Module = field(repr=False)
    blocks_name: str
    keys: tuple[str, ...]  # each block's name in its container
    blocks: tuple[nn.Module, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def unit_ids(self) -> frozenset[int]:
        """The blocks as FSDP units (a wrap policy's ids)."""
        return frozenset(id(b) for b in self.blocks)

    @classmethod
    def of(cls, module: nn.Module, model: str) -> StageCut:
        """``module``'s cut (torchtitan's: embedding first, norm and head last).

        Raises:
            UnsplittableModel: not a decoder with one container of blocks among its root's
                children, parameters on the root, or a weight tied across modules.
        """
        containers = [
            (n, c)
            for n, c in module.named_children()
            if isinstance(c, (nn.ModuleList, nn.ModuleDict))
        ]
        if len(containers) != 1 or any(is_vision(n) for n, _ in module.named_parameters()):
            raise UnsplittableModel(
                f"pipeline parallelism: {model} is not a decoder with one list of blocks among "
                f"its root's children (found {len(containers)}"
                f"{', and a vision side' if len(containers) == 1 else ''}); the planner cuts "
                f"such a decoder's blocks into stages (a Hugging Face model's, nested under "
                f".model, not yet)"
            )
        if any(True for _ in module.parameters(recurse=False)):
            raise UnsplittableModel(
                f"pipeline parallelism: {model} holds parameters on its root, which no stage's "
                f"cut says where to put"
            )
        _check_untied(module, model)
        name, container = containers[0]
        keys, blocks = zip(*container.named_children(), strict=True) if len(container) else ((), ())
        children = [n for n, _ in module.named_children()]
        at = children.index(name)
        return cls(
            module,
            name,
            tuple(keys),
            tuple(blocks),
            tuple(children[:at]),
            tuple(children[at + 1 :]),
        )

    def stage_module(self, layers: Sequence[int], first: bool, last: bool) -> nn.Module:
        """A rank's stages as one module for the planner: its blocks under their own names
        (``layers.56``, in a ``ModuleDict``), the embedding on the first rank, the norm and head
        on the last. It shares the model's (meta) modules."""
        stage = nn.Module()
        children = dict(self.module.named_children())
        for name in (self.before if first else ()) + (self.after if last else ()):
            stage.add_module(name, children[name])
        blocks = nn.ModuleDict({self.keys[i]: self.blocks[i] for i in layers})
        stage.add_module(self.blocks_name, blocks)
        return stage

    def stage_shape(
        self, full: ModelShape, stage: nn.Module, layers: Sequence[int], last: bool
    ) -> ModelShape:
        """The rank's share of the whole model's :class:`~.shapes.ModelShape` (``stage``: its
        :meth:`stage_module`): its blocks' units (and the units nested in them), and a root of
        what the stage's root holds: the head's matmul on the last rank, no matmul elsewhere
        (an embedding is a lookup)."""
        paths = {f"{self.blocks_name}.{self.keys[i]}" for i in layers}
        units = [
            u for u in full.inner if any(u.path == p or u.path.startswith(p + ".") for p in paths)
        ]
        own = sum(
            p.numel()
            for name, child in stage.named_children()
            if name != self.blocks_name
            for p in child.parameters()
        )
        root = UnitShape(
            path="",
            param_numel=own,
            matmul_numel=full.root.matmul_numel if last else 0.0,
            activation_per_token=0.0,
            widest_per_token=full.root.widest_per_token if last else 0,
            is_block=False,
        )
        return dataclasses.replace(full, units=(*units, root))


def _check_untied(module: nn.Module, model: str) -> None:
    """:class:`UnsplittableModel` where a weight is held by two modules: torchtitan's cut puts
    the embedding and the head on different stages."""
    weights: dict[int, nn.Module] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            if id(p) in weights and weights[id(p)] is not sub:
                raise UnsplittableModel(
                    f"pipeline parallelism: {model} ties a weight across modules (the "
                    f"embedding and the head); torchtitan's cut puts them on different "
                    f"stages, untied"
                )
            weights[id(p)] = sub
