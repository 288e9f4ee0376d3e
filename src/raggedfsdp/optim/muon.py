"""Muon on ragged shards: the numbers of ``torch.optim.Muon``, each matrix orthogonalised whole.

Newton–Schulz is not elementwise (applied to a row shard it changes the update by 29–120%,
docs/references.md), so each matrix is gathered to one owner rank, orthogonalised there with torch's
own kernel and scattered back; everything else runs on the local pieces. The step, and what tensor
and expert parallelism change: the comment at :class:`Muon`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from ..tensor import comm_group, global_shape, local_range, shard_info
from ._common import ShardedOptimizer, local
from ._muon_args import AdamWRule, check_muon_args, route
from ._tensor_split import TensorSplit, check_peers_agree, tensor_split

__all__ = ["Muon", "newton_schulz_cost", "plan_owners"]


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Multiply-adds of Newton–Schulz on a ``rows × cols`` matrix, up to a constant:
    ``min(m, n)² · max(m, n)`` (every product is with the smaller Gram matrix)."""
    return min(rows, cols) ** 2 * max(rows, cols)


def plan_owners(
    costs: Sequence[int],
    world_size: int,
    holders: Sequence[int | None] | None = None,
    held: Sequence[Sequence[int]] | None = None,
    slack: float = 0.05,
) -> list[int]:
    """Owner rank of each matrix, balancing the summed cost per rank.

    A matrix with ``holders[i]`` set lies whole on that rank and is owned there (no traffic); the
    others go greedily, largest cost first, to the least-loaded rank (ties: the earlier matrix, the
    lower rank). With ``held[i][r]`` (elements of matrix ``i`` rank ``r`` already holds), any rank
    whose load is within ``slack`` of the mean load of the least-loaded one may take it instead,
    and the one holding most of the matrix does: its piece need not travel, which cuts the
    gather/scatter traffic while keeping the balance within ``slack``. Pure and deterministic, so
    every rank computes the same plan.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    holders = list(holders) if holders is not None else [None] * len(costs)
    if len(holders) != len(costs):
        raise ValueError(f"got {len(costs)} costs but {len(holders)} holders")
    load = [0] * world_size
    owners: list[int] = [-1] * len(costs)
    for i, holder in enumerate(holders):
        if holder is not None:
            owners[i] = holder
            load[holder] += costs[i]
    free = sorted((i for i, h in enumerate(holders) if h is None), key=lambda i: -costs[i])
    tolerance = slack * sum(costs) / world_size
    for i in free:
        rank = min(range(world_size), key=lambda r: load[r])
        if held is not None:
            near = [r for r in range(world_size) if load[r] <= load[rank] + tolerance]
            rank = max(near, key=lambda r: (held[i][r], -load[r], -r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def _newton_schulz(
    x: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Orthogonalise ``x`` (2-D, consumed in place) in its own dtype.

    bf16 is torch's kernel itself; other dtypes run the same statements without its bf16 cast (a
    test checks that this path with bf16 input equals torch's bit for bit).
    """
    if x.dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(x, ns_coefficients, ns_steps, eps)
    a, b, c = ns_coefficients
    tall = x.size(0) > x.size(1)
    ortho = x.T if tall else x
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


@dataclass(frozen=True)
class _Matrix:
    """One matrix to orthogonalise within a bucket of parameters."""

    item: int  # index of its parameter in the bucket
    offset: int  # first element of the matrix in the parameter's flattening
    rows: int
    cols: int
    owner: int
    pieces: tuple[tuple[int, int], ...]  # per rank: its [lo, hi) within the matrix's flattening


@dataclass(frozen=True)
class _Exchange:
    """One rank's view of a bucket's plan: what it sends, receives and orthogonalises.

    The scatter is the gather reversed: the gather's receive layout is the scatter's send layout
    and vice versa, so one list of segments describes both.
    """

    matrices: tuple[_Matrix, ...]
    # Matrix index per segment of this rank's gather send buffer (= its scatter receive buffer):
    # this rank's piece of a matrix owned elsewhere, ordered by owner, then by matrix.
    outgoing: tuple[int, ...]
    outgoing_splits: tuple[int, ...]  # elements per peer rank
    # (matrix index, source rank) per segment of the gather receive (= scatter send) buffer.
    incoming: tuple[tuple[int, int], ...]
    incoming_splits: tuple[int, ...]
    owned: tuple[int, ...]  # matrices this rank orthogonalises
    split_anywhere: bool  # whether any matrix of the bucket is split over ranks


