"""What a training step costs each rank, in bytes, from the plans: raggedfsdp, and FSDP2 alike.

Memory per rank as each system allocates it (raggedfsdp: ``runtime/_dbuffer.py``,
``_param_group.py``, ``_pool.py``; FSDP2: ``fully_shard``, ``Shard(0)``), term by term in the
comment at :func:`memory_breakdown`. The step (:class:`~.step_shape.StepShape`), each unit's bytes
(:class:`~.units.UnitBytes`) and the optimizer's state (:mod:`.optimizer_state`) are re-exported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

from ..facts.systems import RAGGEDFSDP, Staging, System, as_system
from ..planner.quant_blocks import Compression
from .optimizer_state import OPTIMIZERS, SHAMPOO_DIM, optimizer_state_bytes
from .shapes import ModelShape
from .step_shape import StepShape
from .units import UnitBytes, unit_bytes

__all__ = [
    "OPTIMIZERS",
    "SHAMPOO_DIM",
    "Buffers",
    "MemoryBreakdown",
    "StepShape",
    "UnitBytes",
    "activation_bytes",
    "buffer_bytes",
    "compression_state_bytes",
    "kept_activation_bytes",
    "last_block_activation_bytes",
    "memory_breakdown",
    "offload_staging_bytes",
    "optimizer_state_bytes",
    "post_forward_bytes",
    "reduction_bytes",
    "unit_bytes",
]


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank holds. The tensor peak of a step is the larger of the two moments where
    activations peak (see :func:`memory_breakdown`) and of the optimizer step (everything
    persistent); the previous step's gradients are freed by ``zero_grad`` before forward."""

    params: int  # sharded parameters, master dtype
    grads: int  # sharded gradients, from the reduce-scatter until zero_grad
    optimizer: int
    unsharded: int  # unsharded parameters and gradients at the peak
    activations: int  # activations and backward gradients at the peak
    #: where the peak is: "loss" (its backward), "block" (the last block's backward) or "reduce"
    #: (the next block's backward, the last block's reduction in flight)
    phase: str
    unsharded_peak: int  # the runtime's own unsharded high-water mark (any time in the step)
    #: the Gloo reduce-scatter's world-size divisor, one cached 0-d tensor of the reduce dtype
    constants: int = 0
    #: compressed communication's own state: the quantized shards (one message per bucket,
    #: one buffer kept for the bucket's life) and the 8-bit error-feedback residuals (``W``
    #: messages per trainable bucket)
    compression: int = 0
    #: CPU offload: ``params``, ``grads`` and ``optimizer`` are on the host, the rest on the
    #: device (:func:`memory_breakdown`)
    offload: bool = False
    #: raggedfsdp under offload and mixed precision: the master-dtype device buffers the shards
    #: are copied into before their cast, pooled, one per shard size, until backward ends
    staging: int = 0
    #: ``reshard_after_forward=N``: the pieces the blocks keep from forward at the peak (in
    #: ``unsharded``; the runtime's ``post_forward_bytes``)
    post_forward: int = 0

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer + self.constants + self.compression

    @property
    def offloaded(self) -> int:
        """Shards and their gradients on the host: the runtime's ``stats()["offloaded_bytes"]``."""
        return self.params + self.grads if self.offload else 0

    @property
    def host(self) -> int:
        """Host bytes of the rank under offload: shards, gradients and optimizer state."""
        return self.offloaded + (self.optimizer if self.offload else 0)

    @property
    def device_persistent(self) -> int:
        """Persistent bytes on the device: all of them without offload; with it, the Gloo
        divisor and compression's residuals (the runtime's ``persistent_bytes`` less
        ``offloaded_bytes``, plus the divisor, which the runtime does not count)."""
        return self.persistent - self.host

    @property
    def peak(self) -> int:
        """The device's peak: what it holds through forward and backward (the shards and the
        optimizer state unless offloaded) with the unsharded units and activations, or the
        optimizer step's persistent bytes."""
        resident = self.device_persistent - (0 if self.offload else self.grads)
        forward = resident + self.staging + self.unsharded + self.activations
        return max(forward, self.device_persistent)

    def to_dict(self) -> dict[str, int | str | bool]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        derived = ("persistent", "offloaded", "host", "device_persistent", "peak")
        return {**out, **{name: getattr(self, name) for name in derived}}


