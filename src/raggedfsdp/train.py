"""Train a GPT with raggedfsdp: the job one worker runs.

Launch it with ``raggedfsdp train`` (which starts the workers through torchrun's own code path),
or with torchrun directly::

    torchrun --standalone --nproc-per-node 2 -m raggedfsdp.train --model gpt-tiny --steps 50

Every option is a :class:`~raggedfsdp.train_config.TrainConfig` field (``--help`` lists them).
The script below reads top to bottom: distributed set-up, output folder and resume point, data,
model, optimizer, resume, monitoring, the training loop, the end. Helpers live in
``train_config`` (options), ``train_checkpoint`` (checkpoints), ``monitor`` (metrics and reports)
and ``health`` (timeouts, watchdog, NaN handling).

Reproducibility: every rank builds the same model from ``--seed``, and the global batch of step
``k`` depends only on ``(seed, k)``, so a run resumed from a checkpoint - at the same or another
world size - sees the same batches as an uninterrupted one (at the same world size the result is
bit for bit the same).

Errors: a user error (bad option, missing data, incompatible checkpoint, ...) is a ``ValueError``;
every rank meets it alike, so rank 0 reports it, in one line, and exits with status 2 (``--debug``
shows the traceback); another rank reports only an error rank 0 did not have.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from . import health
from .backend import FSDPBackend
from .clip import clip_grad_norm_
from .data import BatchSampler, eval_batches, load_corpus
from .layout import RaggedShard, shard_info
from .models import GPT, GPT_CONFIGS
from .monitor import Monitor, StepTimes
from .param_group import MixedPrecisionPolicy
from .planner import StructAwarePlanner
from .train_checkpoint import (
    check_entries,
    check_out_dir,
    latest_checkpoint,
    load_checkpoint,
    prepare_out_dir,
    read_meta,
    remove_partial,
    save_checkpoint,
)
from .train_config import TrainConfig, add_config_arguments, config_from_args

__all__ = [
    "build_model",
    "build_optimizer",
    "build_parser",
    "dry_run_report",
    "lr_factor",
    "main",
    "preflight",
]

#: Exit status of a user error (argparse's convention, as the ``raggedfsdp`` command).
USAGE_ERROR = 2
#: Seconds a rank other than 0 waits before reporting a user error (see main()).
ERROR_GRACE_S = 3.0
#: Betas of every Adam-style update (nanoGPT's choice for small GPTs).
BETAS = (0.9, 0.95)

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Builders (also used by the tests and by --dry-run).


def build_planner(cfg: TrainConfig) -> StructAwarePlanner:
    """The shard planner: the user's block policy, plus the optimizer's blocks kept whole."""
    options = (
        {"max_preconditioner_dim": cfg.max_preconditioner_dim} if cfg.optimizer == "shampoo" else {}
    )
    return StructAwarePlanner(
        optimizer_type=cfg.optimizer,
        shard_policy=RaggedShard(block_size=cfg.parsed_block_size()),
        **options,
    )


def _mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy | None:
    if cfg.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each block's activations in backward. The block's ``forward`` is replaced on the
    instance (not wrapped in another module), so parameter names - and checkpoints - do not
    change; the FSDP hooks of the block still run around it and unshard before recomputation."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    """The same GPT on every rank (seeded by ``cfg.seed``), sharded by raggedfsdp. Needs the
    process group."""
    torch.manual_seed(cfg.seed)
    model = GPT(GPT_CONFIGS[cfg.model], device=device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    FSDPBackend(model, planner=build_planner(cfg), mp_policy=_mp_policy(cfg))
    return model


def _global_ndim(p: torch.Tensor) -> int:
    """Dimensions of the whole parameter (a local shard of a matrix may be 1-D)."""
    info = shard_info(p)
    return p.ndim if info is None else info.layout.ndim


def _global_numel(p: torch.Tensor) -> int:
    info = shard_info(p)
    return p.numel() if info is None else info.layout.numel


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``--optimizer``, with weight decay on matrices only. Muon takes the
    blocks' matrices; embeddings and vectors go to its auxiliary AdamW. Every group records its
    peak learning rate as ``initial_lr`` (the schedule scales it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if _global_ndim(p) >= 2]
    vectors = [p for n, p in named if _global_ndim(p) < 2]
    decay = {"params": matrices, "weight_decay": cfg.weight_decay}
    no_decay = {"params": vectors, "weight_decay": 0.0}
    optimizer: torch.optim.Optimizer
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW([decay, no_decay], lr=cfg.lr, betas=BETAS)
    else:
        try:  # raggedfsdp.optim is optional for AdamW runs; import it only when asked for
            from . import optim
        except ImportError as err:
            raise ValueError(
                f"--optimizer {cfg.optimizer} needs raggedfsdp.optim, which cannot be imported "
                f"({err})"
            ) from None
        if cfg.optimizer == "muon":
            in_blocks = [p for n, p in named if n.startswith("blocks.") and _global_ndim(p) >= 2]
            embeddings = [
                p for n, p in named if not n.startswith("blocks.") and _global_ndim(p) >= 2
            ]
            optimizer = optim.Muon(
                [
                    {"params": in_blocks},
                    {"params": embeddings, "use_muon": False, "weight_decay": cfg.weight_decay},
                    {"params": vectors, "use_muon": False, "weight_decay": 0.0},
                ],
                lr=cfg.muon_lr,
                weight_decay=cfg.weight_decay,
                adamw_lr=cfg.lr,
                adamw_betas=BETAS,
            )
        elif cfg.optimizer == "shampoo":
            optimizer = optim.Shampoo(
                [decay, no_decay],
                lr=cfg.lr,
                betas=BETAS,
                max_preconditioner_dim=cfg.max_preconditioner_dim,
            )
        else:
            optimizer = optim.AdamW8bit([decay, no_decay], lr=cfg.lr, betas=BETAS)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier of step ``step`` (0-based): linear warm-up, then cosine decay to
    ``min_lr_ratio``. A function of the step alone, so resuming needs no scheduler state."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            values = value if isinstance(value, (list, tuple)) else [value]
            total += sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))
    return total


# ---------------------------------------------------------------------------------------------
# Checks a launcher runs before starting workers, and the dry run.


def check_data_path(path: str | None) -> None:
    """The cheap part of ``load_corpus``'s checks: a missing path or an empty file."""
    if path is None:
        return
    data = Path(path)
    if not data.exists():
        raise ValueError(f"data: corpus path {str(data)!r} does not exist")
    if data.is_file() and data.stat().st_size == 0:
        raise ValueError(f"data: corpus file {str(data)!r} is empty")
    if data.is_dir() and not any(p.is_file() for p in data.rglob("*")):
        raise ValueError(f"data: corpus folder {str(data)!r} has no files")