def _plan_bucket(shapes: list[torch.Size], ranges: list[tuple], world: int, me: int) -> _Exchange:
    """Rank ``me``'s exchange plan for parameters of global ``shapes`` laid out by ``ranges``
    (per parameter, one flat ``(start, end)`` per rank); identical owners on every rank."""
    matrices_in: list[tuple[int, int, int, int, tuple[tuple[int, int], ...]]] = []
    for item, (shape, rank_ranges) in enumerate(zip(shapes, ranges, strict=True)):
        rows, cols = shape[-2], shape[-1]
        size = rows * cols
        for k in range(math.prod(shape[:-2]) if size else 0):
            start, end = k * size, (k + 1) * size
            pieces = tuple(
                (max(s, start) - start, min(e, end) - start)
                if min(e, end) > max(s, start)
                else (0, 0)
                for s, e in rank_ranges
            )
            matrices_in.append((item, start, rows, cols, pieces))
    holders = []
    for *_, pieces in matrices_in:
        held = [r for r, (lo, hi) in enumerate(pieces) if hi > lo]
        holders.append(held[0] if len(held) == 1 else None)
    owners = plan_owners(
        [newton_schulz_cost(m[2], m[3]) for m in matrices_in],
        world,
        holders,
        held=[[hi - lo for lo, hi in m[4]] for m in matrices_in],
    )
    matrices = tuple(
        _Matrix(item, offset, rows, cols, owner, pieces)
        for (item, offset, rows, cols, pieces), owner in zip(matrices_in, owners, strict=True)
    )

    def size(j: int, rank: int) -> int:
        lo, hi = matrices[j].pieces[rank]
        return hi - lo

    outgoing, outgoing_splits, incoming, incoming_splits = [], [], [], []
    for peer in range(world):
        mine_to_peer = [j for j, m in enumerate(matrices) if m.owner == peer != me and size(j, me)]
        outgoing += mine_to_peer
        outgoing_splits.append(sum(size(j, me) for j in mine_to_peer))
        peer_to_me = [j for j, m in enumerate(matrices) if m.owner == me != peer and size(j, peer)]
        incoming += [(j, peer) for j in peer_to_me]
        incoming_splits.append(sum(size(j, peer) for j in peer_to_me))
    return _Exchange(
        matrices=matrices,
        outgoing=tuple(outgoing),
        outgoing_splits=tuple(outgoing_splits),
        incoming=tuple(incoming),
        incoming_splits=tuple(incoming_splits),
        owned=tuple(j for j, m in enumerate(matrices) if m.owner == me),
        split_anywhere=any(h is None for h in holders),
    )


@dataclass
class _Pending:
    """A Muon parameter between momentum and the update (for one step)."""

    param: torch.Tensor  # as the optimizer holds it (sharded, or plain)
    piece: torch.Tensor  # this rank's piece of it, updated in place
    group: dict[str, Any]
    update: torch.Tensor  # 1-D local Newton–Schulz input (momentum, Nesterov-mixed)
    start: int  # the local piece's first element in the parameter's flattening
    split: TensorSplit | None  # how tensor parallelism splits its matrix, if it does