def activation_bytes(shape: ModelShape, step: StepShape) -> tuple[int, int]:
    """Activation bytes per rank at the two candidate peaks (:mod:`.shapes` states what a block
    keeps), ``(loss, block)``:

    - **loss**: the loss's backward starts: every block's activations, the embedding sum and
      the final norm (``2 d``), the log-probabilities and the two gradients the loss's backward
      makes (``3 V``, fp32).
    - **block**: the last block's backward, inside its widest projection: the embedding sum
      (``d``), every block's activations, that projection's output gradient replacing its input
      gradient (``widest``), and a tied embedding's whole gradient (communication dtype).
    """
    act = step.param_dtype.itemsize
    blocks = shape.blocks
    if not blocks:
        return round(step.tokens * (2 * shape.hidden * act + 3 * shape.vocab * 4)), 0
    kept, recomputed = _kept_per_token(shape, step)
    widest = max(u.widest_per_token for u in shape.inner)
    loss = step.tokens * ((kept + 2 * shape.hidden) * act + 3 * shape.vocab * 4)
    block = step.tokens * (kept + recomputed + shape.hidden + widest) * act
    return round(loss), round(block + shape.tied_numel * act)


def _kept_per_token(shape: ModelShape, step: StepShape) -> tuple[float, float]:
    """``(kept, recomputed)`` activation elements per token: what the blocks keep for their
    backward, and what one block's recomputation adds under checkpointing (each block then keeps
    its input)."""
    blocks = shape.blocks
    if step.checkpointing:
        recomputed = max((shape.block_activation_per_token(b) for b in blocks), default=0.0)
        return float(shape.hidden * len(blocks)), recomputed
    return float(sum(u.activation_per_token for u in shape.inner)), 0.0


def kept_activation_bytes(shape: ModelShape, step: StepShape) -> int:
    """What the blocks keep for their backward over ``step``'s tokens: the part of
    :func:`activation_bytes` each micro-batch in flight adds under pipeline parallelism."""
    return round(step.tokens * _kept_per_token(shape, step)[0] * step.param_dtype.itemsize)


