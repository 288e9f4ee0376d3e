"""What the structure-aware optimizers share: local pieces, the skip rule, block checks, AdamW.

This rank's pieces of a parameter, its gradient and its state (:meth:`ShardedOptimizer._pieces`
hands a step the plain local tensors: a RaggedTensor's contiguous range of the row-major flattening,
and the matching piece of the global-mean gradient; a plain tensor is held whole), the global
non-finite skip rule, the check that a layout keeps an optimizer's blocks whole, torch's AdamW
update, and loading a state dict, kept as RaggedTensors ([Note: optimizer state across world sizes]
in ``_state.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from ..layout import ShardLayout
from ..tensor import comm_group, shard_info
from ._state import loaded_value, local, placed

__all__ = [
    "Pieces",
    "ShardedOptimizer",
    "advance_steps",
    "check_block_cuts",
    "local",
]

#: A parameter's new state: ``fn(param) -> {key: value}`` (values placed by ``placed``).
StateInit = Callable[[torch.Tensor], dict[str, Any]]


class Pieces(NamedTuple):
    """One parameter as a step computes on it: plain tensors holding this rank's pieces, which
    share the memory of the sharded ones (updated in place, they update them)."""

    param: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]  # the state's entries, tensors as their local pieces


def check_block_cuts(label: str, layout: ShardLayout, stride: int, block: str, fix: str) -> None:
    """Raise ``ValueError`` unless every rank boundary inside the parameter falls on a multiple of
    ``stride`` elements, i.e. the layout never splits one of the optimizer's blocks.

    ``block`` describes one block (for the message), ``fix`` says how to get a valid layout.
    """
    numel = layout.numel
    for rank, (_, end) in enumerate(layout.ranges[:-1]):
        if 0 < end < numel and end % stride:
            index = end // stride
            raise ValueError(
                f"{label}: the shard of rank {rank} ends at element {end}, inside block {index} "
                f"(elements [{index * stride}, {min((index + 1) * stride, numel)})) of {block}; "
                f"the layout's unit is {layout.unit_numel} elements, which does not keep these "
                f"blocks whole. {fix}"
            )


class ShardedOptimizer(Optimizer):
    """Base of the structure-aware optimizers: torch.optim semantics plus a global non-finite rule.

    Subclasses implement :meth:`_update` (one step over ``param_groups``, gradients known finite)
    and may extend :meth:`_check_group` to validate each param group as it is added.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer`` (named
            parameters ``(name, tensor)`` give error messages the names).
        defaults: the default hyper-parameters of a param group.
        skip_nonfinite: when any rank sees a NaN or Inf gradient, skip the whole step on every
            rank, count it in :attr:`skipped_steps` and warn (``True``), or raise ``RuntimeError``
            on every rank (``False``).
    """

    #: State keys whose tensors keep their own dtype (uint8 codes, fp32 scales and
    #: preconditioners): torch's ``load_state_dict`` casts every state tensor of a floating
    #: parameter to the parameter's dtype, so these are kept out of its hands.
    _KEEP_DTYPE_STATE_KEYS: ClassVar[tuple[str, ...]] = ()
    #: State keys that are not sharded: the same 0-D tensor on every rank.
    _REPLICATED_STATE_KEYS: ClassVar[tuple[str, ...]] = ("step",)

    def __init__(self, params: Any, defaults: dict[str, Any], *, skip_nonfinite: bool) -> None:
        self.skip_nonfinite = bool(skip_nonfinite)
        #: Steps skipped because some gradient was NaN or Inf (the same count on every rank).
        self.skipped_steps = 0
        super().__init__(params, defaults)

    # -- param groups ----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer``, then validate it
        (:meth:`_check_group`)."""
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1], len(self.param_groups) - 1)

    def _check_group(self, group: dict[str, Any], group_index: int) -> None:
        """Validate a param group just added (hyper-parameters, shapes, layouts)."""
        for name in ("lr", "weight_decay"):
            value = group.get(name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"param group {group_index}: {name} must be >= 0, got {value}")
        for index, param in enumerate(group["params"]):
            if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
                self._check_split(param, self.param_label(group, index, group_index), group)

    def _check_split(self, param: DTensor, label: str, group: dict[str, Any]) -> None:
        """Refuse ``param``, split by tensor or expert parallelism: its local tensor is a slice
        of the matrix (or of the stack of experts), and a whole-matrix update (Shampoo's
        factors, 8-bit blocks laid on the whole tensor) computed on it would be silently wrong.
        An optimizer that computes such parameters exactly overrides this."""
        raise ValueError(
            f"{type(self).__name__}: {label} is split by tensor or expert parallelism "
            f"({param.placements}); this optimizer needs each matrix whole on the data-parallel "
            f"ranks: use raggedfsdp's Muon or torch.optim (AdamW, SGD) for it, or shard it "
            f"without tensor parallelism"
        )

    @staticmethod
    def param_label(group: dict[str, Any], index: int, group_index: int) -> str:
        """How error messages name parameter ``index`` of ``group``: its name when the optimizer
        was given named parameters, else its position; with its global shape."""
        param = group["params"][index]
        names = group.get("param_names")
        where = (
            f"parameter {names[index]!r}"
            if names
            else f"parameter {index} of param group {group_index}"
        )
        return f"{where} (global shape {list(param.shape)})"

    def _label_of(self, param: torch.Tensor) -> str:
        for group_index, group in enumerate(self.param_groups):
            for index, p in enumerate(group["params"]):
                if p is param:
                    return self.param_label(group, index, group_index)
        raise AssertionError("parameter not in this optimizer")

    # -- step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step (skipped on every rank when a gradient is not finite)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._gradients_finite():
            self._update()
        return loss

    def _update(self) -> None:
        raise NotImplementedError

    def _gradients_finite(self) -> bool:
        """Whether every gradient on every rank is finite; the same answer on every rank.

        One host read per step: of this rank's non-finite flag, or, when some parameters are
        sharded, of the all-reduce (one per shard process group) that carries the flag and, per
        sharded parameter, whether it has a gradient here: a parameter must have a gradient on
        all ranks of its group or on none, since the optimizers' collectives depend on it.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        # The local pieces: this check is local by design (a sharded gradient's own norm would
        # be the global one, a collective).
        pieces = [local(p.grad) for p in params if p.grad is not None]
        bad = _nonfinite_flag([g for g in pieces if g.numel() > 0])
        groups = _shard_groups(params)
        # With shard groups, every rank joins their all-reduces, whatever it saw itself.
        any_bad = self._any_bad_in_groups(groups, bad) if groups else bad is not None and bool(bad)
        if not any_bad:
            return True
        here = [
            self._label_of(p) for p in params if p.grad is not None and _nonfinite(local(p.grad))
        ]
        where = f"; on this rank: {', '.join(here)}" if here else " on another rank"
        if not self.skip_nonfinite:
            raise RuntimeError(
                f"non-finite gradient{where}. Pass skip_nonfinite=True to skip such steps"
            )
        self.skipped_steps += 1
        warnings.warn(
            f"{type(self).__name__}: skipped a step because of a non-finite gradient{where} "
            f"({self.skipped_steps} skipped so far)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    def _any_bad_in_groups(self, groups: list[ShardGroup], bad: torch.Tensor | None) -> bool:
        """Whether a rank of some shard group saw a non-finite gradient (``bad``: this rank's
        flag, not read here): one all-reduce and one host read per group, which also check that
        each sharded parameter has a gradient on all of its ranks or on none."""
        any_bad = False
        for group, members in groups:
            device = local(members[0]).device
            has_grad = [int(p.grad is not None) for p in members]
            flag = torch.zeros(1, dtype=torch.int64, device=device) if bad is None else bad
            flags = torch.cat([flag.view(1).to(device), torch.tensor(has_grad, device=device)])
            dist.all_reduce(flags, group=group)
            counts = flags.tolist()
            any_bad |= bool(counts[0])
            world = dist.get_world_size(group)
            for p, count in zip(members, counts[1:], strict=True):
                if count not in (0, world):
                    raise RuntimeError(
                        f"{self._label_of(p)} has a gradient on {count} of the {world} ranks of "
                        f"its shard group; it needs one on every rank or on none"
                    )
        return any_bad

    # -- pieces and state ------------------------------------------------------------------------

    def sharded_state_layout(self, param: torch.Tensor, key: str) -> ShardLayout | None:
        """How state entry ``key`` of ``param`` is sharded ([Note: optimizer state across world
        sizes]): ``None`` for an unsharded parameter or a replicated key (``step``), else the
        parameter's layout; optimizers with block-structured state override it for their keys."""
        info = shard_info(param)
        if info is None or key in self._REPLICATED_STATE_KEYS:
            return None
        return info.layout

    def _placed(self, param: torch.Tensor, key: str, piece: torch.Tensor) -> torch.Tensor:
        """A new state entry ``key`` of ``param`` from this rank's ``piece``: a RaggedTensor
        placed by :meth:`sharded_state_layout` when ``param`` is one, else ``piece``."""
        return placed(param, self.sharded_state_layout(param, key), piece)

    def _pieces(self, param: torch.Tensor, init: StateInit) -> Pieces:
        """Where every per-parameter step starts: ``param``, its gradient and its state as this
        rank's plain pieces, the state made by ``init(param)`` first when there is none."""
        state = self.state[param]
        if not state:
            state.update(init(param))
        return Pieces(local(param), local(param.grad), {k: local(v) for k, v in state.items()})

    # -- the AdamW update, shared by Muon's auxiliary groups and AdamW8bit's small parameters ----

    def _adamw_state(self, param: torch.Tensor) -> dict[str, Any]:
        """torch.optim.AdamW's state of a new parameter."""
        zeros = torch.zeros_like(local(param), memory_format=torch.preserve_format)
        return {
            "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
            "exp_avg": self._placed(param, "exp_avg", zeros),
            "exp_avg_sq": self._placed(param, "exp_avg_sq", zeros.clone()),
        }

    def _adamw_update(self, group: dict[str, Any], params: Iterable[torch.Tensor]) -> None:
        """torch.optim.AdamW's update (its own functional kernel, so the numbers are torch's) on
        the local pieces of ``params``: elementwise, so a shard needs no communication.
        Uses ``group`` keys ``lr``, ``betas``, ``eps``, ``weight_decay``; state keys as torch's."""
        pieces = [self._pieces(p, self._adamw_state) for p in params]
        if not pieces:
            return
        beta1, beta2 = group["betas"]
        _torch_adamw(
            [x.param for x in pieces],
            [x.grad for x in pieces],
            [x.state["exp_avg"] for x in pieces],
            [x.state["exp_avg_sq"] for x in pieces],
            [],
            [x.state["step"] for x in pieces],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    # -- checkpoints -----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, with the state of sharded parameters placed as this
        optimizer keeps it (RaggedTensors, [Note: optimizer state across world sizes]: what DCP
        loaded in place is kept, whole tensors and this rank's own pieces are placed, another
        layout is a ``ValueError``) and the keys of ``_KEEP_DTYPE_STATE_KEYS`` in their own
        dtype. Saved state is matched to parameters by position, as torch does."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        indexed = [
            (p, self.param_label(group, index, group_index))
            for group_index, group in enumerate(self.param_groups)
            for index, p in enumerate(group["params"])
        ]
        if len(saved_ids) != len(indexed):
            super().load_state_dict(state_dict)  # torch names the mismatch
            return
        placed_state, kept = dict(state_dict["state"]), {}
        for saved_id, (p, label) in zip(saved_ids, indexed, strict=True):
            if saved_id not in placed_state:
                continue
            values = {
                key: loaded_value(p, key, value, self.sharded_state_layout, label)
                for key, value in placed_state[saved_id].items()
            }
            device = local(p).device
            own_dtype = {k: _to(values.pop(k), device) for k in self._keep(values)}
            kept[p] = (list(placed_state[saved_id]), own_dtype)
            placed_state[saved_id] = values
        super().load_state_dict({**state_dict, "state": placed_state})
        for p, (order, own_dtype) in kept.items():
            state = self.state[p]
            self.state[p] = {k: own_dtype[k] if k in own_dtype else state[k] for k in order}

    def _keep(self, values: dict[str, Any]) -> list[str]:
        """The keys of ``values`` that keep their own dtype."""
        return [k for k in self._KEEP_DTYPE_STATE_KEYS if k in values]


