"""The training job's configuration: one keyword-only dataclass, a TOML file, and CLI overrides.

Precedence is ``TrainConfig`` defaults < ``--config FILE`` (TOML) < command-line options. The
command-line flags are generated from the fields: ``batch_size`` is ``--batch-size``, a boolean
``resume`` is ``--resume`` / ``--no-resume``, and each field's docstring is its ``--help`` text.
A TOML file uses the field names as keys (``batch_size = 32``; dashes are accepted too). An
unknown key or a value of the wrong type is a ``ValueError`` naming the key, and so is an invalid
value (checked in ``__post_init__``, so ``dataclasses.replace`` checks too).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import math
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..capacity.wire import CODE_DTYPES
from ..digits import ImageFormat, check_installed
from ..facts import PPSchedule, default_microbatches
from ..layout import BlockSize, parse_block_size
from ..models import GPT_CONFIGS, hf
from ..planner import OptimizerType
from ..runtime import CommCompression
from .faults import Fault
from .lora_options import check_lora_options
from .mesh import JobMesh
from .pipeline_options import check_pipeline_options

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; pyproject.toml pulls in tomli there
    import tomli as tomllib

__all__ = [
    "TrainConfig",
    "add_config_arguments",
    "config_from_args",
    "load_toml",
    "train_argv",
]

_DEFAULT_MODEL = "gpt-small"
_BOTH_MODELS = "model: --model and --hf-config choose the model two ways; give only one"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run needs; the same on every rank."""

    model: str = field(default=_DEFAULT_MODEL, metadata={"metavar": "NAME"})
    """Model shape, one of the GPT_CONFIGS (gpt-tiny, gpt-small, gpt-medium, gpt-ref)."""

    hf_config: str | None = field(default=None, metadata={"metavar": "PATH|NAME"})
    """Train a Hugging Face causal LM or vision-language model instead of --model (not both): any
    causal-LM architecture of transformers, or LLaVA, Qwen2-VL or Qwen2.5-VL, from a config.json
    (or a folder holding one) or a built-in tiny config (tiny-llama, tiny-llama-tied,
    tiny-mixtral, tiny-qwen2-moe, tiny-llava, tiny-qwen2-vl), with random weights, never
    downloaded; each decoder layer (and vision block) is a unit. Its vocab_size becomes 256, the
    byte-level data's token ids (special-token ids above 255 are dropped; a VLM's image tokens
    follow the bytes); --seq-len defaults to its max_position_embeddings, at most 1024. Needs pip
    install 'raggedfsdp[hf]' (a VLM: 'raggedfsdp[vlm]', for scikit-learn's digits)."""

    image_fraction: float = 0.5
    """With a vision-language --hf-config: the share of samples that are an image of a
    handwritten digit and its text ("<image> this is the digit 7"); the others are text of the
    corpus. In [0, 1]."""

    image_size: int | None = None
    """With a vision-language --hf-config: the side in pixels of the images (the 8x8 digits
    upscaled); default: the vision tower's own."""

    tp: int = 1
    """Tensor-parallel degree: split every block's projections, the embedding and the head over
    groups of this many consecutive ranks (a GPT or a Llama-style --hf-config), FSDP over the
    world / tp data-parallel ranks; it must divide the heads, hidden units and vocabulary. With
    --optimizer adamw or muon (docs/training.md)."""

    ep: int = 1
    """Expert-parallel degree for a mixture of experts (--hf-config tiny-mixtral, ...): each
    rank holds experts / ep of every layer's experts, tokens travel to them and back by
    all-to-all; ep borrows its ranks from data parallelism (every rank reads its own sequences).
    Not with --tp; with --optimizer adamw or muon."""

    pp: int = 1
    """Pipeline stages: the layers cut into this many (2 per rank for the interleaved
    schedules), the embedding with the first, norm and head with the last, each sharded over
    world / pp ranks (--tp within); a GPT or a Llama-style --hf-config. Not with --ep."""

    pp_schedule: PPSchedule = "1f1b"
    """With --pp: torch's schedule (interleaved-1f1b and zero-bubble: 2 stages per rank)."""

    microbatches: int | None = None
    """With --pp: micro-batches per step (1f1b: at least --pp); default: one per stage."""

    compile: bool = False
    """torch.compile each block (GPT block or decoder layer) before sharding it; the FSDP hooks
    around it stay eager."""

    data: str | None = field(default=None, metadata={"metavar": "PATH"})
    """Text corpus: a file or a folder (every text file below it); default: the Python standard
    library's sources, which every machine has."""

    out: str = field(default="runs/train", metadata={"metavar": "DIR"})
    """Output folder: metrics.jsonl, report.png, config.json, checkpoints/."""

    steps: int = 400
    """Optimizer steps to train in total (a resumed run continues up to this count)."""

    batch_size: int = 16
    """Global batch in sequences per optimizer step, split evenly across ranks and micro-batches
    (it must divide by world size x grad_accum)."""

    seq_len: int | None = None
    """Tokens per sequence; default: the model's seq_len."""

    grad_accum: int = 1
    """Micro-batches per step; gradients are reduced only on the last one (no_sync)."""

    lr: float = 3e-3
    """Peak learning rate (for Muon: of the auxiliary AdamW on embeddings and norms)."""

    muon_lr: float = 0.02
    """Peak learning rate of Muon's matrices (only with --optimizer muon)."""

    warmup_steps: int = 40
    """Linear warm-up steps from 0 to the peak learning rate; then cosine decay."""

    min_lr_ratio: float = 0.1
    """Learning rate at the end of the cosine decay, as a fraction of the peak."""

    weight_decay: float = 0.1
    """Decoupled weight decay of matrices and embeddings (norms and other vectors get none)."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    optimizer: OptimizerType = "adamw"
    """Optimizer; the shard planner keeps its blocks whole (optimizer_type)."""

    max_preconditioner_dim: int = 128
    """Shampoo's block side in rows (only with --optimizer shampoo)."""

    block_size: str = field(default="none", metadata={"metavar": "SIZE"})
    """RaggedShard block: none (element), ROWS (e.g. 32), ROWSxCOLS (e.g. 128x128) or whole."""

    mixed_precision: Literal["none", "bf16"] = "none"
    """bf16: compute and all-gather in bfloat16, reduce gradients and keep masters in fp32."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""

    compress_all_gather: Literal["none", "fp8", "int8"] = "none"
    """Quantize the parameters' all-gather to fp8 (e4m3) or int8 codes plus one fp32 scale per
    block of the shard policy (docs/compression.md); masters and optimizer stay fp32."""

    compress_reduce_scatter: Literal["none", "int8", "fp8", "fp8_e5m2"] = "none"
    """Quantize the gradients' reduce-scatter (an all-to-all of codes and scales; each shard's
    owner sums the ranks' contributions in fp32)."""

    error_feedback: bool = False
    """Keep what quantizing each gradient dropped and add it to the next (needs
    --compress-reduce-scatter)."""

    # -- LoRA / QLoRA fine-tuning (checked by .lora_options) --------------------------------------
    lora_rank: int | None = field(default=None, metadata={"metavar": "R"})
    """Train LoRA adapters (A: R x in, B: out x R, zero) beside every linear of the blocks, the
    model frozen (docs/lora.md); with adamw, not with --tp / --ep."""

    base_weights: Literal["nf4"] | None = None
    """With --lora-rank: keep the blocks' frozen linears in NF4 (QLoRA), gathered as codes."""

    nf4_block_size: int = 64
    """Elements per NF4 scale; it must divide every linear's in-features."""

    seed: int = 0
    """Seed of the model initialisation and of the data order (which depends only on seed and
    step, so a run resumed at another world size sees the same batches)."""

    dry_run: bool = False
    """Build the model on the meta device, plan the shards, print the plan and the estimated
    memory per rank, and exit without training."""

    force: bool = False
    """Start even when the memory preflight predicts that a rank will not fit in its device's
    free memory (or its share of the available RAM on CPU)."""

    resume: bool = False
    """Continue from the newest complete checkpoint in --out that verifies (its files have the
    sizes and checksums its COMPLETE.json recorded), naming any newer one skipped and why;
    starts fresh if there is none."""

    strict_resume: bool = False
    """When resuming, refuse (exit status 2, naming the checkpoint and the damaged file) if the
    newest checkpoint does not verify, instead of falling back to an older one."""

    overwrite: bool = False
    """Delete the outputs of an earlier run in --out before starting."""

    checkpoint_every: int = 100
    """Save a checkpoint every N steps (and always at the end); 0: only at the end."""

    log_every: int = 10
    """Write a log line and a metrics.jsonl record every N steps."""

    eval_every: int = 100
    """Compute the validation loss every N steps (and at the end); 0: only at the end."""

    eval_batches: int = 4
    """Global batches in each validation loss."""

    tensorboard: bool = False
    """Also write TensorBoard events to OUT/tensorboard."""

    comm_timeout_s: float = 300.0
    """Timeout of every collective (process-group timeout), in seconds."""

    step_timeout_s: float = 900.0
    """Abort the job when one step takes longer than this (a hang), in seconds; 0 disables."""

    startup_timeout_s: float = 600.0
    """Abort a worker whose start-up (meeting its peers, building the model, loading the
    checkpoint, up to its first step) takes longer than this, in seconds; also the agents'
    rendezvous timeout (torchrun's join_timeout). 0 disables the worker's watchdog."""

    on_nan: Literal["skip", "stop"] = "stop"
    """A NaN/Inf loss or gradient norm on any rank: skip that step on every rank, or stop."""

    preempt_grace_s: float = 25.0
    """Seconds from SIGTERM to the end of the job: every rank finishes its step, the job saves
    a checkpoint and exits with status 143; a save not done by then is abandoned (the previous
    checkpoint stays). Keep it below the scheduler's grace period (Slurm KillWait, Kubernetes
    terminationGracePeriodSeconds)."""

    max_consecutive_skips: int = 10
    """With --on-nan skip: give up (exit status 1) after this many skipped steps in a row."""

    max_skipped_steps: int = 100
    """With --on-nan skip: give up (exit status 1) after this many skipped steps in one launch."""

    inject_fault: str | None = field(default=None, metadata={"metavar": "KIND=STEP"})
    """Rehearse recovery from a lost worker (docs/operations.md): kill-at-step=N kills rank 1
    (rank 0 when alone) with SIGKILL at the start of step N; kill-during-save=N kills the last
    rank while the checkpoint of step N is written (after its files, before it is complete).
    Once per run: a marker in OUT/.faults keeps the worker that --max-restarts or --resume
    starts in its place alive."""

    def __post_init__(self) -> None:
        if self.model not in GPT_CONFIGS:
            raise ValueError(
                f"model: unknown model {self.model!r}; choose one of {', '.join(GPT_CONFIGS)}"
            )
        if self.hf_config is not None and self.model != _DEFAULT_MODEL:
            raise ValueError(_BOTH_MODELS)
        model_seq = self.model_seq_len  # with --hf-config: loads (and so checks) its config
        if self.seq_len is not None and not 1 <= self.seq_len <= model_seq:
            raise ValueError(
                f"seq_len: must be in [1, {model_seq}] (the seq_len of {self.model_name}), "
                f"got {self.seq_len}"
            )
        self._check_numbers()
        self._check_images()
        if not self.out:
            raise ValueError("out: the output folder must not be empty")
        try:
            self.parsed_block_size()
        except ValueError as err:
            raise ValueError(f"block_size: {err}") from None
        try:
            compression = self.comm_compression()
        except ValueError as err:
            raise ValueError(f"error_feedback: {err}") from None
        if self.inject_fault is not None:
            Fault.parse(self.inject_fault)
        self._check_parallel()
        check_pipeline_options(self)
        check_lora_options(self, compressed=compression is not None)

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches per step: ``--microbatches`` under ``--pp``, else ``--grad-accum``."""
        if self.pp == 1:
            return self.grad_accum
        return self.microbatches or default_microbatches(self.pp, self.pp_schedule)

    def _check_parallel(self) -> None:
        """``--tp`` / ``--ep``: degrees of at least 1, one of the two, and an optimizer that
        takes split matrices (Shampoo's blocks and AdamW8bit's tiles would need the whole)."""
        for name in ("tp", "ep", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.tp > 1 and self.ep > 1:
            raise ValueError(
                f"tp: --tp {self.tp} with --ep {self.ep}: the job runs tensor or expert "
                f"parallelism beside FSDP, not both at once; choose one"
            )
        degree = max(self.tp, self.ep)
        flag = "tp" if self.tp > 1 else "ep"
        if degree > 1 and self.compile:
            # Measured (torch 2.13): dynamo fails on the tensor-parallel DTensors inside a
            # raggedfsdp unit ("set the storage of a tensor on device cpu to ... meta").
            raise ValueError(
                f"compile: --compile with --{flag} {degree} is not supported yet (torch.compile "
                f"fails on the split blocks); train them eager"
            )
        if degree > 1 and self.optimizer not in ("adamw", "muon"):
            raise ValueError(
                f"optimizer: {self.optimizer} keeps whole matrices or blocks, which --{flag} "
                f"{degree} splits over ranks; use --optimizer adamw or muon"
            )

    def _check_images(self) -> None:
        """``--image-fraction`` in [0, 1]; ``--image-size`` only for a VLM, one that fits its
        tower; a sequence that holds an image-text sample."""
        if not 0.0 <= self.image_fraction <= 1.0:
            raise ValueError(f"image_fraction: must be in [0, 1], got {self.image_fraction}")
        if self.vlm:
            check_installed()
            self.image_format().check_fits(self.tokens_per_seq)
        elif self.image_size is not None:
            raise ValueError(
                f"image_size: {self.model_name} is not a vision-language model; it takes no image"
            )

    @property
    def vlm(self) -> bool:
        """Whether the model is a vision-language model (trained on images and text)."""
        return self.hf_config is not None and hf.is_vlm(hf.hf_config(self.hf_config))

    def image_format(self) -> ImageFormat:
        """How the VLM takes one image (:func:`raggedfsdp.models.hf.image_format`)."""
        assert self.hf_config is not None
        return hf.image_format(self.hf_config, self.image_size)

    def _check_numbers(self) -> None:
        """Every count, rate, timeout and ratio in its range (``ValueError`` naming it)."""
        positive = (
            "steps",
            "batch_size",
            "grad_accum",
            "log_every",
            "eval_batches",
            "max_consecutive_skips",
            "max_skipped_steps",
        )
        non_negative = ("warmup_steps", "checkpoint_every", "eval_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "muon_lr", "comm_timeout_s", "preempt_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "step_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        # Timeouts become timedeltas and sleeps in the workers: infinity overflows there.
        for name in ("comm_timeout_s", "step_timeout_s", "startup_timeout_s", "preempt_grace_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(
                    f"{name}: must be a finite number of seconds, got {getattr(self, name)}"
                )
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: must be in [0, 2**63), got {self.seed}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_preconditioner_dim < 1:
            raise ValueError(
                f"max_preconditioner_dim: must be >= 1, got {self.max_preconditioner_dim}"
            )

    @property
    def model_name(self) -> str:
        """What is trained, for messages: ``hf_config`` or ``model``."""
        return self.hf_config if self.hf_config is not None else self.model

    @property
    def model_seq_len(self) -> int:
        """The longest sequence the model takes (:func:`raggedfsdp.models.hf.hf_seq_len` for
        an HF model)."""
        if self.hf_config is not None:
            return hf.hf_seq_len(self.hf_config)
        return GPT_CONFIGS[self.model].seq_len

    @property
    def tokens_per_seq(self) -> int:
        """The sequence length actually used (``seq_len`` or the model's)."""
        return self.seq_len or self.model_seq_len

    def parsed_block_size(self) -> BlockSize:
        """``block_size`` as a :data:`raggedfsdp.layout.BlockSize`."""
        return parse_block_size(self.block_size)

    @property
    def fault(self) -> Fault | None:
        """``inject_fault`` as a :class:`Fault` (``None``: none)."""
        return None if self.inject_fault is None else Fault.parse(self.inject_fault)

    def comm_compression(self) -> CommCompression | None:
        """The compression options as a :class:`raggedfsdp.CommCompression` (``None``: off)."""
        compression = CommCompression(
            all_gather=CODE_DTYPES[self.compress_all_gather],
            reduce_scatter=CODE_DTYPES[self.compress_reduce_scatter],
            error_feedback=self.error_feedback,
        )
        return compression if compression.enabled else None

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``pp x tp x ep`` divides the world and the batch splits
        evenly over the data ranks (``world / (tp x pp)``: tensor-parallel peers and a
        pipeline's stages share their sequences) and micro-batches."""
        data_ranks = JobMesh(world_size, tp=self.tp, ep=self.ep, pp=self.pp).data_ranks
        micro = self.pipeline_microbatches
        split = data_ranks * micro
        if self.batch_size % split:
            shared = self.tp > 1 or self.pp > 1
            ranks = f"{data_ranks} data rank(s)" if shared else f"{world_size} rank(s)"
            raise ValueError(
                f"batch_size: the global batch of {self.batch_size} sequences does not divide "
                f"into {ranks} x {micro} micro-batch(es); use a multiple of {split}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON and TOML friendly), one per field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# ---------------------------------------------------------------------------------------------
# Field types and docs, read once from the class.


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (attribute docstrings live only in the source,
    so they are read with ``ast``; without the source the help is just empty)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


_HINTS = typing.get_type_hints(TrainConfig)
_DOCS = _field_docs(TrainConfig)
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _base_type(hint: Any) -> tuple[Any, bool]:
    """``(type, optional)``: ``int | None`` -> ``(int, True)``; ``Literal[...]`` stays."""
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def _describe(base: Any, optional: bool) -> str:
    if typing.get_origin(base) is Literal:
        text = "one of " + ", ".join(repr(c) for c in typing.get_args(base))
    else:
        text = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[base]
    return text + (" (or absent)" if optional else "")


def _coerce(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type, or ``ValueError`` naming the key."""
    base, optional = _base_type(_HINTS[name])
    ok: bool
    if typing.get_origin(base) is Literal:
        ok = value in typing.get_args(base)
    elif base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, base)
    if not ok:
        got = f"{type(value).__name__} {value!r}"
        raise ValueError(f"key {name!r} must be {_describe(base, optional)}, got {got}")
    return value


def _read_toml(file: Path) -> dict[str, Any]:
    """The TOML document in ``file``; ``ValueError`` naming the file when it cannot be read,
    is not UTF-8 (as TOML must be) or is not TOML."""
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"config file {str(file)!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"config file {str(file)!r} is not UTF-8 text, as TOML must be (byte "
            f"{err.object[err.start]:#04x} at offset {err.start})"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {str(file)!r} is not valid TOML: {err}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """The fields set by a TOML config file; ``ValueError`` naming the file and an unknown,
    mistyped or repeated key (``batch_size`` and ``batch-size`` set one field: TOML itself
    would let the later win in silence)."""
    file = Path(path)
    raw = _read_toml(file)
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}  # field -> the key that set it
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise ValueError(f"config file {str(file)!r}: unknown key {key!r}")
        if name in keys:
            raise ValueError(
                f"config file {str(file)!r}: keys {keys[name]!r} and {key!r} both set {name}; "
                f"keep one"
            )
        keys[name] = key
        try:
            values[name] = _coerce(name, value)
        except ValueError as err:
            raise ValueError(f"config file {str(file)!r}: {err}") from None
    return values


# ---------------------------------------------------------------------------------------------
# Command line.


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and one option per :class:`TrainConfig` field. Options not given
    stay absent from the namespace (``SUPPRESS``), so a config file's values are not reset."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file of options (command-line options override it)"
    )
    defaults = TrainConfig()
    for name, f in _FIELDS.items():
        base, _ = _base_type(_HINTS[name])
        default = getattr(defaults, name)
        help_text = _DOCS.get(name, "") + ("" if default is None else f" (default: {default})")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(base) is Literal:
            parser.add_argument(_flag(name), choices=typing.get_args(base), **kwargs)
        else:
            metavar = f.metadata.get("metavar") or {int: "N", float: "X"}.get(base, "VALUE")
            parser.add_argument(_flag(name), type=base, metavar=metavar, **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the options given on the command line."""
    values = load_toml(args.config) if getattr(args, "config", None) else {}
    values.update({name: getattr(args, name) for name in _FIELDS if hasattr(args, name)})
    # Given at all, even as the default's name: the two options must not both be set.
    if "model" in values and values.get("hf_config") is not None:
        raise ValueError(_BOTH_MODELS)
    return TrainConfig(**values)


def train_argv(args: argparse.Namespace) -> list[str]:
    """The command-line options given in ``args`` (``--config`` and explicit overrides), as
    argv again, so that a launcher can hand the same options to ``raggedfsdp.train``."""
    argv = ["--config", str(Path(args.config).resolve())] if getattr(args, "config", None) else []
    for name in _FIELDS:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        else:
            argv += [_flag(name), str(value)]
    return argv
