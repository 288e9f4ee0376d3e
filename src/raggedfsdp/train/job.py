"""The job one worker runs: train a GPT (or a Hugging Face causal LM) with raggedfsdp.

Launch it with ``raggedfsdp train`` or ``torchrun ... -m raggedfsdp.train``; every option is a
:class:`~raggedfsdp.train.config.TrainConfig` field. :func:`train` reads top to bottom (set-up,
output folder and resume point, data, model, optimizer, resume, monitoring, the loop, the end), one
or two helpers per section defined above it; :func:`train_step` is one optimizer step. How a run
stays reproducible and how it reports errors: the comment at :func:`train`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .._console import write_whole
from .._host import local_device
from ..data import BatchSampler, Corpus, eval_batches, load_corpus
from ..digits import ImageTextSampler, load_digits
from ..models import hf
from . import health
from .build import build_model, build_optimizer, build_pipeline, job_mesh, optimizer_bytes
from .checkpoints import load_checkpoint, save_checkpoint
from .config import TrainConfig, add_config_arguments, config_from_args
from .failures import report_error, report_failure
from .faults import Fault, FaultKind
from .lora_meter import LoRAMeter
from .mesh import JobMesh, degrees_text
from .monitor import Monitor
from .preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption
from .preflight import dry_run_report
from .run_dir import current_job, prepare_out_dir, remove_partial, resume_checkpoint
from .step import train_step

if TYPE_CHECKING:  # its module loads torch's pipelining: only under --pp
    from .pipeline import Pipeline

__all__ = ["build_parser", "digit_accuracy", "evaluate", "main", "train"]

T = TypeVar("T")

#: A batch: ``(x, y)``, or a VLM's ``(x, y, pixels)``.
Batch = tuple[torch.Tensor, ...]


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


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], device: torch.device) -> float:
    """Mean validation loss over the fixed batches and all ranks."""
    model.eval()
    total = torch.zeros((), device=device)
    for batch in batches:
        total += model(*(t.to(device) for t in batch)).float()
    model.train()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


@torch.no_grad()
def digit_accuracy(
    model: nn.Module, batches: list[Batch], answer_position: int, device: torch.device
) -> float:
    """The share of held-out digits (over all ranks) whose greedy next token after the prompt
    is the digit's byte; ``batches`` as
    :meth:`~raggedfsdp.digits.ImageTextSampler.accuracy_batches` gives them."""
    model.eval()
    counts = torch.zeros(2, device=device)  # correct, counted
    for x, pixels, labels, counted in batches:
        logits = model(x.to(device), None, pixels.to(device))
        guess = logits[:, answer_position].argmax(dim=-1)
        right = (guess == labels.to(device) + ord("0")) & counted.to(device)
        counts += torch.stack([right.sum(), counted.to(device).sum()]).float()
    model.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


# ---------------------------------------------------------------------------------------------
# The run: its place in the job, and the state the loop works on.


@dataclass(frozen=True)
class _World:
    """This process's place in the job, as torchrun's environment gives it (one process of one
    without torchrun)."""

    rank: int
    size: int
    local_rank: int
    restarted: bool = False
    """True in an elastic restart on any node (:func:`health.restarted`, agreed by all ranks
    once the process group is up): an agent started the workers again after a failure or a
    change of membership."""

    @classmethod
    def from_env(cls) -> _World:
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )


@dataclass
class _Run:
    """Everything the training loop needs, built once by :func:`train`, so that the loop's
    helpers take one argument instead of a dozen."""

    cfg: TrainConfig
    world: _World
    mesh: JobMesh
    device: torch.device
    out: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    sampler: BatchSampler
    val_batches: list[Batch]
    monitor: Monitor
    watchdog: health.StepWatchdog
    preemption: Preemption
    accuracy_batches: list[Batch] | None = None  # a VLM's held-out digits
    pipeline: Pipeline | None = None  # under --pp: this rank's stages and their schedule
    consecutive_skips: int = 0  # steps skipped in a row for a non-finite loss or gradient
    skipped_steps: int = 0  # ... in this launch

    def count_skip(self, step: int, skipped: bool) -> None:
        """Track skipped steps; past ``--max-consecutive-skips`` in a row or
        ``--max-skipped-steps`` in all, give up (training is diverging, not hiccuping)."""
        if not skipped:
            self.consecutive_skips = 0
            return
        self.consecutive_skips += 1
        self.skipped_steps += 1
        cfg = self.cfg
        if self.consecutive_skips >= cfg.max_consecutive_skips:
            reason = f"{self.consecutive_skips} steps in a row (--max-consecutive-skips)"
        elif self.skipped_steps >= cfg.max_skipped_steps:
            reason = f"{self.skipped_steps} steps in this launch (--max-skipped-steps)"
        else:
            return
        raise health.NonFiniteLossError(
            f"step {step}: the loss or gradient was not finite in {reason}; giving up (lower "
            f"--lr, or resume from an earlier checkpoint)"
        )

    @property
    def faults(self) -> Path:
        """Where the fault-injection options leave their once-only markers."""
        return self.out / ".faults"

    @property
    def crash_rank(self) -> int:
        """The rank ``--inject-fault kill-at-step=N`` kills: a worker, not reporting rank 0."""
        return 1 if self.world.size > 1 else 0

    def evaluate(self, step: int) -> None:
        """Record the validation loss now, and a VLM's held-out digit accuracy (on every rank)."""
        model_loss = functools.partial(evaluate, self.model)
        loss_of = self.pipeline.evaluate if self.pipeline else model_loss
        val_loss = loss_of(self.val_batches, self.device)
        accuracy = None
        if self.accuracy_batches is not None:
            answer = self.cfg.image_format().answer_position
            accuracy = digit_accuracy(self.model, self.accuracy_batches, answer, self.device)
        self.monitor.eval(step, val_loss, digit_accuracy=accuracy)

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What ``COMPLETE.json`` records beside the files: the run's config and data position,
        the job that wrote it, and a Hugging Face model's config itself, so export needs no
        file outside the checkpoint."""
        meta = {
            "config": self.cfg.to_dict(),
            "data": self.sampler.state_dict(),
            "mesh": self.mesh.describe(),  # which ranks' RNG states and residuals correspond
            "job": current_job(),  # a save never replaces another job's step folder
        }
        if self.cfg.hf_config is not None:
            meta["hf_config_record"] = hf.config_record(self.cfg.hf_config)
        return meta

    def _before_commit(self, step: int) -> None:
        """``--inject-fault kill-during-save=N``: kill the last rank once, after the shards
        are written and before the checkpoint is marked complete (what resuming must
        survive)."""
        during_save = Fault(FaultKind.KILL_DURING_SAVE, step)
        if self.cfg.fault == during_save and self.world.rank == self.world.size - 1:
            health.crash_once(self.faults / f"save_{step}")

    def save(self, step: int) -> None:
        """Save the checkpoint of ``step`` (a collective) and say where it went; never one of
        non-finite weights (the previous checkpoint stays the newest)."""
        if not health.all_finite(self.model.parameters()):
            raise health.NonFiniteLossError(
                f"step {step}: the weights hold NaN or Inf; not saving them (the newest "
                f"checkpoint stays the last good one)"
            )
        path = save_checkpoint(
            self.out,
            step,
            model=self.model,
            optimizer=self.optimizer,
            meta=self._checkpoint_meta(),
            before_commit=functools.partial(self._before_commit, step),
        )
        self.monitor.print(f"checkpoint: {path}")


# ---------------------------------------------------------------------------------------------
# The job's sections (train() calls them in order).


def _init_distributed(
    cfg: TrainConfig, world: _World, watchdog: health.StepWatchdog
) -> tuple[torch.device, str, _World]:
    """This rank's device and the process group on it (NCCL on CUDA, Gloo otherwise), with the
    job's communication timeout; the device, the backend's name, and ``world`` with the
    restart agreed by every rank."""
    device = local_device(world.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    watchdog.starting(f"meeting the other ranks of {world.size}")
    store = health.init_process_group(backend, timeout_s=cfg.comm_timeout_s, device=device)
    restarted = health.restarted(device)
    watchdog.starting(f"met {world.size} rank(s) at {store}; loading and building")
    return device, backend, dataclasses.replace(world, restarted=restarted)


def _claim_out_dir(out: Path, *, resume: bool, overwrite: bool, strict: bool) -> str | None:
    """Rank 0's side of :func:`_open_out_dir`: prepare the folder and, when resuming, drop the
    incomplete checkpoints and pick the newest complete one that verifies (its files are what
    its COMPLETE.json recorded), saying in one line which newer ones it skipped and why. A
    ``ValueError`` when ``strict`` and the newest does not verify, or when none does."""
    prepare_out_dir(out, resume=resume, overwrite=overwrite)
    if not resume:
        return None
    for path in remove_partial(out):
        print(f"removed an incomplete checkpoint: {path}", flush=True)
    ckpt, line = resume_checkpoint(out, strict=strict)
    if line:
        print(line, flush=True)
    return None if ckpt is None else str(ckpt)


def _open_out_dir(cfg: TrainConfig, out: Path, world: _World) -> str | None:
    """Claim the output folder and find the checkpoint to resume from (None: start at step 0).

    Rank 0 decides for every rank, since the folder is shared (and verifies the checkpoint for
    all: the others wait in the broadcast). An elastic restart always resumes, and never
    overwrites: the folder then holds this very run."""
    resume = cfg.resume or world.restarted
    claim = functools.partial(
        _claim_out_dir,
        out,
        resume=resume,
        overwrite=cfg.overwrite and not world.restarted,
        strict=cfg.strict_resume,
    )
    ckpt = _rank0_decides(claim)
    if world.rank == 0 and resume and ckpt is None:
        print(f"no complete checkpoint in {out}: starting from step 0", flush=True)
    return ckpt


def _write_config(cfg: TrainConfig, out: Path, world: _World) -> None:
    """``OUT/config.json``, once the run has started for good (built and resumed): a start
    that fails before, on a user's error, leaves the folder as it found it."""
    if world.rank == 0:
        text = json.dumps({**cfg.to_dict(), "world_size": world.size}, indent=2) + "\n"
        write_whole(out / "config.json", lambda partial: partial.write_text(text))


