"""What tensor and expert parallelism send per step, and how long they take.

The activations and tokens they move, beside FSDP's parameters and gradients (:mod:`.steptime`); how
each is counted, with its sources, is the comment at :func:`parallel_bytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .hardware import Hardware
from .parallel import ModelSplit
from .shapes import ModelShape
from .step_shape import StepShape
from .steptime import StepTime

__all__ = ["ParallelBytes", "parallel_bytes", "with_parallel_time"]

#: ``(calls, input bytes, bytes sent, seconds)`` of one dimension's collectives per step.
_Figures = tuple[int, int, int, float]


@dataclass(frozen=True)
class ParallelBytes:
    """What tensor and expert parallelism move per step on one rank (module doc); zeros where
    the degree is 1."""

    tp_calls: int  # all-reduces of activations
    tp_bytes: int  # their input: calls x b s d x itemsize
    tp_wire_bytes: int  # sent on the link: 2 (tp - 1) / tp of the input
    tp_s: float  # their time
    ep_calls: int  # all-to-alls of routed tokens
    ep_bytes: int  # their input: calls x T k d x itemsize
    ep_wire_bytes: int  # sent to other ranks: (ep - 1) / ep of the input
    ep_s: float  # their time


def _tp(shape: ModelShape, step: StepShape, hw: Hardware, split: ModelSplit) -> _Figures:
    """``(calls, input, sent, seconds)`` of tensor parallelism's all-reduces."""
    tp = split.dims.tp
    if tp == 1:
        return 0, 0, 0, 0.0
    per_block = 4 + (2 if step.checkpointing else 0)
    calls = per_block * len(shape.blocks) + 2
    message = step.tokens * split.hidden * step.param_dtype.itemsize
    sent = calls * 2 * (tp - 1) * message // tp
    one = 2 * (tp - 1) * (hw.hop_latency_s(tp) + message / tp / hw.link_bytes_per_s(tp))
    return calls, calls * message, sent, calls * one


def _ep(step: StepShape, hw: Hardware, split: ModelSplit) -> _Figures:
    """``(calls, input, sent, seconds)`` of expert parallelism's all-to-alls."""
    ep = split.dims.ep
    if ep == 1:
        return 0, 0, 0, 0.0
    calls = (4 + (2 if step.checkpointing else 0)) * split.moe_layers
    message = step.tokens * split.experts_per_token * split.hidden * step.param_dtype.itemsize
    leaving = (ep - 1) * message // ep
    reach = ep * split.dims.tp  # the ep ranks are strided by tp
    one = (ep - 1) * hw.hop_latency_s(reach) + leaving / hw.link_bytes_per_s(reach)
    return calls, calls * message, calls * leaving, calls * one


# **Tensor parallelism** (tp > 1), sequence parallelism off, as Megatron-LM counts it (Shoeybi et
# al. 2019, section 3: "two all-reduces in the forward pass and two in the backward pass" of each
# transformer layer; Narayanan et al. 2021, section 3.2, the same): per block, forward all-reduces
# the outputs of the attention's and the MLP's row-parallel projections and backward the input
# gradients of their column-parallel ones, each an activation ``[b, s, d]`` in ``param_dtype``: ``M
# = b s d x itemsize``. The vocabulary-parallel embedding all-reduces its output in forward and the
# column-parallel head its input gradient in backward: two more per step (with loss parallelism the
# logits are never gathered; its per-token statistics, 8 bytes a token, are left out). Activation
# checkpointing recomputes each block's forward: two more per block. So
#
#     calls = (4 + 2 [checkpointing]) x L + 2, each a ring all-reduce of M over tp ranks:
#     input calls x M, sent 2 (tp - 1) / tp x calls x M, time 2 (tp - 1) (latency + M / tp / bw).
#
# With sequence parallelism (torchtitan's default) each all-reduce is an all-gather and a
# reduce-scatter of the same bytes (Korthikanti et al. 2022, section 4.2.2): the same figures.
#
# **Expert parallelism** (ep > 1): each MoE layer dispatches the rank's tokens to their experts and
# combines the results (two all-to-alls in forward, their gradients two in backward, and two again
# when checkpointing recomputes the forward); each all-to-all moves the ``T k`` token copies (``T =
# b s`` tokens of the rank's tensor-parallel group, ``k`` experts each, ``d`` wide), of which ``(ep
# - 1) / ep`` leave the rank under uniform routing:
#
#     calls = (4 + 2 [checkpointing]) x MoE layers, input T k d x itemsize each,
#     sent (ep - 1) / ep of it, time (ep - 1) x latency + sent / bw.
#
# Both run on the critical path (no asynchronous tensor parallelism, no overlap of dispatch with
# compute such as DeepSeek's DualPipe), at the slowest hop their ranks span: ``tp`` consecutive
# ranks (NVLink inside a node of 8), ``ep`` groups of them (``ep x tp`` ranks). Not modelled:
# DeepSeek-V3's node-limited routing and FP8 dispatch, load imbalance, the router's statistics.
def parallel_bytes(
    shape: ModelShape, step: StepShape, hw: Hardware, split: ModelSplit
) -> ParallelBytes:
    """Tensor and expert parallelism's bytes and seconds per step on one rank (module doc);
    ``shape`` is the rank's (:func:`~.shapes.model_shape` with ``split``)."""
    tp_calls, tp_bytes, tp_sent, tp_s = _tp(shape, step, hw, split)
    ep_calls, ep_bytes, ep_sent, ep_s = _ep(step, hw, split)
    return ParallelBytes(tp_calls, tp_bytes, tp_sent, tp_s, ep_calls, ep_bytes, ep_sent, ep_s)


def with_parallel_time(
    time: StepTime, parallel: ParallelBytes, step: StepShape, split: ModelSplit
) -> StepTime:
    """``time`` with tensor and expert parallelism's seconds added to the step, on its
    critical path, and tokens per second per device over the ``tp`` devices that share the
    step's tokens; ``time`` itself without a split."""
    if not split.splits:
        return time
    total = time.total_s + parallel.tp_s + parallel.ep_s
    return dataclasses.replace(
        time,
        total_s=total,
        tp_s=parallel.tp_s,
        ep_s=parallel.ep_s,
        tokens_per_s=step.tokens / split.dims.tp / total if total else 0.0,
    )
