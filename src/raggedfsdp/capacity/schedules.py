"""Pipeline schedules as the capacity planner sees them: activations in flight, and the bubble.

The schedules' names, torch's classes and the micro-batches each takes are
:mod:`raggedfsdp.facts.schedules`' (the job's too). How many micro-batches' activations a rank
holds at its peak is read off each class's action order (``torch/distributed/pipelining/
schedules.py``; the comment at :meth:`PipelineSchedule.in_flight`, which
``tests/unit/test_capacity_pipeline.py`` counts on torch's own ``pipeline_order``); the bubble is
the papers' formula (:meth:`PipelineSchedule.bubble_s`). Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..facts.schedules import check_schedule, is_looped, rounds, schedule_class

__all__ = ["PipelineSchedule"]


@dataclass(frozen=True)
class PipelineSchedule:
    """One schedule over ``pp`` ranks.

    Attributes:
        name: one of :data:`raggedfsdp.facts.PP_SCHEDULES`.
        pp: pipeline ranks.
        microbatches: micro-batches per step (``M``).
        stages_per_rank: ``v``, the looped schedules' local stages (rank ``r`` holds stages
            ``r, r + pp, ...``); 1 for GPipe and 1F1B.
    """

    name: str
    pp: int
    microbatches: int
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        schedule_class(self.name)  # a known name
        for what in ("pp", "microbatches", "stages_per_rank"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive integer, got {value!r}")
        # the refusals torch's constructors make, before any planning
        check_schedule(self.pp, self.name, self.microbatches, self.stages_per_rank)

    @property
    def stages(self) -> int:
        """Stages in all: ``pp x v``."""
        return self.pp * self.stages_per_rank

    @property
    def rounds(self) -> int:
        """The looped schedules' rounds (torch: ``number_of_rounds``)."""
        return rounds(self.pp, self.microbatches)

    @property
    def per_round(self) -> int:
        """Micro-batches per round (torch: ``microbatches_per_round``)."""
        return self.microbatches // self.rounds

    # In flight: the local-stage micro-batches whose activations rank ``r`` holds at its peak,
    # from forward to its last backward action (FULL_BACKWARD, or BACKWARD_WEIGHT where the
    # backward is split: the weight gradients need the layers' inputs), read off torch 2.13's
    # ``schedules.py``:
    #
    # - ScheduleGPipe: every forward before any backward: ``M``.
    # - Schedule1F1B: ``warmup_chunks = min(n_microbatches, num_stages - stage_index)`` forwards,
    #   then one backward before each further forward: ``min(M, pp - r)``.
    # - ScheduleInterleaved1F1B: ``_get_warmup_ops(..., multiply_factor=2)``, ``w = min((v - 1)
    #   x per_round + 2 (pp - 1 - r), M v)`` forwards, then each step of ``_get_1f1b_rank_ops``
    #   a forward before its backward: ``w + 1`` while forwards remain, else ``w``.
    # - ScheduleInterleavedZeroBubble: ``multiply_factor=1`` and the weight gradients of the
    #   first ``num_1f1b_microbatches = r`` backwards deferred, so ``w + 1 + r =
    #   (v - 1) per_round + pp``, at most ``M v``.
    def in_flight(self, rank: int) -> int:
        """Local-stage micro-batches whose activations rank ``rank`` holds at its peak (each a
        ``1 / v`` share of the rank's layers)."""
        if not 0 <= rank < self.pp:
            raise ValueError(f"rank {rank} is not one of the {self.pp} pipeline ranks")
        m, v, pp = self.microbatches, self.stages_per_rank, self.pp
        total = m * v
        if self.name == "gpipe":
            return m
        if self.name == "1f1b":
            return min(m, pp - rank)
        if self.name == "interleaved-1f1b":
            warmup = min((v - 1) * self.per_round + 2 * (pp - 1 - rank), total)
            return warmup + 1 if warmup < total else warmup
        return min((v - 1) * self.per_round + pp, total)

    # The bubble, per step, of a rank whose forward of one micro-batch takes ``F``, its backward
    # ``B`` for the input gradients and ``W`` for the weight gradients (all its stages):
    #
    # - GPipe and 1F1B: ``(pp - 1)(F + B + W)`` (Huang et al. 2019, GPipe, section 2.3;
    #   Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    #   Using Megatron-LM", section 2.2.1: bubble fraction ``(p - 1) / m`` of the ideal time),
    #   a fraction ``(pp - 1) / (M + pp - 1)`` of the step;
    # - interleaved 1F1B: that over ``v`` (Narayanan et al. 2021, section 2.2.2);
    # - zero-bubble: ``(pp - 1)(F + B - W)`` (Qi et al. 2024, "Zero Bubble Pipeline
    #   Parallelism", section 3.1, ZB-H1), at least 0, over ``v`` as interleaving divides it
    #   (torch's InterleavedZeroBubble is their ZB1P over ``v`` stages per rank); with ``F = B =
    #   W`` a third of 1F1B's.
    def bubble_s(
        self, forward_s: float, input_backward_s: float, weight_backward_s: float
    ) -> float:
        """Seconds per step a rank idles in the bubble (comment above)."""
        pp, v = self.pp, self.stages_per_rank
        if self.name == "zero-bubble":
            per = max(0.0, forward_s + input_backward_s - weight_backward_s)
        else:
            per = forward_s + input_backward_s + weight_backward_s
        return (pp - 1) * per / (v if is_looped(self.name) else 1)

    def bubble_fraction(
        self, forward_s: float, input_backward_s: float, weight_backward_s: float
    ) -> float:
        """The bubble's share of the step's compute and bubble together."""
        bubble = self.bubble_s(forward_s, input_backward_s, weight_backward_s)
        busy = self.microbatches * (forward_s + input_backward_s + weight_backward_s)
        return bubble / (busy + bubble) if busy + bubble else 0.0
