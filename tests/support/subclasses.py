"""Tensor subclasses for the tests of FSDP2's all-gather extension protocol, written after the
shapes of torchao's (``WeightWithDynamicFloat8CastTensor``, ``NF4Tensor``) and of PyTorch's own
extension test (``test_fully_shard_extensions.py``), in this project's code.

- :class:`Opaque`: a wrapper with no protocol (raggedfsdp must refuse it, never train its data);
- :class:`Fp8CastWeight`: a trainable fp32 weight that computes through a per-row fp8 cast, and
  whose all-gather sends that cast (fp8 codes + one fp32 scale per row; the 5-argument
  ``fsdp_pre_all_gather``, ``fsdp_post_all_gather`` with ``out=``).

The frozen block-quantized weight (packed 4-bit codes + one fp32 scale per 64 elements, the
1-argument ``fsdp_pre_all_gather``, ``fsdp_block_numel``) is the QLoRA job's own,
:class:`raggedfsdp.models.nf4.NF4Weight`, which the tests import from there.

Each computes as its dequantized value, so one process gives the reference numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.tensor import DTensor

__all__ = ["Fp8CastWeight", "Fp8CastWeightReleasing", "Opaque", "fp8_qdq"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max

#: ops after which a wrapper keeps its class (views, copies, in-place updates); others compute
#: on the plain value
_KEEP = {
    torch.ops.aten.detach.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.split.Tensor,  # FSDP2 chunks a parameter into its shards
    torch.ops.aten.new_zeros.default,  # ... and pads them
}


def _wrapper(cls: type, data: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_wrapper_subclass(
        cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device
    )


class Opaque(torch.Tensor):
    """A wrapper of one tensor with no FSDP protocol."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Opaque:
        return _wrapper(cls, data)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        if func in _KEEP:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        if func._schema.is_mutable:  # an in-place update (an optimizer's): the wrapper itself
            return args[0]
        return out

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: Any, size: Any, stride: Any) -> Opaque:
        return cls(inner["_data"])


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.t.default)


def fp8_qdq(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``data`` (2-D) cast to fp8 with one fp32 scale per row: ``(codes, scales [rows, 1])``."""
    amax = data.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (data.detach().float() / scale).to(FP8), scale


class Fp8CastWeight(Opaque):
    """A trainable fp32 weight whose matmuls see its per-row fp8 cast (as torchao's float8
    training casts the weight in forward); under FSDP the all-gather sends that cast."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _MATMULS:

            def cast(t: Fp8CastWeight) -> torch.Tensor:
                codes, scale = fp8_qdq(t._data)
                return codes.float() * scale

            unwrap = pytree.tree_map_only(cls, cast, (args, kwargs or {}))
            return func(*unwrap[0], **unwrap[1])
        return super().__torch_dispatch__(func, types, args, kwargs)

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        assert outer_size[1:] == self.shape[1:], (outer_size, self.shape)
        return fp8_qdq(self._data), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        codes, scale = outputs
        assert codes.dtype == FP8 and scale.dtype == torch.float32, (codes.dtype, scale.dtype)
        value = codes.to(param_dtype) * scale.to(param_dtype)
        if isinstance(out, DTensor):  # beside tensor parallelism: its local tensor (as torchao)
            out = out._local_tensor
        if out is not None:  # the unsharded parameter of an earlier step, refilled in place
            # FSDP2 refills outside no_grad, raggedfsdp inside: either way not for autograd
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(value)
            return None
        return value, (value,)


class Fp8CastWeightReleasing(Fp8CastWeight):
    """:class:`Fp8CastWeight` saying that its all-gather outputs may go once
    ``fsdp_post_all_gather`` has run (its unsharded value is a new tensor, aliasing none)."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True