# Memory per rank, term by term (raggedfsdp, then FSDP2):
#
# - **persistent**: every bucket's local shard ``[S]`` (master dtype), its gradient ``[S]`` from the
#   reduce-scatter until ``zero_grad``, and the optimizer's state on the parameters' local pieces
#   (:func:`optimizer_state_bytes`);
# - **unsharded** (communication dtype, one storage per unit, each bucket on 256 bytes): the root's
#   parameters and gradient block for the whole step; the unit that ran forward last stays unsharded
#   into backward; with prefetch depth 1 the next unit's all-gather lands while one computes. The
#   *tensor peak* is the larger of two moments (:func:`activation_bytes`): the loss's backward
#   (every activation, the loss's gradients; the root's and the last block's parameters) and the
#   last block's backward (its gradient blocks too, the next block prefetched). The runtime's own
#   unsharded high-water mark (``peak_unsharded_bytes``) comes later: block ``i``'s parameters and
#   gradient block, block ``i-1`` prefetched, block ``i+1``'s gradient block and, on Gloo, its
#   receive buffer (``(W-1) S``) while its reduce-scatter is in flight.
# - **activations**: what the blocks keep (:mod:`.shapes`) and what the backward adds at the peak.
# - **compression** (:class:`MemoryBreakdown` ``compression``, under compressed communication): the
#   quantized master shard of each bucket (one message, :mod:`.wire`) and, with error feedback, each
#   trainable bucket's 8-bit residual (``W`` messages).
# - **optimizer state**: :mod:`.optimizer_state` (re-exported here).
#
# - **CPU offload** (``StepShape.offload``, ``runtime/_offload.py``): shards, gradients and
#   optimizer state move to the host (:attr:`MemoryBreakdown.host`); the device keeps the rest, plus
#   the pooled staging of a cast (:func:`offload_staging_bytes`).
#
# FSDP2 (``fully_shard``, ``Shard(0)``): each parameter's shard padded to ``ceil(dim0 / W)`` rows;
# the all-gather output (``W x`` the padded shards) is copied out into per-parameter unsharded
# tensors, and the unsharded gradients (per parameter, allocated by autograd) are copied into a
# padded reduce-scatter input. At the peak it holds the root's and the last block's unsharded
# parameters and gradients, the prefetched block's all-gather output, and the same activations.
def memory_breakdown(
    shape: ModelShape,
    units: Sequence[UnitBytes],
    step: StepShape,
    optimizer_bytes: int,
    *,
    world_size: int,
    system: System | str = RAGGEDFSDP,
) -> MemoryBreakdown:
    """One rank's memory for ``system`` (a :class:`~raggedfsdp.facts.System` or its name) from its
    units (:func:`unit_bytes`, the root last) and optimizer state
    (:func:`optimizer_state_bytes`).

    Unsharded at the loss's backward: the root's and the last block's parameters (the root
    prefetches nothing: the last block was never resharded). At the last block's backward: both
    with their gradients, and the next block's all-gathered parameters (prefetch depth 1). At
    the next block's backward: the root's, that block's and its prefetched neighbour's, and the
    last block's reduction in flight (:func:`_peak_moments`).

    With ``step.offload`` the shards, gradients and optimizer state are host bytes
    (:attr:`MemoryBreakdown.host`) and the device keeps the rest: raggedfsdp's shard slot is
    part of the unsharded buffer (the host shard is copied into it), so offload adds only the
    pooled staging of a cast (:func:`offload_staging_bytes`); FSDP2's host-to-device copies of
    the prefetched unit's padded shards live until its copy-in, at the last block's backward
    (:class:`~raggedfsdp.facts.HostCopies`)."""
    system = as_system(system)
    w, comm, master = world_size, step.param_dtype.itemsize, step.master_dtype.itemsize
    local, local_grads, params, grads, gathered = buffer_bytes(units, comm, w, system)
    kept = post_forward_bytes(units, step, w, system)
    moments = _peak_moments(shape, units, step, w, system, params, grads, gathered)
    n = len(units) - 1
    # the pieces kept from forward at each moment: every regathered block's at the loss, less
    # those refilled by then (the block in backward and the one prefetched)
    held = {"loss": sum(kept[:n]), "block": sum(kept[: max(0, n - 2)])}
    held["reduce"] = sum(kept[: max(0, n - 3)])
    moments = {k: (u + held[k], a) for k, (u, a) in moments.items()}
    phase = max(moments, key=lambda name: sum(moments[name]))
    unsharded, activations = moments[phase]
    staged = system.host_copies.staging is Staging.POOLED_CAST
    staging = offload_staging_bytes(units, step) if staged else 0
    return MemoryBreakdown(
        params=local * master,
        grads=local_grads * master,
        optimizer=optimizer_bytes,
        unsharded=unsharded,
        activations=activations,
        phase=phase,
        unsharded_peak=staging + _unsharded_high_water(params, grads, units, step, w, system, kept),
        post_forward=held[phase],
        constants=(
            step.reduce_output_itemsize(system) if system.reduces_point_to_point(step.gloo) else 0
        ),
        compression=compression_state_bytes(units, system.compression(step.compression), w),
        offload=step.offload,
        staging=staging,
    )


