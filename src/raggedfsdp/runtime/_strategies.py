"""Which all-gather and reduce-scatter a bucket carries, chosen once when the bucket is built.

And again when its shard moves to another dtype or device: [Note: one strategy per bucket] in
``_comm.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layout import RaggedShard
from ..planner import Bucket, ShardPlan
from ._comm import (
    AllGather,
    CastAllGather,
    CastReduceScatter,
    CopyInAllGather,
    HostOffloadAllGather,
    InPlaceAllGather,
    InPlaceReduceScatter,
    ReduceScatter,
)
from ._dbuffer import DBuffer
from ._mesh import MeshInfo
from ._offload import HostOffload
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy
from .compression import (
    BucketCodec,
    Finding,
    QuantizedAllGather,
    QuantizedReduceScatter,
    Residual,
)

__all__ = ["UnitComm"]


@dataclass(frozen=True)
class UnitComm:
    """What a unit's choice of strategies depends on that is fixed for the unit's life (the
    device and the offload are passed per choice: they change when the shards move)."""

    mesh_info: MeshInfo
    config: DBufferConfig
    mp_policy: MixedPrecisionPolicy
    policy: RaggedShard  # the unit's shard policy: the codec's quantization blocks
    compression: CommCompression | None
    #: a parameter's name in a bucket -> its name in the model, read when raising
    qualify: Callable[[str], str]
    #: hands what a compressed collective found non-finite to the root's check
    report: Callable[[Finding], None]

    def choose(
        self,
        bucket: Bucket | DBuffer,
        plan: ShardPlan,
        device: torch.device,
        offload: HostOffload | None,
    ) -> tuple[AllGather, ReduceScatter | None]:
        """The bucket's all-gather and (trainable buckets) reduce-scatter. For each, the first
        that applies: compressed, then (all-gather) offloaded, cast, in place, copied in;
        (reduce-scatter) cast, in place."""
        info, compression = self.mesh_info, self.compression
        p2p = self.config.gloo_point_to_point  # or, on Gloo, the calls NCCL gets
        codec = None
        if compression is not None and compression.enabled:
            codec = _codec(bucket.dtype, plan, self.policy, compression)
        gather: AllGather
        group, rank = info.shard_group, info.shard_rank
        if codec is not None and compression.all_gather is not None:
            args = (codec, compression.all_gather, self.qualify, self.report)
            gather = QuantizedAllGather(group, *args, gloo_point_to_point=p2p)
        elif offload is not None:
            gather = HostOffloadAllGather(group, rank, offload, gloo_point_to_point=p2p)
        elif bucket.comm_dtype != bucket.dtype:
            gather = CastAllGather(group, rank, gloo_point_to_point=p2p)
        elif self.config.zero_copy:
            gather = InPlaceAllGather(group, rank, gloo_point_to_point=p2p)
        else:
            gather = CopyInAllGather(group, rank, gloo_point_to_point=p2p)
        if not bucket.requires_grad:
            return gather, None
        if codec is not None and compression.reduce_scatter is not None:
            residual = None
            if compression.error_feedback:
                residual = Residual(codec, compression.residual_storage, device)
            args = (codec, compression.reduce_scatter, residual, self.qualify, self.report)
            return gather, QuantizedReduceScatter(info, *args, gloo_point_to_point=p2p)
        reduce_dtype = self.mp_policy.reduce_dtype
        if reduce_dtype is None or reduce_dtype == bucket.comm_dtype:
            return gather, InPlaceReduceScatter(info, plan.shard_numel, gloo_point_to_point=p2p)
        return gather, CastReduceScatter(
            info, plan.shard_numel, reduce_dtype, gloo_point_to_point=p2p
        )


def _codec(
    dtype: torch.dtype, plan: ShardPlan, policy: RaggedShard, compression: CommCompression
) -> BucketCodec:
    """The bucket's codec under ``compression``: floating-point parameters only."""
    if not dtype.is_floating_point:
        raise ValueError(
            f"parameter {plan.model_order[0]!r} is {dtype}: compressed communication "
            f"quantizes floating-point parameters only; make it a buffer or shard it without "
            f"compression"
        )
    return BucketCodec(plan, policy, compression.block_size)
