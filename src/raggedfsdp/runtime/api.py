"""The runtime's public configuration: frozen, keyword-only, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

__all__ = ["CommCompression", "DBufferConfig", "MixedPrecisionPolicy", "ResidualStorage"]

#: How error-feedback residuals are stored (``CommCompression.residual_storage``).
ResidualStorage = Literal["int8", "bf16", "fp32"]


@dataclass(frozen=True, kw_only=True)
class DBufferConfig:
    """How the runtime lays out and manages bucket buffers.

    Attributes:
        zero_copy: parameters and gradients are views of the bucket buffers, so collectives run
            in place. ``False`` is an FSDP2-style copy-in/copy-out path kept for A/B measurement.
        group_level: memory is managed per unit and shared across units: the unsharded
            parameter buffers of all buckets of a unit share one storage, allocated and freed
            as a whole, and the gradient and reduce-scatter scratch blocks come from one pool
            shared by all units of the model, reused from unit to unit within a backward and
            emptied at its end. ``False`` gives each bucket its own parameter storage and
            allocates every scratch block afresh (as FSDP2 does). Unsharded *parameter*
            storage is not pooled across units: see [Note: freeing unsharded storage].
        buffer_size: a unit's parameters are split into buckets of at most this many bytes (in
            the communication dtype); a single larger parameter gets its own bucket; ``None`` makes
            each unit one bucket per dtype.
        host_copies_on_cpu: with ``offload_policy=CPUOffloadPolicy()`` on a CPU device, keep
            the shards in separate host buffers and copy them to and from the unsharded buffers
            as on an accelerator, instead of meeting the policy as is (on CPU everything is on
            the host already). It runs the accelerator's offload path on CPU, for tests and
            measurements; no effect without that policy or on an accelerator.
        gloo_point_to_point: on Gloo, exchange shards point to point (each peer's shard
            received straight into its slot: fewer copies on CPU, [Note: all-gather on Gloo]
            in ``runtime/_collectives.py``); ``False`` runs the tensor collectives NCCL runs
            (``all_gather_single``, ``reduce_scatter_single`` with ``AVG``,
            ``all_to_all_single`` under compression) on Gloo too, the same calls with the same
            buffers: how the NCCL branch is tested without a GPU. No effect on NCCL.
    """

    zero_copy: bool = True
    group_level: bool = True
    buffer_size: int | None = None
    host_copies_on_cpu: bool = False
    gloo_point_to_point: bool = True

    def __post_init__(self) -> None:
        if self.buffer_size is not None and (
            isinstance(self.buffer_size, bool)
            or not isinstance(self.buffer_size, int)
            or self.buffer_size < 1
        ):
            raise ValueError(
                f"DBufferConfig.buffer_size must be a positive number of bytes or None, "
                f"got {self.buffer_size!r}"
            )


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters and the gradient reduction; master shards keep their
    own dtype (fp32). FSDP2's four fields with FSDP2's meanings (torch's
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` is accepted too and read into this).

    Attributes:
        param_dtype: dtype of the unsharded parameters (what forward computes with); ``None``
            keeps the parameter's dtype.
        reduce_dtype: dtype of the gradient reduction; ``None`` reduces in ``param_dtype``.
            Under a compressed reduce-scatter (``CommCompression.reduce_scatter``) the sum is
            fp32 whatever ``param_dtype`` is, so only ``None`` or ``torch.float32`` are accepted
            there (anything else is a ``ValueError`` at ``fully_shard``).
        output_dtype: floating-point forward outputs of the module are cast to it (e.g. fp32
            logits from a bf16 model); ``None`` leaves them as computed.
        cast_forward_inputs: floating-point forward inputs are cast to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def of(cls, policy: object | None) -> MixedPrecisionPolicy:
        """``policy`` as this class: ours as is, torch's FSDP2 policy field by field, ``None`` as
        the default; anything else is a ``TypeError``."""
        if policy is None:
            return cls()
        if isinstance(policy, cls):
            return policy
        if isinstance(policy, TorchMixedPrecisionPolicy):
            return cls(
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.reduce_dtype,
                output_dtype=policy.output_dtype,
                cast_forward_inputs=policy.cast_forward_inputs,
            )
        raise TypeError(
            f"mp_policy must be rf.MixedPrecisionPolicy or torch.distributed.fsdp."
            f"MixedPrecisionPolicy, got {type(policy).__name__}"
        )


def _dtypes(*names: str) -> tuple[torch.dtype, ...]:
    """The named dtypes this torch has (the fp8 ones only exist from torch 2.1)."""
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


#: The code dtypes each direction supports (docs/design.md, "Compressed communication").
ALL_GATHER_DTYPES = _dtypes("float8_e4m3fn", "int8")
REDUCE_SCATTER_DTYPES = _dtypes("int8", "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True, kw_only=True)
class CommCompression:
    """Block-quantized communication: 8-bit codes plus one fp32 scale per quantization block
    travel instead of the parameters (all-gather) or the gradients (reduce-scatter).

    A parameter's block is a tile of its 2-D view (or a run of its flattened elements) that the
    planner never splits across ranks, so each rank quantizes its own whole blocks with local
    scales: the numbers do not depend on the world size and no extra collective (no amax
    all-reduce) is needed. Master weights, optimizer states and the optimizer's arithmetic are
    unchanged. Formulas: docs/design.md, "Compressed communication".

    Attributes:
        all_gather: code dtype of the parameters' all-gather (``torch.float8_e4m3fn`` or
            ``torch.int8``); ``None`` gathers them uncompressed.
        reduce_scatter: code dtype of the gradients' reduce-scatter (``torch.int8``,
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``); ``None``: uncompressed. The owner
            of a shard sums the dequantized contributions in fp32, in rank order, and the reduced
            shard is fp32: a ``MixedPrecisionPolicy.reduce_dtype`` other than ``None`` or fp32
            conflicts with it (``ValueError`` at ``fully_shard``).
        block_size: the quantization block: ``b`` (``b x b`` tiles; runs of ``b`` for 1-D
            parameters) or ``(rows, cols)``; ``None`` follows the shard policy (``b`` -> ``b x b``,
            ``"whole"`` -> ``128 x 128``, element -> runs of 256 elements). It must divide the
            policy's tiles.
        error_feedback: each rank keeps what quantizing its gradient dropped and adds it to its
            next gradient before quantizing (needs ``reduce_scatter``).
        residual_storage: how error feedback stores the residual (one ``[W*S]`` per trainable
            bucket per rank): ``"int8"`` (codes and a scale per quantization block, a quarter of
            fp32's memory) keeps the error of a long sum of gradients where ``"fp32"`` keeps it;
            ``"bf16"`` (half) lets it drift further (docs/compression.md). Only read with
            ``error_feedback``.
    """

    all_gather: torch.dtype | None = None
    reduce_scatter: torch.dtype | None = None
    block_size: int | tuple[int, int] | None = None
    error_feedback: bool = False
    residual_storage: ResidualStorage = "int8"

    def __post_init__(self) -> None:
        _check_code_dtype("all_gather", self.all_gather, ALL_GATHER_DTYPES)
        _check_code_dtype("reduce_scatter", self.reduce_scatter, REDUCE_SCATTER_DTYPES)
        block = self.block_size
        if isinstance(block, list):
            block = tuple(block)
            object.__setattr__(self, "block_size", block)
        if block is not None and not (
            _positive_int(block)
            or (isinstance(block, tuple) and len(block) == 2 and all(map(_positive_int, block)))
        ):
            raise ValueError(
                f"CommCompression.block_size must be None, a positive int or (rows, cols) of "
                f"positive ints, got {self.block_size!r}"
            )
        if not isinstance(self.error_feedback, bool):
            raise ValueError(
                f"CommCompression.error_feedback must be a bool, got {self.error_feedback!r}"
            )
        if self.residual_storage not in get_args(ResidualStorage):
            raise ValueError(
                f"CommCompression.residual_storage must be one of "
                f"{list(get_args(ResidualStorage))}, got {self.residual_storage!r}"
            )
        if self.error_feedback and self.reduce_scatter is None:
            raise ValueError(
                "CommCompression(error_feedback=True) needs reduce_scatter compression: error "
                "feedback keeps what quantizing the gradients drops, and reduce_scatter=None "
                "drops nothing"
            )

    @property
    def enabled(self) -> bool:
        """Whether any collective is compressed."""
        return self.all_gather is not None or self.reduce_scatter is not None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_code_dtype(field: str, dtype: object, supported: tuple[torch.dtype, ...]) -> None:
    if dtype is None or dtype in supported:
        return
    raise ValueError(
        f"CommCompression.{field}={dtype!r} is not supported; expected one of "
        f"{[str(d) for d in supported]} or None (torch {torch.__version__}: codes travel as "
        f"bytes, so any backend that moves uint8 moves them)"
    )