# Newton–Schulz is not elementwise: applied to a row shard instead of the whole matrix it changes
# the update by 29–120% (docs/references.md). So each step, per process group:
#
# 1. momentum and Nesterov mixing run on the local pieces, elementwise, exactly as torch does;
# 2. every matrix (a 2-D parameter, or one matrix of a 3-D expert stack) has an *owner* rank, chosen
#    once and identically on every rank to balance Newton–Schulz cost; one uneven
#    ``all_to_all_single`` gathers each matrix's pieces, already cast to the Newton–Schulz dtype, to
#    its owner;
# 3. the owner orthogonalises the whole matrix with torch's own kernel
#    (``torch.optim._muon._zeropower_via_newtonschulz``), so the result is bitwise torch's;
# 4. a second ``all_to_all_single`` (the first one reversed) scatters the results back, and each
#    rank applies weight decay and the update to its pieces, elementwise.
#
# Beside tensor parallelism, the matrix of step 2 is this rank's tensor-parallel slice; the owner
# gathers the slices over the tensor-parallel group before step 3 and keeps its own slice of the
# result (``_tensor_split.py``). Expert parallelism splits a stack between its matrices: nothing to
# gather.
#
# A matrix held whole by one rank is owned by that rank and never moves; when no matrix of a group
# is split, the exchange is skipped. Both collectives are asynchronous: the owner orthogonalises its
# local matrices while the gather is in flight and applies its own results while the scatter is.
# Muon traffic per rank on a balanced set of split matrices is about ``2(W-1)/W² · P`` elements.
#
# Parameters Muon should not touch (biases, norms, embeddings, the output head) go to an auxiliary
# AdamW inside the same optimizer: param groups with ``use_muon=False``.
class Muon(ShardedOptimizer):
    """Muon (momentum orthogonalised by Newton–Schulz) for sharded and unsharded matrices.

    Matches ``torch.optim.Muon`` bit for bit with the default ``ns_dtype=torch.bfloat16`` for any
    world size and layout, and equals itself on one device for other ``ns_dtype``. The update's
    shape scale (``adjust_lr_fn``) uses the global matrix shape; a 3-D parameter is a stack of
    matrices ``[E, rows, cols]``, each orthogonalised and scaled as a matrix of its own.

    Args:
        params: matrices (2-D) and matrix stacks (3-D), or param groups; a group with
            ``use_muon=False`` is updated by the auxiliary AdamW.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            ``torch.optim.Muon`` (decoupled weight decay; ``eps`` guards the Newton–Schulz
            normalisation).
        ns_dtype: dtype of Newton–Schulz and of the matrices on the wire (bf16, as torch; fp32
            doubles the traffic).
        adamw_params: parameters for the auxiliary AdamW, either an explicit iterable (one extra
            param group) or a rule ``fn(param, global_shape) -> bool`` that picks them out of
            ``params`` (the shape is the global one: a local piece may be 1-D). Without it, a
            parameter that is not 2-D or 3-D is a ``ValueError``.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: hyper-parameters of the auxiliary
            AdamW groups (filled into every ``use_muon=False`` group that does not set them).
        skip_nonfinite: skip a step with a NaN/Inf gradient on every rank (else raise).

    After each step, :attr:`comm_stats` holds this rank's Muon traffic (``bytes_sent``,
    ``bytes_received``, ``exchanges``): only the gather and scatter of split matrices.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_params: Iterable[Any] | AdamWRule | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        skip_nonfinite: bool = True,
    ) -> None:
        check_muon_args(momentum, ns_coefficients, ns_steps, adjust_lr_fn, ns_dtype, adamw_betas)
        self.ns_dtype = ns_dtype
        # Filled into use_muon=False groups by add_param_group (so "eps" there is AdamW's, not
        # Newton–Schulz's).
        self._adamw_defaults = {
            "lr": adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        #: This rank's Muon traffic in the last step.
        self.comm_stats: dict[str, int] = {"bytes_sent": 0, "bytes_received": 0, "exchanges": 0}
        # Plans per bucket of parameters, keyed by the parameters' ids: layouts never change.
        self._plans: dict[tuple[int, ...], _Exchange] = {}
        # Parameters that tensor parallelism splits (checked as their groups are added).
        self._splits: dict[torch.Tensor, TensorSplit | None] = {}
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
        }
        super().__init__(route(params, adamw_params), defaults, skip_nonfinite=skip_nonfinite)

    @property
    def comm_bytes_last_step(self) -> int:
        """Bytes this rank sent for Muon's gather and scatter in the last step."""
        return self.comm_stats["bytes_sent"]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer``; a ``use_muon=False`` group gets the
        auxiliary AdamW's hyper-parameters for the keys it does not set."""
        if not param_group.get("use_muon", True):
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)

    def _check_split(self, param: DTensor, label: str, group: dict[str, Any]) -> None:
        """Accept a parameter split by tensor or expert parallelism: the auxiliary AdamW is
        elementwise, and Muon gathers what tensor parallelism splits (or refuses it)."""
        if group["use_muon"]:
            self._splits[param] = tensor_split(param, label)

    def _check_group(self, group: dict[str, Any], group_index: int) -> None:
        """The base checks, and every parameter of a Muon group a matrix or matrix stack."""
        super()._check_group(group, group_index)
        if not group["use_muon"]:
            return
        for index, p in enumerate(group["params"]):
            if len(global_shape(p)) not in (2, 3):
                raise ValueError(
                    f"Muon updates matrices (2-D) and matrix stacks (3-D), but "
                    f"{self.param_label(group, index, group_index)} is neither: give it to the "
                    f"auxiliary AdamW with adamw_params=... or a param group with use_muon=False"
                )

    def _update(self) -> None:
        """One step: AdamW groups directly; Muon's momentum locally, then per process group
        (bucket) the orthogonalisation and the update."""
        buckets: dict[int, tuple[dist.ProcessGroup | None, list[_Pending]]] = {}
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["use_muon"]:
                self._adamw_update(group, params)
                continue
            momentum = group["momentum"]
            for p in params:
                piece, grad, state = self._pieces(p, self._momentum_state)
                buf = state["momentum_buffer"]
                # torch.optim.Muon's two lines, elementwise, so shards give torch's numbers.
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                pg = comm_group(p)
                start, split = local_range(p)[0], self._splits.get(p)
                pending = _Pending(p, piece, group, update.reshape(-1), start, split)
                buckets.setdefault(id(pg), (pg, []))[1].append(pending)
        self.comm_stats = {"bytes_sent": 0, "bytes_received": 0, "exchanges": 0}
        for pg, pending in buckets.values():
            self._orthogonalize_and_apply(pg, pending)

    def _momentum_state(self, p: torch.Tensor) -> dict[str, Any]:
        """torch.optim.Muon's state of a new parameter."""
        zeros = torch.zeros_like(local(p.grad), memory_format=torch.preserve_format)
        return {"momentum_buffer": self._placed(p, "momentum_buffer", zeros)}

    def _exchange_plan(self, pg: dist.ProcessGroup | None, pending: list[_Pending]) -> _Exchange:
        """This rank's plan for the bucket ``pending`` of group ``pg``, made once and cached."""
        key = tuple(id(item.param) for item in pending)
        plan = self._plans.get(key)
        if plan is None:
            if pg is None:
                world, me = 1, 0
                ranges = [((0, math.prod(_slice_shape(i.param))),) for i in pending]
            else:
                world, me = dist.get_world_size(pg), dist.get_rank(pg)
                ranges = [shard_info(i.param).layout.ranges for i in pending]  # type: ignore[union-attr]
            shapes = [_slice_shape(i.param) for i in pending]
            split = [
                (self._label_of(i.param), i.split, (shapes[k], ranges[k]))
                for k, i in enumerate(pending)
                if i.split is not None
            ]
            if split:
                check_peers_agree(pg, split)  # type: ignore[arg-type]
            plan = self._plans[key] = _plan_bucket(shapes, ranges, world, me)
        return plan

    def _orthogonalize_and_apply(
        self, pg: dist.ProcessGroup | None, pending: list[_Pending]
    ) -> None:
        """Orthogonalise and apply the updates of one bucket (the Muon parameters of one process
        group): gather, compute, scatter-and-apply. World size 1 is the same path with nothing to
        exchange."""
        plan = self._exchange_plan(pg, pending)
        me = 0 if pg is None else dist.get_rank(pg)
        bucket = _Bucket(pg, plan, pending, me, self.ns_dtype)
        send, recv, gathering = _gather(bucket)
        if gathering is not None:
            self._count(plan)
        outputs = _compute(bucket, recv, gathering)
        _scatter_and_apply(bucket, send, recv, outputs)

    def _count(self, plan: _Exchange) -> None:
        """Add one step's gather and scatter of ``plan`` to :attr:`comm_stats`."""
        itemsize = torch.empty((), dtype=self.ns_dtype).element_size()
        out, inc = sum(plan.outgoing_splits), sum(plan.incoming_splits)
        # Gather sends the outgoing segments, scatter sends the incoming ones back.
        self.comm_stats["bytes_sent"] += (out + inc) * itemsize
        self.comm_stats["bytes_received"] += (out + inc) * itemsize
        self.comm_stats["exchanges"] += 2