def advance_steps(steps: list[torch.Tensor]) -> list[float]:
    """Add one to every ``step`` tensor (in place) and read them all in one host read: what a
    per-parameter ``float(step)`` would read, for the price of one."""
    if not steps:
        return []
    torch._foreach_add_(steps, 1)
    return torch.stack(steps).tolist()


#: A shard process group and the parameters sharded over it.
ShardGroup = tuple[dist.ProcessGroup, list[torch.Tensor]]


def _shard_groups(params: list[torch.Tensor]) -> list[ShardGroup]:
    """The process groups ``params`` are sharded over, each with its parameters, in first
    appearance order (the same on every rank of a group)."""
    by_group: dict[int, ShardGroup] = {}
    for p in params:
        group = comm_group(p)
        if group is not None:
            by_group.setdefault(id(group), (group, []))[1].append(p)
    return list(by_group.values())


def _nonfinite_flag(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """1 (int64, 0-D, on the gradients' device) when a NaN or Inf is among ``grads``, else 0;
    ``None`` without gradients. Not read: the caller decides where the host waits for it."""
    if not grads:
        return None
    # One fused max-abs per tensor: NaN and Inf both make it non-finite.
    norms = torch._foreach_norm(grads, math.inf)
    device = grads[0].device
    finite = torch.stack([n.to(device, torch.float32) for n in norms]).isfinite().all()
    return finite.logical_not().to(torch.int64)


def _nonfinite(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 0 and not bool(tensor.isfinite().all())


def _to(value: Any, device: torch.device) -> Any:
    """``value`` on ``device`` (no copy when it is there already)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def check_betas(betas: Any, where: str) -> None:
    """``ValueError`` unless ``betas`` is two numbers in [0, 1) (torch.optim's rule)."""
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where} must be two numbers in [0, 1), got {betas}")
