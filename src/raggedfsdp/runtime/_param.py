"""One parameter of a unit: the runtime's single record of it.

An :class:`FSDPParam` knows every place the parameter is registered (tied parameters have
several), where it lies in its bucket's buffers, and its two forms: the sharded parameter (a view
of the bucket's local shard, carrying its :class:`~raggedfsdp.tensor.ShardInfo` for optimizers
and tools) and the unsharded one (a view of the gathered buffer, bound by the DBuffer). Swapping
what the modules hold is its job too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ._param_placement import ParamPlacement, Plain

__all__ = ["FSDPParam", "Registration", "bucket_name", "named_in", "qualified_name"]


@dataclass(frozen=True)
class Registration:
    """A parameter as ``fully_shard`` finds it, before sharding: its name, the tensor, and every
    ``(module, attribute)`` it is registered under."""

    fqn: str
    param: nn.Parameter
    owners: tuple[tuple[nn.Module, str], ...]
    #: its form beside the ragged shard (plain, tensor- or expert-parallel, full-mesh), chosen
    #: once by ``fully_shard`` (``_param_placement.py``)
    placement: ParamPlacement = field(default_factory=Plain)

    @property
    def local(self) -> torch.Tensor:
        """The tensor the unit shards: the parameter, or a DTensor parameter's local tensor."""
        return self.placement.local(self.param)


class FSDPParam:
    """One parameter of a bucket: where it is registered, where it lies, its two forms."""

    def __init__(
        self,
        registration: Registration,
        *,
        offset: int,
        local_start: int,
        local_end: int,
        sharded: nn.Parameter,
        unsharded: nn.Parameter,
    ) -> None:
        #: its name below the unit's module, the key of the unit's plan (the model's name is
        #: ``FSDPParamGroup.qualify(fqn)`` once the root has named the unit)
        self.fqn = registration.fqn
        #: every (module, attribute) the parameter is registered under
        self.owners = registration.owners
        #: its form beside the ragged shard: what forward computes with, how its gradient is
        #: placed (``_param_placement.py``)
        self.placement = registration.placement
        self.shape = registration.local.shape  # what the unit shards (a DTensor's local shape)
        self.offset = offset  # in the bucket's global buffer
        self.local_start = local_start  # this rank's piece, in the bucket's local buffer
        self.local_end = local_end
        #: persistent; a view of DBuffer.local that the optimizer updates in place
        self.sharded = sharded
        #: persistent; a view of DBuffer.full (of DBuffer.local when held whole here, or of the
        #: FSDP2-style path's own buffer); its data is bound by DBuffer.bind_full
        self.unsharded = unsharded

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def held_whole(self) -> bool:
        """Whether this rank's piece is the whole parameter."""
        return self.local_end - self.local_start == self.numel

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's piece (N-D when whole rows, else 1-D)."""
        return self.sharded._local_tensor.shape

    def bind_unsharded(self, view: torch.Tensor) -> None:
        """The unsharded parameter's values become ``view`` (of the gathered buffer, or of the
        shard): its data, or its local tensor when it is a DTensor."""
        self.placement.bind(self.unsharded, view)

    def unsharded_local(self) -> torch.Tensor:
        """The unsharded parameter's values (a DTensor's local tensor), as ``.data``: a copy
        into them bumps no version counter (see :meth:`bind_unsharded`)."""
        return self.placement.values(self.unsharded)

    def set_unsharded_grad(self, view: torch.Tensor | None) -> None:
        """The unsharded parameter's gradient becomes ``view`` (autograd accumulates into it),
        placed as the parameter under tensor parallelism (``Partial`` over the data-parallel
        dims of the full-mesh form); ``None`` clears it."""
        self.unsharded.grad = None if view is None else self.placement.grad(view, self.unsharded)

    def held(self) -> torch.Tensor:
        """What the modules hold in the parameter's place now (its sharded or unsharded form,
        unless something else was put there: see ``_adopt.py``)."""
        module, attr = self.owners[0]
        return module._parameters[attr]

    def hold(self, *, unsharded: bool) -> None:
        """Make every module that registers this parameter hold its unsharded (or sharded)
        form."""
        param = self.unsharded if unsharded else self.sharded
        for module, attr in self.owners:
            module._parameters[attr] = param

    def named_in(self, paths: dict[int, str], prefix: str) -> list[tuple[str, nn.Parameter]]:
        """``(state-dict key, what the owner holds)`` under every name the parameter has below
        a module, ``paths`` mapping ``id(module)`` to its path below it (keys start with
        ``prefix``); owners outside that module (another module of the unit) are left out."""
        return named_in(self.owners, paths, prefix)

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn!r}, shape={list(self.shape)}, offset={self.offset})"


def named_in(
    owners: tuple[tuple[nn.Module, str], ...], paths: dict[int, str], prefix: str
) -> list[tuple[str, nn.Parameter]]:
    """``(state-dict key, what the owner holds)`` for each of ``owners`` below a module, as
    :meth:`FSDPParam.named_in` says."""
    out = []
    for owner, attr in owners:
        path = paths.get(id(owner))
        if path is None:
            continue
        key = f"{prefix}{path}.{attr}" if path else f"{prefix}{attr}"
        out.append((key, owner._parameters[attr]))
    return out


def qualified_name(name: str, paths: list[str]) -> str:
    """A parameter's name below its unit (``i.rest`` for the ``i``-th module of a unit of
    several) as the model names it, the unit's modules being at ``paths``."""
    if len(paths) > 1:
        index, name = name.split(".", 1)
        path = paths[int(index)]
    else:
        path = paths[0]
    return f"{path}.{name}" if path else name


def bucket_name(name: str, path: str) -> str:
    """A unit's bucket ``<root>/<dtype>[/frozen]/<i>`` named for the unit at ``path`` (as
    ``unit_buckets`` names it there)."""
    return f"{path or '<root>'}/{name.split('/', 1)[1]}"
