"""One finiteness check per forward and per backward, instead of one host sync per message.

Compressed collectives hand the root a :class:`Finding` each (worked out on the device); the root's
:class:`NonFiniteCheck` reads them all in one host sync at the end of a forward or a backward and
raises the same error on every rank ([Note: one finiteness check per step] at
:class:`NonFiniteCheck`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Finding", "NonFiniteCheck"]


@dataclass(frozen=True)
class Finding:
    """What one compressed collective found, still on the device."""

    #: 0-d bool: whether a message was bad
    found: torch.Tensor
    #: 1-D int64: where (read only when ``found``), as ``describe`` reads it
    detail: torch.Tensor
    #: the error, from ``detail`` read on the host
    describe: Callable[[list[int]], str]
    #: from a backward's gradient reduction: the end of backward checks it
    gradient: bool


# [Note: one finiteness check per step] A non-finite value cannot be quantized, and every rank must
# raise the same error at the same point of its program (never a silent NaN everywhere, never one
# rank raising while the others wait in the next collective). Reading a flag on the host makes the
# host wait for the device's queue, which on a GPU drains it and breaks the prefetch overlap; the
# check per message would pay that W times per all-gather and W + 1 times per reduce-scatter (115
# times per forward and backward of a 16-layer GPT at W = 2). So:
#
# - the messages carry the poison: a non-finite master weight leaves a non-finite scale in its
#   rank's all-gather message, and a rank whose gradient has one seals every reduce-scatter message
#   it sends as poisoned ([Note: non-finite gradients] in ``_codec.py``), with no host sync on the
#   sender;
# - each compressed collective, once its messages are in, works out on the device whether one was
#   bad and where (a :class:`Finding`: a 0-d flag and a few indices) and hands it to the root's
#   :class:`NonFiniteCheck`; the dequantized values carry NaN on, so nothing downstream mistakes
#   them for numbers;
# - the root reads all pending flags in ONE host sync at two points: the end of its forward, if that
#   forward gathered compressed messages (a forward without backward must still raise), and the end
#   of backward, if that backward reduced compressed gradients. A finding at neither point (the
#   backward's re-gathers when only the all-gather is compressed: the very messages the forward
#   checked) waits for the next one. So a forward and backward pays one sync per compressed
#   direction, none uncompressed.
# - Only when the flag is set does the root read the findings one by one, in the order the
#   collectives finished (the same on every rank), and raise the first one's error, naming the
#   parameter and the rank.
#
# Every rank has the same findings in the same order (each receives every rank's all-gather message,
# and the poison of a sealed reduce-scatter sender reaches every rank), so every rank raises the
# same error at the same point. Under HSDP the replica groups raise at that point too: the poisoned
# group names the parameter, the others find NaN in the reduced shard the replicas' all-reduce
# brought (a finding of its own, ``QuantizedReduceScatter.check_replicated``).
class NonFiniteCheck:
    """The root's pending :class:`Finding`\\ s, read at the end of forward and of backward in
    one host sync ([Note: one finiteness check per step])."""

    def __init__(self) -> None:
        self._pending: list[Finding] = []  # in the order the collectives finished

    def note(self, finding: Finding) -> None:
        self._pending.append(finding)

    def end_of_forward(self) -> None:
        """Raise if a message gathered since the last check was bad (one host sync, only when
        there is something to check)."""
        if self._pending:
            self._check()

    def end_of_backward(self) -> None:
        """Raise if a gradient reduced in this backward (or a message before it) was bad; one
        host sync, only when this backward reduced compressed gradients."""
        if any(finding.gradient for finding in self._pending):
            self._check()

    def _check(self) -> None:
        pending, self._pending = self._pending, []
        if not bool(torch.stack([f.found for f in pending]).any()):  # the one host sync
            return
        for finding in pending:  # an error: every read from here on is on the way to raising
            if bool(finding.found):
                raise ValueError(finding.describe(finding.detail.tolist()))