def _model_entries(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """DCP keys and shapes of the model part of a checkpoint of this run."""
    model = GPT(GPT_CONFIGS[cfg.model], device="meta")
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def preflight(cfg: TrainConfig, world_size: int, *, check_out: bool = True) -> None:
    """What can be checked before any worker starts (``ValueError`` naming the problem): the
    batch split, the data path, the output folder (``check_out``: only where the run starts, on
    one node) and, when resuming, that the newest checkpoint fits the model and optimizer."""
    cfg.check_world(world_size)
    check_data_path(cfg.data)
    if not check_out:
        return
    check_out_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite)
    ckpt = latest_checkpoint(cfg.out) if cfg.resume else None
    if ckpt is not None:
        meta = read_meta(ckpt)
        saved = meta["config"].get("optimizer")
        if saved != cfg.optimizer:
            raise ValueError(
                f"checkpoint {str(ckpt)!r} was saved with --optimizer {saved}; this run uses "
                f"{cfg.optimizer}, whose state it does not have"
            )
        check_entries(ckpt, _model_entries(cfg), meta)


def dry_run_report(cfg: TrainConfig, world_size: int) -> str:
    """The shard plan of the model on the meta device and an estimate of memory per rank."""
    gpt = GPT_CONFIGS[cfg.model]
    model = GPT(gpt, device="meta")
    comm_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    plans = build_planner(cfg).plan_model(model, world_size, dtype=comm_dtype)
    shard = sum(p.shard_numel for p in plans)
    padding = sum(p.padding_numel for p in plans)
    numel = sum(p.param_numel for p in plans)
    lines = [
        f"{cfg.model}: {model.num_params():,} parameters on {world_size} rank(s), "
        f"optimizer {cfg.optimizer}, block {cfg.block_size}",
        f"{'bucket':<28}{'params':>8}{'elements':>12}{'per rank':>12}{'padding':>10}",
    ]
    for plan in plans:
        lines.append(
            f"{plan.name:<28}{len(plan.entries):>8}{plan.param_numel:>12,}"
            f"{plan.shard_numel:>12,}{100 * plan.padding_ratio:>9.3f}%"
        )
    lines.append(
        f"{'total':<28}{'':>8}{numel:>12,}{shard:>12,}{100 * padding / max(1, numel):>9.3f}%"
    )
    # Per rank: fp32 master shard and gradient; optimizer state per element; the unsharded
    # working set (the two largest units gathered - one computing, one prefetched - and one
    # unit's full gradient); activations by Megatron's estimate of s*b*h*(34 + 5*a*s/h) bytes
    # per layer at 16 bits (doubled for fp32; only the block inputs kept under checkpointing).
    state_bytes = {"adamw": 8, "muon": 6, "shampoo": 12, "adamw8bit": 3}[cfg.optimizer]
    units = sorted((p.total_numel for p in plans), reverse=True)
    working = (sum(units[:2]) * comm_dtype.itemsize) + units[0] * 4
    b, s, h, a = (
        cfg.batch_size // world_size // cfg.grad_accum,
        cfg.tokens_per_seq,
        gpt.d_model,
        gpt.n_head,
    )
    per_layer = s * b * h * (34 + 5 * a * s / h) * (2 if comm_dtype == torch.float32 else 1)
    activations = (
        gpt.n_layer * s * b * h * 4 + per_layer
        if cfg.activation_checkpointing
        else gpt.n_layer * per_layer
    )
    estimates = [
        ("parameters + gradients (fp32 shards)", shard * 8),
        (f"optimizer state (~{state_bytes} B/element)", shard * state_bytes),
        ("unsharded working set", working),
        (f"activations (~, micro-batch of {b})", int(activations)),
    ]
    lines.append("estimated memory per rank:")
    lines += [f"  {name:<40}{n / 2**20:>10,.1f} MiB" for name, n in estimates]
    lines.append(f"  {'total':<40}{sum(n for _, n in estimates) / 2**20:>10,.1f} MiB")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Distributed helpers.