def _peak_moments(
    shape: ModelShape,
    units: Sequence[UnitBytes],
    step: StepShape,
    w: int,
    system: System,
    params: Sequence[int],
    grads: Sequence[int],
    gathered: Sequence[int],
) -> dict[str, tuple[int, int]]:
    """``(unsharded, activation)`` bytes at each moment where the tensor peak may lie
    (:func:`memory_breakdown`): ``"loss"``, ``"block"`` and, with two blocks or more,
    ``"reduce"``: the second-to-last block's backward while the last block's reduction is in
    flight (its gradients, and their cast to an fp32 ``reduce_dtype``, a whole unit's worth:
    3.4 GB for a Llama-70B layer), its activations freed."""
    n = len(units) - 1  # blocks before the root
    loss_act, block_act = activation_bytes(shape, step)
    last = params[n - 1] if n else 0
    moments = {
        "loss": (params[-1] + last, loss_act),
        "block": (
            params[-1]
            + grads[-1]
            + last
            + (grads[n - 1] if n else 0)
            + (gathered[n - 2] if n >= 2 else 0)
            + (_copies_until_copy_in(units[n - 2], step, system) if n >= 2 else 0),
            block_act,
        ),
    }
    if n >= 2 and shape.blocks:
        in_flight = reduction_bytes(units[n - 1], step, w, system)
        if system.zero_copy:  # the gradient block is read in place until the reduction ends
            in_flight += grads[n - 1]
        else:  # FSDP2 copies the gradients into its reduce-scatter input and frees them
            unit = units[n - 1]
            in_flight += unit.group(w) * unit.shard(system) * step.reduce_input_itemsize(system)
        moments["reduce"] = (
            params[-1]
            + grads[-1]
            + params[n - 2]
            + grads[n - 2]
            + (gathered[n - 3] if n >= 3 else 0)
            + (_copies_until_copy_in(units[n - 3], step, system) if n >= 3 else 0)
            + in_flight,
            block_act - last_block_activation_bytes(shape, step),
        )
    return moments


def last_block_activation_bytes(shape: ModelShape, step: StepShape) -> int:
    """What the last block keeps for its backward (:func:`activation_bytes`), freed once its
    backward is done."""
    act = step.param_dtype.itemsize
    if step.checkpointing:
        return round(step.tokens * shape.hidden * act)
    return round(step.tokens * shape.block_activation_per_token(shape.blocks[-1]) * act)


class Buffers(NamedTuple):
    """What ``system`` holds of some units on one rank (:func:`buffer_bytes`)."""

    local: int  # sharded elements
    local_grads: int  # their gradients' elements
    params: list[int]  # per unit, bytes of its unsharded parameters
    grads: list[int]  # ... of its unsharded gradients
    gathered: list[int]  # ... of its all-gather's output


def buffer_bytes(units: Sequence[UnitBytes], comm: int, w: int, system: System) -> Buffers:
    """``system``'s sharded elements and their gradients' per rank, and per unit the bytes of
    its unsharded parameters, of its unsharded gradients and of its all-gather output, each
    ``comm`` bytes an element, over groups of ``w``; a unit's subclass parameters
    (:attr:`UnitBytes.subclass_bytes`) add their gathered bytes to its parameters and
    all-gather output, never to its gradients."""
    local = sum(u.shard(system) for u in units)
    local_grads = sum(u.trainable_shard(system) for u in units)
    if system.zero_copy:  # parameters, gradients and the all-gather: views of one storage
        params = [u.storage_bytes(w, comm) + u.subclass_bytes for u in units]
        grads = [u.storage_bytes(w, comm, trainable=True) for u in units]
        return Buffers(local, local_grads, params, grads, params)
    # copied-out parameters and autograd's gradients are per parameter, unpadded; what an
    # all-gather in flight holds is its padded output
    return Buffers(
        local,
        local_grads,
        [u.param_numel * comm + u.subclass_bytes for u in units],
        [u.param_numel * comm if u.trainable_shard_numel else 0 for u in units],
        [u.group(w) * u.shard(system) * comm + u.subclass_bytes for u in units],
    )


def offload_staging_bytes(units: Sequence[UnitBytes], step: StepShape) -> int:
    """raggedfsdp under offload with a cast (``param_dtype`` other than the master dtype): each
    shard is copied to the device as it is, into a pooled buffer, and cast into its slot there
    (``runtime/_offload.py``: ``to_device``). The pool keeps one such buffer per shard size
    until the end of backward: the sum over the distinct ``S`` of ``S`` master elements."""
    if not step.offload or step.param_dtype == step.master_dtype:
        return 0
    sizes = {s for unit in units for s in unit.shards}
    return sum(sizes) * step.master_dtype.itemsize


