"""One parameter of a unit: the runtime's single record of it.

An :class:`FSDPParam` knows every place the parameter is registered (tied parameters have
several), where it lies in its bucket's buffers, and its two forms: the sharded parameter (a view
of the bucket's local shard, carrying its :class:`~raggedfsdp.tensor.ShardInfo` for optimizers
and tools) and the unsharded one (a view of the gathered buffer, bound by the DBuffer). Swapping
what the modules hold is its job too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

if TYPE_CHECKING:
    from ._spmd import SpmdParam

__all__ = ["FSDPParam", "Registration", "bucket_name", "qualified_name"]


@dataclass(frozen=True)
class Registration:
    """A parameter as ``fully_shard`` finds it, before sharding: its name, the tensor, and every
    ``(module, attribute)`` it is registered under."""

    fqn: str
    param: nn.Parameter
    owners: tuple[tuple[nn.Module, str], ...]
    #: a parameter that is already a DTensor (tensor or expert parallelism): its spec (mesh,
    #: placements, global shape); the unit shards its local tensor
    parallel: DTensorSpec | None = None
    #: ``fully_shard(..., dp_mesh_dims=...)``: the parameter on the whole mesh, as forward
    #: computes with it and its gradient arrives (``_spmd.py``)
    spmd: SpmdParam | None = None

    @property
    def local(self) -> torch.Tensor:
        """The tensor the unit shards: the parameter, or a DTensor parameter's local tensor."""
        return self.param.to_local() if isinstance(self.param, DTensor) else self.param


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
        #: tensor or expert parallelism: the parameter's DTensor spec; its unsharded form is a
        #: DTensor of it whose local tensor is the view (what the parallel modules compute with)
        self.parallel = registration.parallel
        #: under ``dp_mesh_dims``: the unsharded form is a DTensor on the whole mesh instead
        self.spmd = registration.spmd
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

    @property
    def unsharded_is_dtensor(self) -> bool:
        """Whether forward computes with a DTensor (tensor or expert parallelism, or the
        full-mesh form) rather than a plain tensor."""
        return self.parallel is not None or self.spmd is not None

    def bind_unsharded(self, view: torch.Tensor) -> None:
        """The unsharded parameter's values become ``view`` (of the gathered buffer, or of the
        shard): its data, or its local tensor when it is a DTensor."""
        if not self.unsharded_is_dtensor:
            self.unsharded.data = view
        else:
            # Through ``.data``, as a plain parameter: the local tensor keeps its own version
            # counter, so the all-gather that refills the buffer in backward does not make
            # stale the views forward took of it (``to_local()``, as expert-parallel experts
            # read their weights); FSDP2 preserves the counter for the same reason.
            self.unsharded._local_tensor.data = view

    def unsharded_local(self) -> torch.Tensor:
        """The unsharded parameter's values (a DTensor's local tensor), as ``.data``: a copy
        into them bumps no version counter (see :meth:`bind_unsharded`)."""
        return (
            self.unsharded._local_tensor.data if self.unsharded_is_dtensor else self.unsharded.data
        )

    def set_unsharded_grad(self, view: torch.Tensor | None) -> None:
        """The unsharded parameter's gradient becomes ``view`` (autograd accumulates into it),
        placed as the parameter under tensor parallelism (``Partial`` over the data-parallel
        dims of the full-mesh form); ``None`` clears it."""
        if view is None or not self.unsharded_is_dtensor:
            self.unsharded.grad = view
            return
        spec = self.unsharded._spec if self.spmd is None else self.spmd.grad_spec(view.dtype)
        self.unsharded.grad = DTensor(view, spec, requires_grad=False)

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
        out = []
        for owner, attr in self.owners:
            path = paths.get(id(owner))
            if path is None:
                continue
            key = f"{prefix}{path}.{attr}" if path else f"{prefix}{attr}"
            out.append((key, owner._parameters[attr]))
        return out

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn!r}, shape={list(self.shape)}, offset={self.offset})"


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
