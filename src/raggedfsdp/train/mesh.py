"""The job's ranks as a mesh: FSDP over data parallelism, beside tensor, expert or pipeline's.

``--tp`` or ``--ep``, and ``--pp``, as torchtitan lays them out (each mesh: the comment at
:class:`JobMesh`).
Every rank builds the same model from ``--seed`` and keeps its slices, so the trained numbers are
those of FSDP alone on the same global batch, up to the order of float sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..facts import ParallelDims
from ..models import expert_parallel, tensor_parallel
from ..runtime import FSDPBackend, fully_shard

__all__ = ["JobMesh", "check_model", "degrees_text", "device_mesh_of", "shard_model"]


# - ``--tp N``: a ``(dp, tp)`` mesh, tp innermost (consecutive ranks form a tensor-parallel group,
#   the ranks that share a node's fastest links). The blocks' projections, the embedding and the
#   head are split over tp (:mod:`raggedfsdp.models.tensor_parallel`), then every unit is sharded
#   over dp. The ``tp`` ranks of a group compute on the same sequences: there are ``dp`` data ranks.
# - ``--ep N``: a ``(dp, ep)`` mesh. Expert parallelism borrows its ranks from data parallelism
#   (every rank reads its own sequences, so all ``world`` ranks are data ranks): each experts
#   module's experts are split over ep (:mod:`raggedfsdp.models.expert_parallel`; tokens travel to
#   their expert and back by all-to-all) and sharded over dp; every other parameter is sharded over
#   dp and ep flattened. Gradients are averaged over all data ranks, the experts' too.
# - ``--pp N``: a ``(pp, dp[, tp])`` mesh, pp outermost (torchtitan's order: a pipeline's stages
#   on different nodes, its neighbours' activations the only traffic between them). Each rank holds
#   its stages' layers (:mod:`.pipeline`), split over tp and sharded over dp as above; the ranks of
#   a pipeline read the same sequences. Not with ``--ep``.
@dataclass(frozen=True, init=False)
class JobMesh:
    """Where one rank sits among ``world`` ranks split ``tp`` and ``ep`` ways.

    Attributes:
        dims: the degrees over the job's world (``dp_shard`` resolved).
        rank: this rank.
    """

    dims: ParallelDims
    rank: int

    def __init__(self, world: int, rank: int = 0, *, tp: int = 1, ep: int = 1, pp: int = 1) -> None:
        """``world`` ranks, ``tp`` tensor-parallel (innermost) or ``ep`` expert-parallel
        (borrowed from data parallelism), in ``pp`` pipeline stages (outermost); ``ValueError``
        naming the fault else."""
        dims = ParallelDims(tp=tp, ep=ep, pp=pp).at_world(world)
        if dims.tp > 1 and dims.ep > 1:
            raise ValueError(
                f"tp={dims.tp} with ep={dims.ep}: the job runs tensor or expert parallelism "
                f"beside FSDP, not both at once; choose one"
            )
        if dims.pp > 1 and dims.ep > 1:
            raise ValueError(
                f"pp={dims.pp} with ep={dims.ep}: the job runs pipeline stages beside FSDP and "
                f"tensor parallelism, not expert parallelism yet; choose one"
            )
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "rank", rank)

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.dims.world_size

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (innermost)."""
        return self.dims.tp

    @property
    def ep(self) -> int:
        """Expert-parallel degree (borrowed from data parallelism)."""
        return self.dims.ep

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree (outermost)."""
        return self.dims.pp

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline."""
        return self.rank // (self.world // self.pp)

    @property
    def dp(self) -> int:
        """FSDP ranks of a tensor-parallel slice, of an expert or of a stage: ``world / (tp x ep
        x pp)``."""
        return self.dims.dp_shard_mod_ep

    @property
    def data_ranks(self) -> int:
        """Ranks that read sequences of their own: ``world / (tp x pp)`` (ep borrows from
        dp)."""
        return self.dims.dp

    @property
    def data_rank(self) -> int:
        """This rank's slice of each global batch (tp peers and a pipeline's stages share
        one)."""
        return (self.rank % (self.world // self.pp)) // self.tp

    @property
    def parallel(self) -> bool:
        """Whether anything besides FSDP splits the model."""
        return self.dims.model_parallel * self.pp > 1

    def describe(self) -> dict[str, int]:
        """The mesh's degrees, for checkpoints and banners: ``{"dp": world}`` for FSDP alone
        (what a checkpoint of FSDP alone always meant), else with ``pp``, ``tp`` or ``ep``."""
        stages = {"pp": self.pp} if self.pp > 1 else {}
        if self.tp > 1:
            return {**stages, "dp": self.dp, "tp": self.tp}
        if self.ep > 1:
            return {"dp": self.dp, "ep": self.ep}
        return {**stages, "dp": self.dp}

    def __str__(self) -> str:
        return degrees_text(self.describe())


def degrees_text(degrees: Mapping[str, int]) -> str:
    """``dp=2 x tp=2``: a mesh's degrees as :meth:`JobMesh.describe` (and a checkpoint's
    ``COMPLETE.json``) records them."""
    return " x ".join(f"{k}={v}" for k, v in degrees.items())


def check_model(model: nn.Module, mesh: JobMesh, name: str) -> None:
    """``ValueError`` naming the fault unless ``model`` (on any device, meta too) can be split
    as ``mesh`` asks: before any rank meets another."""
    if mesh.tp > 1:
        tensor_parallel.check_tensor_parallel(model, mesh.tp, name=name)
    if mesh.ep > 1:
        try:
            expert_parallel.check_expert_parallel(model, mesh.ep)
        except ValueError as err:  # named by the option, as the tensor-parallel checks are
            raise ValueError(f"ep: {err}") from None


def device_mesh_of(mesh: JobMesh, device: torch.device) -> DeviceMesh:
    """The torch ``DeviceMesh`` of ``mesh`` (a collective): ``(pp, dp[, tp])`` or ``(dp,
    tp)``, ``(dp, ep)``; its dims named so."""
    dims = [("pp", mesh.pp)] if mesh.pp > 1 else []
    dims.append(("dp", mesh.dp))
    if mesh.tp > 1 or mesh.ep > 1:
        dims.append(("tp", mesh.tp) if mesh.tp > 1 else ("ep", mesh.ep))
    names, sizes = zip(*dims, strict=True)
    return init_device_mesh(device.type, sizes, mesh_dim_names=names)


def shard_model(
    model: nn.Module,
    mesh: JobMesh,
    device: torch.device,
    *,
    device_mesh: DeviceMesh | None = None,
    **fsdp: Any,
) -> nn.Module:
    """Split ``model`` as ``mesh`` says, then shard it with :func:`FSDPBackend` (``fsdp``: its
    keyword arguments, the planner and the mixed precision among them): every unit over all
    ranks for FSDP alone; over dp beside tp (and for a pipeline stage); beside ep each experts
    module over dp (a unit of its own), the rest over dp and ep flattened. ``device_mesh``:
    :func:`device_mesh_of` ``mesh``, made once for several stages (default: made here). A
    collective: every rank calls it."""
    if not mesh.parallel:
        return FSDPBackend(model, **fsdp)
    device_mesh = device_mesh or device_mesh_of(mesh, device)
    if mesh.ep == 1:
        if mesh.tp > 1:
            tensor_parallel.parallelize_tensor(model, device_mesh["tp"])
        return FSDPBackend(model, mesh=device_mesh["dp"], **fsdp)
    for experts in expert_parallel.parallelize_experts(model, device_mesh["ep"]):
        fully_shard(experts, mesh=device_mesh["dp"], reshard_after_forward=True, **_unit(fsdp))
    dense = device_mesh["dp", "ep"]._flatten("dp_ep")  # every rank flattens (a collective)
    return FSDPBackend(model, mesh=dense, **fsdp)


def _unit(fsdp: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :func:`FSDPBackend` that :func:`fully_shard` takes too."""
    return {k: v for k, v in fsdp.items() if k in ("planner", "mp_policy", "dbuffer_config")}