def _rank0_decides(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and give every rank its result, or its ``ValueError``: decisions
    about shared files (which checkpoint, may the folder be used) must agree across ranks."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except ValueError as err:
            box[0] = ("error", str(err))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ValueError(value)
    return value


def _synchronize(device: torch.device) -> None:
    """Wait for queued device work so that wall-clock timings mean something on GPUs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device) -> float:
    """Mean validation loss over the fixed batches and all ranks."""
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in batches:
        total += model(x.to(device), y.to(device)).float()
    model.train()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


# ---------------------------------------------------------------------------------------------
# The job.


def build_parser() -> argparse.ArgumentParser:
    """The worker's options: every TrainConfig field, ``--config`` and ``--debug``."""
    parser = argparse.ArgumentParser(
        prog="raggedfsdp.train", description="Train a GPT with raggedfsdp (one worker)."
    )
    add_config_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def train(cfg: TrainConfig) -> None:
    """Run the job described by ``cfg`` on the process group that torchrun set up (or on one
    process without torchrun)."""
    started = time.perf_counter()

    # -- distributed -----------------------------------------------------------------------------
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg.check_world(world)
    if cfg.dry_run:
        if rank == 0:
            print(dry_run_report(cfg, world))
        return
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    health.init_process_group(backend, timeout_s=cfg.comm_timeout_s, device=device)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    # -- output folder and resume point ----------------------------------------------------------
    out = Path(cfg.out)
    resume = cfg.resume or restarted  # an elastic restart continues from the last checkpoint

    def open_out_dir() -> str | None:
        prepare_out_dir(out, resume=resume, overwrite=cfg.overwrite and not restarted)
        if not resume:
            return None
        for path in remove_partial(out):
            print(f"removed an incomplete checkpoint: {path}", flush=True)
        ckpt = latest_checkpoint(out)
        return None if ckpt is None else str(ckpt)

    ckpt = _rank0_decides(open_out_dir)
    if rank == 0 and resume and ckpt is None:
        print(f"no complete checkpoint in {out}: starting from step 0", flush=True)
    if rank == 0:
        (out / "config.json").write_text(
            json.dumps({**cfg.to_dict(), "world_size": world}, indent=2) + "\n"
        )

    # -- data ------------------------------------------------------------------------------------
    corpus = load_corpus(cfg.data, seed=cfg.seed)
    seq_len = cfg.tokens_per_seq
    sampler = BatchSampler(
        corpus.train,
        seq_len=seq_len,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
    )
    val_batches = eval_batches(
        corpus.val,
        cfg.eval_batches,
        seq_len=seq_len,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
    )

    # -- model -----------------------------------------------------------------------------------
    model = build_model(cfg, device)
    stats = model.stats()
    padding_ratio = stats["padding_numel"] / max(1, stats["param_numel"])

    # -- optimizer -------------------------------------------------------------------------------
    optimizer = build_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]

    # -- resume ----------------------------------------------------------------------------------
    start_step = 0
    if ckpt is not None:
        meta = load_checkpoint(ckpt, model=model, optimizer=optimizer)
        sampler.load_state_dict(meta["data"])
        start_step = meta["step"]
        saved = meta["config"]
        changed = [k for k in ("seed", "batch_size", "seq_len") if saved.get(k) != getattr(cfg, k)]
        if rank == 0:
            print(
                f"resumed from {ckpt} (step {start_step}, saved on {meta['world_size']} "
                f"rank(s), now {world})"
                + (f"; changed {', '.join(changed)}: the data order differs" if changed else ""),
                flush=True,
            )

    # -- monitoring and health -------------------------------------------------------------------
    monitor = Monitor(
        cfg,
        rank=rank,
        world_size=world,
        start_step=start_step,
        padding_ratio=padding_ratio,
        device=device,
    )
    monitor.print(
        f"{cfg.model}: {sum(_global_numel(p) for p in params):,} parameters, {world} rank(s) "
        f"({backend}), optimizer {cfg.optimizer}, block {cfg.block_size}, padding "
        f"{100 * padding_ratio:.3f}%, corpus {corpus.source} "
        f"({corpus.train.numel():,} train tokens)"
    )
    watchdog = health.StepWatchdog(cfg.step_timeout_s, rank=rank)
    faults = out / ".faults"
    crash_rank = 1 if world > 1 else 0

    def save(step: int) -> None:
        def before_commit() -> None:
            if cfg.fail_during_save == step and rank == world - 1:
                health.crash_once(faults / f"save_{step}")

        path = save_checkpoint(
            out,
            step,
            model=model,
            optimizer=optimizer,
            meta={"config": cfg.to_dict(), "data": sampler.state_dict()},
            before_commit=before_commit,
        )
        monitor.print(f"checkpoint: {path}")

    # -- training loop ---------------------------------------------------------------------------
    if start_step == 0:
        monitor.eval(0, evaluate(model, val_batches, device))  # where the loss starts
    for step in range(start_step, cfg.steps):
        done = step + 1  # steps completed after this one
        if cfg.fail_at_step == done and rank == crash_rank:
            health.crash_once(faults / f"step_{done}")
        with watchdog.step(done):
            t0 = time.perf_counter()
            model.reset_stats()
            factor = lr_factor(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
            x, y = sampler.next()
            loss_sum = torch.zeros((), device=device)
            micro = list(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum), strict=True))
            for i, (xb, yb) in enumerate(micro):
                # Reduce gradients only after the last micro-batch; the others accumulate.
                with nullcontext() if i == len(micro) - 1 else model.no_sync():
                    loss = model(xb.to(device), yb.to(device)) / len(micro)
                    loss.backward()
                loss_sum += loss.detach()
            _synchronize(device)
            t_backward = time.perf_counter()
            loss_value = health.global_loss(loss_sum)
            t_optimizer = time.perf_counter()
            grad_norm = clip_grad_norm_(params, cfg.grad_clip).item() if cfg.grad_clip else None
            finite = math.isfinite(loss_value) and (grad_norm is None or math.isfinite(grad_norm))
            if finite:
                optimizer.step()
            elif cfg.on_nan == "stop":
                raise health.NonFiniteLossError(
                    f"step {done}: the loss is {loss_value} (gradient norm {grad_norm}) on some "
                    f"rank; stopping (--on-nan skip would skip such steps)"
                )
            else:
                monitor.print(f"step {done}: non-finite loss or gradient; step skipped")
            optimizer.zero_grad(set_to_none=True)
            _synchronize(device)
            t_end = time.perf_counter()
        stats = model.stats()
        comm = stats["comm_wait_seconds"]
        monitor.step(
            done,
            loss=loss_value,
            lr=optimizer.param_groups[0]["lr"],
            grad_norm=grad_norm,
            times=StepTimes(
                total=t_end - t0,
                compute=max(0.0, t_backward - t0 - comm),
                comm=comm,
                optimizer=t_end - t_optimizer,
            ),
            stats=stats,
            optimizer_bytes=_optimizer_bytes(optimizer),
            skipped=not finite,
        )
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            monitor.eval(done, evaluate(model, val_batches, device))
        if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
            save(done)

    # -- the end ---------------------------------------------------------------------------------
    watchdog.close()
    monitor.close(wall_s=time.perf_counter() - started)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and train; the exit status (user errors: one line, status 2)."""
    args = build_parser().parse_args(argv)
    # raggedfsdp's DCP values are ShardedTensors (the only DCP container for ragged shards; see
    # checkpoint.py), which torch warns about on every save and load.
    warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
    try:
        train(config_from_args(args))
    except (ValueError, health.NonFiniteLossError) as err:
        if args.debug:
            raise
        message = " ".join(str(err).split())
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:
            # Ranks meet user errors alike: rank 0 reports it, and its exit makes torchrun stop
            # this worker during the wait. A rank still alive after the wait met an error of
            # its own, and reports it.
            time.sleep(ERROR_GRACE_S)
            message = f"rank {rank}: {message}"
        sys.stderr.write(f"raggedfsdp: error: {message}\n")
        return USAGE_ERROR if isinstance(err, ValueError) else 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: Gloo sometimes aborts there after all work is done, and a
    # non-zero exit would make torchrun's agent restart a finished job.
    os._exit(code)