def _build_data(
    cfg: TrainConfig, corpus: Corpus, mesh: JobMesh
) -> tuple[BatchSampler, list[Batch], list[Batch] | None]:
    """This rank's training batches, its fixed validation batches and, for a VLM, its held-out
    digits: its data rank's slice (tensor-parallel peers read the same sequences). All depend
    on the world size only through the slice, so a resumed run sees the same data at any world
    size and mesh."""
    if cfg.vlm:
        digits, held_out = load_digits()
        mixed = ImageTextSampler(
            corpus.train,
            digits,
            cfg.image_format(),
            seq_len=cfg.tokens_per_seq,
            global_batch=cfg.batch_size,
            seed=cfg.seed,
            rank=mesh.data_rank,
            world_size=mesh.data_ranks,
            image_fraction=cfg.image_fraction,
        )
        val = mixed.mixed_eval_batches(corpus.val, held_out, cfg.eval_batches)
        return mixed, val, mixed.accuracy_batches(held_out)
    sampler = BatchSampler(
        corpus.train,
        seq_len=cfg.tokens_per_seq,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        rank=mesh.data_rank,
        world_size=mesh.data_ranks,
    )
    val_batches = eval_batches(
        corpus.val,
        cfg.eval_batches,
        seq_len=cfg.tokens_per_seq,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        rank=mesh.data_rank,
        world_size=mesh.data_ranks,
    )
    return sampler, list(val_batches), None


