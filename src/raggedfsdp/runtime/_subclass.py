"""Parameters whose local tensor is a tensor subclass: FSDP2's all-gather extension protocol.

A subclass (torchao's float8 weight, NF4, a test's ``TwoTensor``) joins FSDP2 through two methods
on its local tensor: ``fsdp_pre_all_gather`` (this rank's shard -> the tensors to all-gather, and
metadata) and ``fsdp_post_all_gather`` (every rank's tensors, concatenated along dim 0 -> the
unsharded parameter, or refill ``out=`` in place). raggedfsdp cannot put such a parameter in a
bucket's flat buffer as it puts a plain one (its data is not one tensor of its dtype), so it has
to follow the protocol, or refuse the parameter: never train its inner data in its place.
"""

from __future__ import annotations

import torch
from torch import nn

from ._param import Registration

__all__ = ["check_subclasses", "is_subclass", "speaks_protocol"]


def is_subclass(tensor: object) -> bool:
    """Whether ``tensor`` (a parameter's local tensor) is a tensor subclass, not a plain tensor
    or a plain ``nn.Parameter``."""
    return isinstance(tensor, torch.Tensor) and type(tensor) not in (torch.Tensor, nn.Parameter)


def speaks_protocol(tensor: object) -> bool:
    """Whether ``tensor`` has both methods of FSDP2's all-gather extension protocol (a subclass,
    or a plain tensor given them as instance methods, as FSDP2 allows)."""
    return all(
        callable(getattr(tensor, name, None))
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather")
    )


def _class_name(tensor: object) -> str:
    cls = type(tensor)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_subclasses(registrations: list[Registration]) -> None:
    """One clear error at ``fully_shard``, before any collective, for a parameter whose local
    tensor is a subclass raggedfsdp cannot shard: without FSDP2's protocol its inner data would
    be gathered and trained in its place."""
    for registration in registrations:
        local = registration.local
        if not is_subclass(local):
            continue
        if speaks_protocol(local):
            raise NotImplementedError(
                f"parameter {registration.fqn!r} is a {_class_name(local)} with FSDP2's "
                f"all-gather extension protocol, which raggedfsdp does not follow yet: it "
                f"would gather and train the data inside it in its place"
            )
        raise TypeError(
            f"parameter {registration.fqn!r} is a {_class_name(local)}, a tensor subclass "
            f"without FSDP2's all-gather extension protocol (fsdp_pre_all_gather / "
            f"fsdp_post_all_gather): raggedfsdp would gather and train the data inside it in "
            f"its place; give the class the protocol, keep the parameter out of the unit "
            f"(ignored_params), or make it a plain tensor"
        )
