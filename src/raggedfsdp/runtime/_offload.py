"""CPU offload (FSDP2's ``CPUOffloadPolicy``): shards, gradients and optimizer state on the host.

With a :class:`HostOffload` a bucket's ``local`` shard lives on the host (pinned when asked and an
accelerator is present), so the sharded parameters, their gradients and the optimizer's state are
host tensors and the optimizer steps there; the compute device holds only unsharded buffers. The
copies around the collectives, and why they are safe ([Note: non-blocking offload copies]): the
comments at :class:`HostOffload`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from ._metrics import RuntimeStats
from ._pool import BufferPool

__all__ = ["HostOffload", "check_host_backend", "offload_for"]

_HOST = torch.device("cpu")


def offload_for(
    policy: OffloadPolicy | None, device: torch.device, *, host_copies_on_cpu: bool = False
) -> HostOffload | None:
    """The offload a unit on ``device`` runs with: ``None`` without a ``CPUOffloadPolicy`` and on
    a CPU device, where the policy is met as is (everything is on the host already) unless
    ``host_copies_on_cpu`` (``DBufferConfig.host_copies_on_cpu``) asks for the copy path."""
    if not isinstance(policy, CPUOffloadPolicy):
        return None
    if device.type == "cpu" and not host_copies_on_cpu:
        return None
    # Pinning needs an accelerator runtime (it fails without one, docs/design.md).
    pin = policy.pin_memory and device.type != "cpu" and torch.accelerator.is_available()
    return HostOffload(device, pin_memory=pin)


def check_host_backend(groups: list[dist.ProcessGroup]) -> None:
    """Under offload, host tensors meet collectives outside the runtime's own: the partial norms
    of ``clip_grad_norm_``, Muon's and Shampoo's exchanges of whole matrices, the gathers of a
    full state dict. A group with no CPU backend (NCCL alone) would fail there, in the middle of
    a step; so, as with FSDP2's offload, the groups must have one, e.g.
    ``init_process_group("cpu:gloo,cuda:nccl")`` (torch's default, ``backend=None``, makes both).
    Groups that do not list their device types are trusted."""
    for group in groups:
        types = getattr(group, "_device_types", None)
        if types is not None and torch.device("cpu") not in types:
            names = ", ".join(sorted(t.type for t in types))
            raise ValueError(
                f"offload_policy=CPUOffloadPolicy() needs a process group that can reduce host "
                f"tensors (gradient norms, optimizer exchanges, full state dicts), but "
                f"{group.group_name!r} has backends for {names} only; initialise it with "
                f'backend="cpu:gloo,{types[0].type}:nccl" (or backend=None, which makes both)'
            )


# The copies around the collectives, which run on the compute device:
#
# - unshard: the host shard is copied into this rank's slot of the device ``full`` buffer (cast to
#   ``param_dtype`` on the device, after the copy), then the all-gather runs in place as without
#   offload; a parameter this rank holds whole is a view of ``full`` too, never of host memory;
# - reduce: the reduced gradient shard (cast to the master dtype on the device) is copied into a
#   fresh host buffer, and the sharded gradients are views of it.
#
# The path is written against a compute device and the host only, so it runs on a CPU device too:
# ``DBufferConfig(host_copies_on_cpu=True)`` makes a CPU unit take it, with separate host buffers
# and the same copies, which is how it is tested without an accelerator.
#
# [Note: non-blocking offload copies] From and to *pinned* host memory, copies are issued with
# ``non_blocking=True``: stream order already makes the device side safe (the copy to the device
# runs on the all-gather copy-in stream, which the all-gather and then compute wait for; the copy to
# the host on the reduce-scatter or all-reduce stream, which compute waits for at the end of
# backward: [Note: streams and events] in ``_streams.py``). What it does not cover is the host: it
# must not read a gradient the device is still writing, nor write a shard (optimizer step, load) the
# device is still reading. So every such copy records an event, and :meth:`HostOffload.wait` blocks
# on them before the host touches those buffers: at reshard and at the end of the iteration (before
# any optimizer step), and before adding a new gradient to one still held. Pageable memory gets
# blocking copies (a non-blocking copy to pageable memory is not asynchronous anyway, and from it
# would be unsafe).
class HostOffload:
    """The host side of one unit under CPU offload, and the copies to and from its device."""

    def __init__(self, device: torch.device, *, pin_memory: bool) -> None:
        self.device = device  # the compute device (all-gather, compute, reduce-scatter)
        self.pin_memory = pin_memory
        #: events recorded after non-blocking copies, until :meth:`wait` (see the Note)
        self._events: list[torch.Event] = []

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer, uninitialised (pinned when asked)."""
        return torch.empty(numel, dtype=dtype, device=_HOST, pin_memory=self.pin_memory)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer of zeros (the ``local`` shard: padding stays deterministic)."""
        return self.empty(numel, dtype).zero_()

    def to_device(
        self, slot: torch.Tensor, local: torch.Tensor, pool: BufferPool, stats: RuntimeStats
    ) -> None:
        """Copy the host shard ``local`` into ``slot`` (this rank's slot of the device ``full``),
        cast to ``slot``'s dtype on the device."""
        if slot.dtype == local.dtype:
            self._copy(slot, local)
            stats.add_copy(slot)
            return
        # Mixed precision: move the master values as they are, then cast on the device (as
        # FSDP2 does), so the parameters equal the cast without offload bit for bit.
        staging = pool.take(local.numel(), local.dtype, self.device)
        self._copy(staging, local)
        slot.copy_(staging)
        stats.add_copy(staging)
        stats.add_copy(slot)
        pool.give(staging)  # its next taker waits for the cast (the pool's event)

    def to_host(
        self, reduced: torch.Tensor, dtype: torch.dtype, stats: RuntimeStats
    ) -> torch.Tensor:
        """The reduced gradient shard ``reduced`` (on the device) in a fresh host buffer of the
        master ``dtype``, cast on the device first."""
        if reduced.dtype != dtype:
            reduced = reduced.to(dtype)
            stats.add_copy(reduced)
        host = self.empty(reduced.numel(), dtype)
        self._copy(host, reduced)
        stats.add_copy(host)
        return host

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.pin_memory)
        if self.pin_memory:
            event = torch.Event(device=self.device)
            event.record()
            self._events.append(event)

    def wait(self) -> None:
        """Block until the copies issued so far are done, so the host may read the gradients and
        write the shards (see the Note)."""
        for event in self._events:
            event.synchronize()
        self._events.clear()