def _resume(
    ckpt: str,
    cfg: TrainConfig,
    mesh: JobMesh,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: BatchSampler,
) -> int:
    """Load ``ckpt`` into the model, the optimizer and the sampler; the step to continue from.
    Says so on rank 0, with what the options changed (:func:`_resume_notes`)."""
    meta = load_checkpoint(ckpt, model=model, optimizer=optimizer, mesh=mesh.describe())
    sampler.load_state_dict(meta["data"])
    start_step: int = meta["step"]
    if mesh.rank == 0:
        notes = "".join(f"; {note}" for note in _resume_notes(meta["config"], cfg))
        saved = f"{meta['world_size']} rank(s){_mesh_words(meta.get('mesh'))}"
        print(
            f"resumed from {ckpt} (step {start_step}, saved on {saved}, now "
            f"{mesh.world}{_mesh_words(mesh.describe())}){notes}",
            flush=True,
        )
    return start_step


def _mesh_words(mesh: dict[str, int] | None) -> str:
    """`` (dp=2 x tp=2)`` for a mesh with tensor or expert parallelism, else nothing."""
    if not mesh or set(mesh) == {"dp"}:
        return ""
    return f" ({degrees_text(mesh)})"


def _resume_notes(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """What resuming a checkpoint saved with the options ``saved`` under ``cfg`` changes: the
    data order (seed, batch, sequence), or the error-feedback residuals it holds, dropped."""
    changed = [k for k in ("seed", "batch_size", "seq_len") if saved.get(k) != getattr(cfg, k)]
    notes = [f"changed {', '.join(changed)}: the data order differs"] if changed else []
    if saved.get("error_feedback") and not cfg.error_feedback:
        notes.append(
            "saved with --error-feedback, resumed without: its error-feedback residuals are dropped"
        )
    return notes


def _banner(
    cfg: TrainConfig,
    params: list[torch.Tensor],
    mesh: JobMesh,
    backend: str,
    padding_ratio: float,
    corpus: Corpus,
) -> str:
    """The run's first console line: what is trained, where, on what."""
    where = backend if not mesh.parallel else f"{backend}, {mesh}"
    held = " in this rank's stages" if mesh.pp > 1 else ""  # a pipeline's rank holds its stages'
    return (
        f"{cfg.model_name}: {sum(p.numel() for p in params):,} parameters{held}, "
        f"{mesh.world} rank(s) ({where}), optimizer {cfg.optimizer}, block {cfg.block_size}, "
        f"padding {100 * padding_ratio:.3f}%, corpus {corpus.source} "
        f"({corpus.train.numel():,} train tokens)"
    )


def _run_step(run: _Run, step: int) -> None:
    """Step ``step`` (0-based) of the loop: the injected crash, if any, the optimizer step
    under the watchdog, its metrics, then the evaluation and checkpoint that fall due."""
    cfg = run.cfg
    done = step + 1  # steps completed after this one
    if cfg.fault == Fault(FaultKind.KILL_AT_STEP, done) and run.world.rank == run.crash_rank:
        health.crash_once(run.faults / f"step_{done}")
    with run.watchdog.step(done):
        result = train_step(
            run.model,
            run.optimizer,
            run.params,
            run.sampler,
            step=step,
            cfg=cfg,
            device=run.device,
            log=run.monitor.print,
            pipeline=run.pipeline,
        )
    stats = run.model.stats()
    run.monitor.step(
        done,
        loss=result.loss,
        lr=result.lr,
        grad_norm=result.grad_norm,
        times=result.times(stats["comm_wait_seconds"]),
        stats=stats,
        optimizer_bytes=optimizer_bytes(run.optimizer),
        skipped=result.skipped,
        pipeline_s=(run.pipeline.span_s, run.pipeline.busy_s) if run.pipeline else None,
    )
    run.count_skip(done, result.skipped)
    if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
        run.evaluate(done)
    due = (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps
    if due:
        run.save(done)
    if run.preemption.requested(run.device):
        _stop_for_preemption(run, done, saved=bool(due))


def _stop_for_preemption(run: _Run, done: int, *, saved: bool) -> None:
    """Every rank got to the end of step ``done`` after a SIGTERM somewhere: save it (unless
    that step's checkpoint was just saved), say so in one line, and stop."""
    if not saved:
        run.save(done)
    run.monitor.print(
        f"preempted (SIGTERM): checkpoint of step {done} saved "
        f"{run.preemption.seconds_since_signal():.1f} s after the signal; --resume, or the "
        f"agent's restart, continues from it (exit status {PREEMPTED_EXIT_CODE})"
    )
    raise Preempted(done)


def _train_loop(run: _Run, start_step: int) -> None:
    """Steps ``start_step..cfg.steps-1``; a fresh run first evaluates, to show where the loss
    starts (a resumed one already logged that)."""
    if start_step == 0:
        run.evaluate(0)
    for step in range(start_step, run.cfg.steps):
        _run_step(run, step)


# ---------------------------------------------------------------------------------------------
# The job.


def build_parser() -> argparse.ArgumentParser:
    """The worker's options: every TrainConfig field, ``--config`` and ``--debug``."""
    parser = argparse.ArgumentParser(
        prog="raggedfsdp.train",
        description="Train a GPT or a Hugging Face causal LM with raggedfsdp (one worker).",
    )
    add_config_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


# Reproducibility: every rank builds the same model from ``--seed``, and the global batch of step
# ``k`` depends only on ``(seed, k)``, so a run resumed from a checkpoint - at the same or another
# world size - sees the same batches as an uninterrupted one (at the same world size the result is
# bit for bit the same).
#
# Errors: a user error (bad option, missing data, incompatible checkpoint, ...) is a ``ValueError``;
# every rank meets it alike, so rank 0 reports it, in one line, and exits with status 2 (``--debug``
# shows the traceback); another rank reports only an error rank 0 did not have. Any other failure (a
# full disk, a lost peer, a bug) is one line per rank naming the cause, status 1, its traceback in
# ``OUT/logs/rank_N.log`` and the line in torchrun's error file, for the launcher
# (:mod:`.failures`).
def train(cfg: TrainConfig) -> None:
    """Run the job described by ``cfg`` on the process group that torchrun set up (or on one
    process without torchrun). Reads top to bottom in the job's order (set-up here, the rest in
    :func:`_run_job`); each section is one or two helpers, which the rest of the module
    defines."""
    started = time.perf_counter()

    # -- set-up ----------------------------------------------------------------------------------
    world = _World.from_env()
    mesh = job_mesh(cfg, world.size, world.rank)
    if cfg.dry_run:
        if world.rank == 0:
            print(dry_run_report(cfg, world.size))
        return
    health.die_with_agent()
    # From here a SIGTERM ends the job after a checkpoint (before here, at once).
    preemption = Preemption(cfg.preempt_grace_s, rank=world.rank)
    # Start-up is watched too: a peer that never arrives must end the job, not hang it.
    watchdog = health.StepWatchdog(
        cfg.step_timeout_s, rank=world.rank, startup_timeout_s=cfg.startup_timeout_s
    )
    try:
        _run_job(cfg, world, mesh, preemption, watchdog, started=started)
    finally:  # a caller that goes on after an error keeps neither the watchdog nor our handler
        watchdog.close()
        preemption.close()


def _run_job(
    cfg: TrainConfig,
    world: _World,
    mesh: JobMesh,
    preemption: Preemption,
    watchdog: health.StepWatchdog,
    *,
    started: float,
) -> None:
    """:func:`train` from the process group to the end, under its watchdog and preemption."""
    device, backend, world = _init_distributed(cfg, world, watchdog)

    # -- output folder and resume point ----------------------------------------------------------
    out = Path(cfg.out)
    ckpt = _open_out_dir(cfg, out, world)

    # -- data ------------------------------------------------------------------------------------
    corpus = load_corpus(cfg.data, seed=cfg.seed)
    sampler, val_batches, accuracy_batches = _build_data(cfg, corpus, mesh)

    # -- model (under --pp: this rank's stages, as one model, and their schedule) -----------------
    pipeline = build_pipeline(cfg, device, mesh) if mesh.pp > 1 else None
    model = pipeline.model if pipeline else build_model(cfg, device, mesh)
    stats = model.stats()
    padding_ratio = stats["padding_numel"] / max(1, stats["param_numel"])

    # -- optimizer -------------------------------------------------------------------------------
    optimizer = build_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    meter = LoRAMeter(model, optimizer) if cfg.lora_rank is not None else None

    # -- resume ----------------------------------------------------------------------------------
    start_step = 0 if ckpt is None else _resume(ckpt, cfg, mesh, model, optimizer, sampler)
    _write_config(cfg, out, world)

    # -- monitoring and health -------------------------------------------------------------------
    monitor = Monitor(
        cfg, rank=world.rank, world_size=world.size, start_step=start_step,
        padding_ratio=padding_ratio, device=device,
        stages=pipeline.indices if pipeline else None,
    )  # fmt: skip
    monitor.print(_banner(cfg, params, mesh, backend, padding_ratio, corpus))
    parts = (model, optimizer, params, sampler, val_batches, monitor, watchdog, preemption)
    run = _Run(cfg, world, mesh, device, out, *parts, accuracy_batches, pipeline)

    # -- training loop ---------------------------------------------------------------------------
    _train_loop(run, start_step)
    if meter is not None:
        meter.report(cfg, monitor, cfg.steps)

    # -- the end (train() closes the watchdog and the SIGTERM handler) ----------------------------
    monitor.close(wall_s=time.perf_counter() - started)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and train; the exit status (:mod:`.failures`: user errors are one
    line and status 2)."""
    args = build_parser().parse_args(argv)
    out: str | None = None
    try:
        cfg = config_from_args(args)
        out = cfg.out
        train(cfg)
    except Preempted:
        return PREEMPTED_EXIT_CODE  # rank 0 has said so; the checkpoint is complete
    except (ValueError, health.NonFiniteLossError) as err:
        if args.debug:
            raise
        return report_error(err)
    # The machine's fault (disk, files, a lost peer) or a bug. DCP's CheckpointException is a
    # BaseException, not an Exception.
    except (Exception, dcp.CheckpointException) as err:
        if args.debug:
            raise
        return report_failure(err, out)
    return 0
