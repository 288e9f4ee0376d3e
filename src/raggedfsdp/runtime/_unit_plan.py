"""Which buckets a unit's parameters go in, and each bucket's plan."""

from __future__ import annotations

import dataclasses

import torch

from ..planner import Bucket, ShardPlan, StructAwarePlanner, unit_buckets
from ._param import Registration

__all__ = ["plan_unit_buckets"]


def plan_unit_buckets(
    registrations: list[Registration],
    planner: StructAwarePlanner,
    world: int,
    *,
    param_dtype: torch.dtype | None,
    buffer_size: int | None,
) -> list[tuple[Bucket, ShardPlan]]:
    """The unit's buckets as :func:`~raggedfsdp.planner.unit_buckets` decides them (the same
    function ``plan_model`` uses), each planned by ``planner``; then one bucket for each
    parameter whose form plans its own (``own_bucket``), named ``<root>/<dtype>[/frozen]/<its
    name>``."""

    def buckets_of(members: list[Registration]) -> list[Bucket]:
        pieces = [(r.fqn, r.local) for r in members]
        return unit_buckets("", pieces, param_dtype=param_dtype, buffer_size=buffer_size)

    planned = [
        (bucket, planner.plan_bucket(bucket, world))
        for bucket in buckets_of([r for r in registrations if not r.placement.own_bucket])
    ]
    for registration in registrations:
        if registration.placement.own_bucket:
            (bucket,) = buckets_of([registration])
            named = f"{bucket.name.rsplit('/', 1)[0]}/{registration.fqn}"
            bucket = dataclasses.replace(bucket, name=named)
            planned.append((bucket, registration.placement.plan(bucket, world)))
    return planned