@dataclass(frozen=True)
class _Bucket:
    """One step of one bucket on this rank: its plan, its pending parameters and where their
    pieces lie in the exchange buffers (both all_to_alls use the same two buffers)."""

    pg: dist.ProcessGroup | None
    plan: _Exchange
    pending: list[_Pending]
    me: int  # this rank in ``pg`` (0 without one)
    wire: torch.dtype  # the Newton–Schulz dtype, also that of the buffers

    def local_slice(self, j: int) -> slice:
        """Where this rank's piece of matrix ``j`` lies in its parameter's local update."""
        m = self.plan.matrices[j]
        lo, hi = m.pieces[self.me]
        base = m.offset - self.pending[m.item].start
        return slice(base + lo, base + hi)

    def own_piece(self, j: int) -> slice:
        """Where this rank's piece of matrix ``j`` lies within the matrix's flattening."""
        lo, hi = self.plan.matrices[j].pieces[self.me]
        return slice(lo, hi)

    def outgoing_segments(self) -> Iterator[tuple[int, slice, slice]]:
        """``(matrix, buffer slice, local slice)`` per segment of the gather send (= scatter
        receive) buffer: this rank's pieces of matrices owned elsewhere."""
        pos = 0
        for j in self.plan.outgoing:
            local = self.local_slice(j)
            size = local.stop - local.start
            yield j, slice(pos, pos + size), local
            pos += size

    def incoming_segments(self) -> Iterator[tuple[int, slice, slice]]:
        """``(matrix, buffer slice, slice within the matrix)`` per segment of the gather receive
        (= scatter send) buffer: other ranks' pieces of the matrices this rank owns."""
        pos = 0
        for j, src in self.plan.incoming:
            lo, hi = self.plan.matrices[j].pieces[src]
            yield j, slice(pos, pos + hi - lo), slice(lo, hi)
            pos += hi - lo


