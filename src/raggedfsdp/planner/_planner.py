"""StructAwarePlanner: each parameter's unit, and the plan of one bucket or of a whole model.

A unit follows the policy and the optimizer. The search itself is in ``_search.py``, its arithmetic
in ``_placement.py``.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from ..layout import BlockSize, RaggedShard, row_numel
from ._placement import Item, lower_bound, place
from ._plan import PlanEntry, ShardPlan
from ._search import search
from .bucketing import Bucket, WrapPolicy, model_buckets
from .quant_blocks import Compression, quant_block

__all__ = ["OPTIMIZER_TYPES", "OptimizerType", "StructAwarePlanner"]

#: The optimizers whose blocks the planner keeps whole (``None``: the policy's units alone).
OptimizerType = Literal["adamw", "muon", "shampoo", "adamw8bit"]
OPTIMIZER_TYPES: tuple[str, ...] = typing.get_args(OptimizerType)


class StructAwarePlanner:
    """Plans buckets so that every rank holds equal shards and no unit is split.

    Args:
        optimizer_type: the optimizer the shards must serve. ``None``/``"adamw"``: the policy's
            unit alone; ``"muon"``: whole rows of matrices; ``"shampoo"``: blocks of
            ``max_preconditioner_dim`` rows (default 1024); ``"adamw8bit"``: its quantization block
            (``block_numel`` elements of the flattened tensor, default 256, or the policy's tile
            rows when the policy gives a block).
        shard_policy: the :class:`RaggedShard` policy (default: element granularity).
        alignment_bytes: every offset and the shard size are multiples of this many bytes.
        compression: a :class:`raggedfsdp.CommCompression`; every unit is then also a multiple
            of the parameter's quantization block (:mod:`.quant_blocks`).
        **optimizer_options: ``max_preconditioner_dim`` (shampoo), ``block_numel`` (adamw8bit).
    """

    def __init__(
        self,
        optimizer_type: OptimizerType | None = None,
        shard_policy: RaggedShard | None = None,
        alignment_bytes: int = 16,
        compression: Compression | None = None,
        **optimizer_options: int,
    ) -> None:
        if optimizer_type is not None and optimizer_type not in OPTIMIZER_TYPES:
            raise ValueError(
                f"unknown optimizer_type {optimizer_type!r}; expected one of "
                f"{(None, *OPTIMIZER_TYPES)}"
            )
        allowed = {"shampoo": {"max_preconditioner_dim"}, "adamw8bit": {"block_numel"}}
        unknown = set(optimizer_options) - allowed.get(optimizer_type or "", set())
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for optimizer_type {optimizer_type!r}"
            )
        for key, value in optimizer_options.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if isinstance(alignment_bytes, bool) or not isinstance(alignment_bytes, int):
            raise ValueError(f"alignment_bytes must be a positive integer, got {alignment_bytes!r}")
        if alignment_bytes < 1:
            raise ValueError(f"alignment_bytes must be a positive integer, got {alignment_bytes!r}")
        self.optimizer_type = optimizer_type
        self.shard_policy = shard_policy if shard_policy is not None else RaggedShard()
        self.alignment_bytes = alignment_bytes
        self.max_preconditioner_dim = optimizer_options.get("max_preconditioner_dim", 1024)
        self.block_numel = optimizer_options.get("block_numel", 256)
        self.compression = compression if compression is not None and compression.enabled else None
        self._cache: dict[tuple, ShardPlan] = {}
        # shape -> unit, while the policy has no per-name overrides (the unit then depends on
        # the shape alone): a layer of hundreds of experts repeats a few shapes.
        self._units: dict[tuple[int, ...], int] = {}

    def __repr__(self) -> str:
        return (
            f"StructAwarePlanner(optimizer_type={self.optimizer_type!r}, "
            f"shard_policy={self.shard_policy!r}, alignment_bytes={self.alignment_bytes})"
        )

    def _optimizer_unit(self, name: str, shape: tuple[int, ...]) -> tuple[int, BlockSize]:
        """Elements the optimizer needs kept together, and how to describe it in errors."""
        ndim = len(shape)
        if self.optimizer_type == "muon" and ndim >= 2:
            return row_numel(shape), "1 row"
        if self.optimizer_type == "shampoo" and ndim >= 2:
            b = self.max_preconditioner_dim
            return b * row_numel(shape), f"{b} rows (max_preconditioner_dim)"
        if self.optimizer_type == "adamw8bit":
            if ndim >= 2 and self.shard_policy.block_rows(name, shape) is not None:
                return 1, "the policy's tiles"  # tiles are the quantization blocks
            return self.block_numel, f"{self.block_numel} elements (block_numel)"
        return 1, None

    def unit_numel(self, name: str, shape: Sequence[int] | torch.Size) -> int:
        """The unit of ``name``: the lcm of what the policy asks and what the optimizer needs."""
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        policy_unit = self.shard_policy.unit_numel(name, shape)
        optimizer_unit, described = self._optimizer_unit(name, shape)
        unit = math.lcm(policy_unit, optimizer_unit)
        if self.compression is not None:
            block = quant_block(name, shape, self.shard_policy, self.compression.block_size)
            unit = math.lcm(unit, block.unit_numel)
            described = f"{described or '1 element'} and quantization block {block}"
        if self.shard_policy.padding_strategy == "error" and numel and numel % unit:
            raise ValueError(
                f"parameter {name!r} of shape {list(shape)}: policy block "
                f"{self.shard_policy.block_for(name)!r} and optimizer block {described} need "
                f"units of {unit} elements, which do not divide its {numel} elements "
                f"(padding_strategy='error')"
            )
        return min(unit, max(numel, 1))

    def plan(
        self,
        params: Mapping[str, torch.Tensor | torch.Size | tuple[int, ...]],
        world_size: int,
        dtype: torch.dtype | None = None,
        *,
        name: str = "",
    ) -> ShardPlan:
        """Plan ONE bucket. ``params`` is ordered (model order); tensors may be on meta."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not params:
            raise ValueError("cannot plan an empty bucket: params has no entries")
        dtype = dtype or _bucket_dtype(params)
        alignment = max(1, self.alignment_bytes // dtype.itemsize)
        rows = []  # (name, shape, numel, unit); Items are built only when the cache misses
        units = None if self.shard_policy.overrides else self._units
        for pname, value in params.items():
            shape = tuple(int(d) for d in (value.shape if torch.is_tensor(value) else value))
            unit = units.get(shape) if units is not None else None
            if unit is None:
                if any(d < 0 for d in shape):
                    raise ValueError(f"parameter {pname!r} has a negative dimension: {list(shape)}")
                unit = self.unit_numel(pname, shape)
                if units is not None:
                    units[shape] = unit
            rows.append((pname, shape, math.prod(shape), unit))
        key = (tuple((n, u, shape) for _, shape, n, u in rows), world_size, alignment, dtype)
        cached = self._cache.get(key)
        if cached is not None:
            return cached.renamed([row[0] for row in rows], name)
        items = [Item(*row) for row in rows]
        shard, order = search(items, world_size, alignment)
        offsets = place(order, shard, alignment, world_size * shard) if shard else None
        entries = {
            it.name: PlanEntry(it.name, it.shape, it.numel, offsets[i] if offsets else 0, it.unit)
            for i, it in enumerate(order)
        }
        plan = ShardPlan(
            world_size,
            shard,
            entries,
            alignment,
            dtype,
            lower_bound([it for it in items if it.numel], world_size, alignment),
            name,
            tuple(it.name for it in items),
        )
        self._cache[key] = plan
        return plan

    def plan_model(
        self,
        module: nn.Module,
        world_size: int,
        *,
        buffer_size: int | None = None,
        dtype: torch.dtype | None = None,
        wrap: WrapPolicy = None,
    ) -> list[ShardPlan]:
        """Plan every bucket of a model exactly as the runtime will (:mod:`.bucketing`): one
        per FSDP unit, dtype and ``requires_grad``, split in model order at ``buffer_size``
        bytes of the communication dtype ``dtype`` (mixed precision's ``param_dtype`` for
        floating parameters; ``None``: their own). ``wrap`` is ``FSDPBackend``'s predicate.
        Identical buckets (repeated layers) are planned once."""
        buckets = model_buckets(module, param_dtype=dtype, buffer_size=buffer_size, wrap=wrap)
        return [self.plan_bucket(bucket, world_size) for bucket in buckets]

    def plan_bucket(self, bucket: Bucket, world_size: int) -> ShardPlan:
        """Plan one :class:`~.bucketing.Bucket` (in its planning dtype, under its name)."""
        return self.plan(bucket.params, world_size, bucket.plan_dtype, name=bucket.name)


def _bucket_dtype(params: Mapping[str, object]) -> torch.dtype:
    dtypes = {v.dtype for v in params.values() if torch.is_tensor(v)}
    if len(dtypes) > 1:
        raise ValueError(
            f"a bucket needs one dtype, got {sorted(map(str, dtypes))}; pass dtype= (the "
            f"communication dtype) or split the bucket"
        )
    return dtypes.pop() if dtypes else torch.float32