def _copies_until_copy_in(unit: UnitBytes, step: StepShape, system: System) -> int:
    """Under offload, a system whose copies stage the prefetched unit's shards
    (:attr:`Staging.PREFETCHED_SHARDS`: FSDP2) holds one unit's shards copied to the device for
    its all-gather (master dtype, and their cast under mixed precision) until its copy-in."""
    if not step.offload or system.host_copies.staging is not Staging.PREFETCHED_SHARDS:
        return 0
    cast = step.param_dtype.itemsize if step.param_dtype != step.master_dtype else 0
    return unit.shard(system) * (step.master_dtype.itemsize + cast)


def compression_state_bytes(
    units: Sequence[UnitBytes], compression: Compression | None, world_size: int
) -> int:
    """Bytes compressed communication keeps on a rank (:attr:`MemoryBreakdown.compression`)."""
    if compression is None:
        return 0
    total = 0
    for unit in units:
        if compression.all_gather is not None:
            total += sum(unit.messages)
        if compression.error_feedback:  # W per trainable bucket: int8 messages, or fp32 / bf16 [S]
            itemsize = {"fp32": 4, "bf16": 2}.get(getattr(compression, "residual_storage", "int8"))
            share = unit.trainable_shard_numel * itemsize if itemsize else unit.trainable_messages
            total += unit.group(world_size) * share
    return total


def _unsharded_high_water(
    params: Sequence[int],
    grads: Sequence[int],
    units: Sequence[UnitBytes],
    step: StepShape,
    world_size: int,
    system: System,
    kept: Sequence[int],
) -> int:
    """The most unsharded bytes held at once: block ``i``'s backward with its parameters and
    gradients, block ``i-1`` prefetched, block ``i+1``'s reduction in flight (its gradients,
    their cast to the reduce dtype, and the Gloo receive buffer) until it completes, the pieces
    the blocks before ``i-1`` keep from forward (``kept``); the root's for the whole step."""
    n = len(units) - 1
    root = params[-1] + grads[-1]
    best = root
    for i in range(n):
        held = params[i] + grads[i] + (params[i - 1] if i else 0) + sum(kept[: max(0, i - 1)])
        if i + 1 < n:
            held += grads[i + 1] + reduction_bytes(units[i + 1], step, world_size, system)
        if not system.zero_copy:  # the reduce-scatter input it copies block i's gradients into
            unit = units[i]
            held += unit.group(world_size) * unit.shard(system) * step.reduce_input_itemsize(system)
        best = max(best, root + held)
    return best


def post_forward_bytes(
    units: Sequence[UnitBytes], step: StepShape, world_size: int, system: System
) -> list[int]:
    """Per unit, the bytes it keeps from forward to its backward under
    ``reshard_after_forward=N`` below its group: its piece of the gathered buffer
    (:meth:`UnitBytes.within`; ``stats()["post_forward_bytes"]`` for ``N > 1``), the whole
    buffer for ``N = 1`` (never resharded); 0 for ``N`` equal to its group (resharded in full)
    and for the root and the block kept unsharded into backward (never resharded)."""
    n = step.reshard_after_forward
    kept = [0] * len(units)
    if n is None:
        return kept
    again = set(system.regathered(len(units) - 1))
    for i, unit in enumerate(units):
        if i in again and n < unit.group(world_size):
            kept[i] = unit.within(n, world_size).shard(system) * step.param_dtype.itemsize
    return kept


def reduction_bytes(unit: UnitBytes, step: StepShape, world_size: int, system: System) -> int:
    """What ``unit``'s gradient reduction holds beside its unsharded gradients while in flight
    (raggedfsdp): their cast to the reduce dtype (``W S`` per trainable bucket, a pooled block)
    and, on Gloo, the point-to-point receive buffer (``(W - 1) S`` of what it reduces)."""
    itemsize = step.reduce_input_itemsize(system)
    w = unit.group(world_size)
    held = 0
    if system.zero_copy and step.casts_for_reduce(system):
        held += w * unit.trainable_shard_numel * itemsize
    if system.reduces_point_to_point(step.gloo):
        held += (w - 1) * unit.shard(system) * itemsize
    return held