def _all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: tuple[int, ...],
    in_splits: tuple[int, ...],
    bucket: _Bucket,
) -> dist.Work | None:
    """Start the uneven ``all_to_all_single`` of ``inp`` into ``out`` over the bucket's group
    and return its handle; ``None`` (nothing sent) when no matrix of the bucket is split."""
    if not bucket.plan.split_anywhere:
        return None
    return dist.all_to_all_single(
        out, inp, list(out_splits), list(in_splits), group=bucket.pg, async_op=True
    )


def _gather(bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
    """Phase 1: pack this rank's pieces of others' matrices, cast to the wire (= NS) dtype, and
    start the all_to_all that brings every matrix's pieces to its owner.

    Returns the send buffer, the receive buffer (filled once the handle is waited on) and the
    handle (``None`` when nothing moves).
    """
    plan, device = bucket.plan, bucket.pending[0].update.device
    send = torch.empty(sum(plan.outgoing_splits), dtype=bucket.wire, device=device)
    for j, buf, own in bucket.outgoing_segments():
        send[buf].copy_(bucket.pending[plan.matrices[j].item].update[own])
    recv = torch.empty(sum(plan.incoming_splits), dtype=bucket.wire, device=device)
    work = _all_to_all(recv, send, plan.incoming_splits, plan.outgoing_splits, bucket)
    return send, recv, work


def _compute(
    bucket: _Bucket, recv: torch.Tensor, gathering: dist.Work | None
) -> dict[int, torch.Tensor]:
    """Phase 2: Newton–Schulz on every matrix this rank owns, given the gather's receive buffer
    and handle (waited on once the matrices held whole here are done). Returns the flat result
    per owned matrix index."""
    plan, pending = bucket.plan, bucket.pending
    # Newton–Schulz inputs of owned matrices: this rank's own piece now, the rest on arrival.
    inputs: dict[int, torch.Tensor] = {}
    for j in plan.owned:
        m = plan.matrices[j]
        inputs[j] = torch.empty(m.rows * m.cols, dtype=bucket.wire, device=recv.device)
        inputs[j][bucket.own_piece(j)].copy_(pending[m.item].update[bucket.local_slice(j)])
    waiting = {j for j, _ in plan.incoming}
    outputs: dict[int, torch.Tensor] = {}
    # Matrices held whole here are orthogonalised while the gather is in flight.
    for j in plan.owned:
        if j not in waiting:
            outputs[j] = _orthogonalize(plan.matrices[j], inputs.pop(j), pending)
    if gathering is not None:
        gathering.wait()
    for j, buf, piece in bucket.incoming_segments():
        inputs[j][piece].copy_(recv[buf])
    for j in plan.owned:
        if j in waiting:
            outputs[j] = _orthogonalize(plan.matrices[j], inputs.pop(j), pending)
    return outputs


def _scatter_and_apply(
    bucket: _Bucket, send: torch.Tensor, recv: torch.Tensor, outputs: dict[int, torch.Tensor]
) -> None:
    """Phase 3: send the owned results' pieces back to the ranks they came from (reusing the
    gather's buffers, roles swapped) and apply every pending parameter's update, in place."""
    plan, pending = bucket.plan, bucket.pending
    # Scatter: the gather reversed; the results land where this rank's pieces were sent from.
    for j, buf, piece in bucket.incoming_segments():
        recv[buf].copy_(outputs[j][piece])
    scattering = _all_to_all(send, recv, plan.outgoing_splits, plan.incoming_splits, bucket)
    # Each parameter's local update in the NS dtype, from its own results (now) and from the
    # owners (after the scatter); parameters that need nothing from others are applied first.
    results = [torch.empty_like(item.update, dtype=bucket.wire) for item in pending]
    remote_items = {plan.matrices[j].item for j in plan.outgoing}
    for j in plan.owned:
        piece = outputs[j][bucket.own_piece(j)]
        results[plan.matrices[j].item][bucket.local_slice(j)].copy_(piece)
    for i, item in enumerate(pending):
        if i not in remote_items:
            _apply(item, results[i])
    if scattering is not None:
        scattering.wait()
    for j, buf, own in bucket.outgoing_segments():
        results[plan.matrices[j].item][own].copy_(send[buf])
    for i in sorted(remote_items):
        _apply(pending[i], results[i])


def _orthogonalize(m: _Matrix, ns_input: torch.Tensor, pending: list[_Pending]) -> torch.Tensor:
    """The flat Newton–Schulz result of matrix ``m`` from its whole flat input (consumed)."""
    group, split = pending[m.item].group, pending[m.item].split
    matrix = ns_input.view(m.rows, m.cols)
    if split is not None:
        matrix = split.gather(matrix)
    out = _newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
    return (out if split is None else split.own(out)).reshape(-1)


def _slice_shape(param: torch.Tensor) -> torch.Size:
    """The shape of what data parallelism shards of ``param``: its tensor-parallel slice (the
    whole parameter without tensor parallelism)."""
    info = shard_info(param)
    return local(param).shape if info is None else info.layout.global_shape


def _apply(item: _Pending, update: torch.Tensor) -> None:
    """torch.optim.Muon's last two lines on the local piece (shape scale from the global shape)."""
    group, piece = item.group, item.piece
    shape = item.param.shape
    adjusted_lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], torch.Size(shape[-2:]))
    piece.mul_(1 - group["lr"] * group["weight_decay"])
    piece.add_(update.view(piece.shape), alpha=-adjusted_lr)
