"""torchtitan's debug models, 10 steps and a resume, with raggedfsdp and with FSDP2, on CPU.

    pip install -e '.[torchtitan]'          # torchtitan 0.3 (and triton, which it imports)
    python experiments/torchtitan_debug_models.py --tokenizer DIR --out DIR \
        [--model llama3|deepseek_v3] [--nproc N] [--pp N] [--ep N] \
        [--param-dtype bfloat16] [--norm-from-full-gradients] \
        [--write-docs docs/results/frameworks.md]

``--tokenizer`` is torchtitan's test tokenizer, ``tests/assets/tokenizer`` of its repository
(the debug models' 2,048-token vocabulary). ``--model`` picks torchtitan's config:
``llama3_debugmodel`` (the default) or ``deepseek_v3_debugmodel``, its MoE debug model (8 routed
experts, top 3, and 2 shared, in 5 of 6 layers). ``--pp`` and ``--ep`` are torchtitan's
``parallelism.pipeline_parallel_degree`` and ``expert_parallel_degree``; the data-parallel
shard degree is the rest of ``--nproc`` (torchtitan's -1), and expert parallelism borrows its
ranks from it. So ``--nproc 4 --pp 2`` is pp 2 x FSDP 2 with llama3's own schedule,
Interleaved1F1B (two stages a rank, 2 micro-batches of 1 sample); ``--ep 2`` (2 ranks) is FSDP
2 for the dense parameters and, for the routed experts, ep 2 over an expert-FSDP mesh of their
own, of 1 rank (torchtitan's ``shard_placement_fn`` returning ``ShardPlacementResult``), and
``--nproc 4 --ep 2`` FSDP 4 and ep 2 x expert-FSDP 2. What the script
does, each step a ``torchrun`` of ``--nproc`` Gloo ranks (2 by default) running torchtitan's own
``Trainer`` (the chosen config, with the CPU settings below):

1. a seed checkpoint, made by torchtitan on one process (``--checkpoint.create_seed_checkpoint``,
   no pipeline or expert parallelism), so that both implementations start from the same weights;
2. for FSDP2 and for raggedfsdp: 10 steps from the seed, checkpointing at step 5 and 10;
3. for each: a resume from its step-5 checkpoint (model, optimizer, lr scheduler, data loader)
   to step 10;

then prints the loss table (Markdown) and writes it, with every loss and gradient norm (and that
norm in fp64, from the gathered gradients; recording it changes no number), to
``OUT/losses.json``; the docs section (``--write-docs``) is named for the model, the degrees and
the ranks, ``torchtitan_llama3_debug_pp2_4ranks`` for instance. ``--norm-from-full-gradients``
is for diagnosis: gradients are clipped by the fp32 norm of the gathered full gradients, one
computation for both implementations, instead of torchtitan's norm of each rank's pieces, which
rounds differently for different shards (docs/results/frameworks.md, "bf16"). Under pipeline
parallelism both norms are summed over the stages as torchtitan sums its own. Otherwise the
only change to torchtitan is the name ``fully_shard`` in ``torchtitan.distributed.fsdp``, the
module whose ``apply_fsdp_to_decoder`` every model's ``parallelize`` calls: ``rf.fully_shard`` in
its place (docs/migrating-from-fsdp2.md, "Frameworks").

What torchtitan 0.3 on torch 2.13 needs on a machine without an accelerator, FSDP2 as much as
raggedfsdp, applied here in the worker and nowhere else:

- ``parallelism.spmd_backend="partial_dtensor"``: under the default ``"spmd_types"`` torchtitan
  passes ``fully_shard`` torch 2.13's ``dp_mesh_dims`` (the data-parallel axes of a full-SPMD
  mesh); here FSDP2 then refuses the model ("When dp_mesh_dims is provided, all parameters
  must be DTensors on the full SPMD mesh ... Got plain tensor for parameter 'weight'") and
  ``rf.fully_shard`` has no such argument (``TypeError``);
- its device is ``_get_available_device_type() or "cuda"``: the worker makes it ``"cpu"``, with
  ``torch.cpu`` plus the memory-statistics functions its memory monitor calls (zeros);
- flex attention (the debug model's; ``sdpa`` is refused for language models in 0.3) is
  compiled for an accelerator at import, and has no backward on a CPU in torch 2.13 ("FlexAttention
  does not support backward on CPU"): the worker builds its block masks eagerly and computes the
  attention with ``scaled_dot_product_attention`` under the same mask made dense (causal within
  each packed document);
- torchtitan turns FSDP's gradient division off (``set_gradient_divide_factor(1.0)``, the loss
  is divided by the global token count), which FSDP2 reduces with NCCL's ``PREMUL_SUM``: Gloo
  has none ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so the worker also sets
  ``set_force_sum_reduction_for_comms(True)`` on every unit (raggedfsdp takes it; same numbers);
- ``torch.distributed.set_timeout``, which torchtitan 0.3 calls after the first step, is not in
  torch 2.13 (a later torch's): the worker binds it to 2.13's ``_set_pg_timeout``;
- under pipeline parallelism torchtitan 0.3 steps the schedule with micro-batches it split
  itself (``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, a later torch's
  signature); torch 2.13's ``step`` splits a whole batch, so it takes the lists for one
  micro-batch ("Expecting 2 arg_mbs but got 1"): the worker routes such calls to 2.13's
  ``_step_microbatches``, after the per-step set-up its ``step`` does;
- ``training.disable_cuda_graphs``, ``mixed_precision_param="float32"`` unless
  ``--param-dtype bfloat16`` (torchtitan's default; bf16 matmuls on a CPU are slow), validation
  off (it reads c4 from the Hugging Face hub);
- data: torchtitan's ``c4_test`` is not in its wheel; the driver writes a JSON-lines dataset of
  Python standard-library modules to ``OUT/data`` and the worker registers it as
  ``local_text`` for torchtitan's own ``HuggingFaceTextDataLoader``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs

from generated_docs import write_section

STEPS = 10
RESUME_FROM = 5
IMPLS = ("fsdp2", "rf")
PARAM_DTYPES = ("float32", "bfloat16")
# --model: torchtitan's debug configs, by module and function
MODELS = {
    "llama3": ("torchtitan.models.llama3.config_registry", "llama3_debugmodel"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3.config_registry", "deepseek_v3_debugmodel"),
}


# -- the driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer", type=Path, required=True, help="torchtitan's tests/assets/tokenizer"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="a folder for checkpoints and results"
    )
    parser.add_argument(
        "--model", choices=MODELS, default="llama3", help="torchtitan's debug model (llama3)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument(
        "--pp", type=int, default=1, help="parallelism.pipeline_parallel_degree (default 1)"
    )
    parser.add_argument(
        "--ep", type=int, default=1, help="parallelism.expert_parallel_degree (default 1)"
    )
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256)")
    parser.add_argument(
        "--batch", type=int, default=2, help="samples per rank and step (default 2)"
    )
    parser.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="float32",
        help="torchtitan's training.mixed_precision_param (default float32; its own: bfloat16)",
    )
    parser.add_argument(
        "--norm-from-full-gradients",
        action="store_true",
        help="clip by the norm of the gathered gradients (the same for both; a diagnosis)",
    )
    parser.add_argument("--write-docs", type=Path, help="replace the generated section here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--seed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    _write_data(out / "data")
    # torchtitan resumes from the latest checkpoint in a run's folder: every run starts afresh
    for run in ("seed", *IMPLS, *(f"{impl}-resume" for impl in IMPLS)):
        shutil.rmtree(out / run, ignore_errors=True)
    _torchrun(args, 1, "--seed", "--phase", "seed")
    results: dict[str, Any] = {}
    for impl in IMPLS:
        _torchrun(args, args.nproc, "--impl", impl, "--phase", impl)
        resumed = out / f"{impl}-resume" / "checkpoint"
        resumed.mkdir(parents=True)
        step = f"step-{RESUME_FROM}"
        shutil.copytree(out / impl / "checkpoint" / step, resumed / step)
        _torchrun(args, args.nproc, "--impl", impl, "--phase", f"{impl}-resume")
        for run in (impl, f"{impl}-resume"):
            results[run] = json.loads((out / run / "metrics.json").read_text())
    table = _report(results)
    print(table)
    (out / "losses.json").write_text(json.dumps(results, indent=1))
    (out / "losses.md").write_text(table + "\n")
    if args.write_docs:
        script = Path(__file__).stem
        write_section(args.write_docs, _run_name(args), table, script=script, folder="experiments")
    return 0


def _run_name(args: argparse.Namespace) -> str:
    """The name of a run's docs section and results file: ``torchtitan_<model>_debug``, then the
    parallelism degrees above 1, the ranks when not 2, the dtype when bf16 and the diagnosis
    when on."""
    name = f"torchtitan_{args.model}_debug"
    name += f"_pp{args.pp}" if args.pp > 1 else ""
    name += f"_ep{args.ep}" if args.ep > 1 else ""
    name += f"_{args.nproc}ranks" if args.nproc != 2 else ""
    name += "_bf16" if args.param_dtype == "bfloat16" else ""
    return name + ("_full_norm" if args.norm_from_full_gradients else "")


def _torchrun(args: argparse.Namespace, nproc: int, *extra: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        __file__, "--worker", "--tokenizer", str(args.tokenizer.resolve()),
        "--out", str(args.out.resolve()), "--model", args.model,
        "--pp", str(args.pp), "--ep", str(args.ep),
        "--seq-len", str(args.seq_len), "--batch", str(args.batch),
        "--param-dtype", args.param_dtype,
        *(["--norm-from-full-gradients"] if args.norm_from_full_gradients else []), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, env=env)


def _write_data(folder: Path) -> None:
    """A JSON-lines dataset of Python standard-library modules, one document a module."""
    path = folder / "data.json"
    if path.exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with path.open("w") as f:
        for module in sorted(stdlib.glob("*.py"))[:200]:
            f.write(json.dumps({"text": module.read_text(errors="replace")}) + "\n")


def _report(results: dict[str, Any]) -> str:
    """The loss table and, under it, the largest differences, the gradient norms' error and the
    parameters' types."""
    error = {impl: _norm_error(results[impl]) for impl in IMPLS}
    return _table(results) + (
        f"\n\nLargest loss difference, raggedfsdp - FSDP2: {_largest_gap(results, 'loss'):.1e}; "
        f"largest gradient-norm difference: {_largest_gap(results, 'grad_norm'):.1e}; the norms' "
        f"mean relative error against their fp64 value: FSDP2 {error['fsdp2']:.2e}, raggedfsdp "
        f"{error['rf']:.2e}; parameters: {results['fsdp2']['parameter_types']} and "
        f"{results['rf']['parameter_types']}."
    )


def _largest_gap(results: dict[str, Any], metric: str) -> float:
    """The largest difference of ``metric`` (``loss`` or ``grad_norm``) between raggedfsdp's run
    and FSDP2's, over the steps."""
    ours, theirs = results["rf"][metric], results["fsdp2"][metric]
    return max(abs(ours[step] - theirs[step]) for step in ours)


def _norm_error(run: dict[str, Any]) -> float:
    """The mean relative error of a run's clipped gradient norms against their fp64 values."""
    steps = run["grad_norm"]
    return sum(abs(steps[k] / run["grad_norm_fp64"][k] - 1) for k in steps) / len(steps)


def _table(results: dict[str, Any]) -> str:
    """Losses by step: each implementation, their difference, and the resumed runs."""
    loss = {run: {int(k): v for k, v in r["loss"].items()} for run, r in results.items()}
    lines = [
        "| step | FSDP2 | raggedfsdp | rf - FSDP2 | FSDP2 resumed | raggedfsdp resumed "
        "| rf resumed - rf |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for step in range(1, STEPS + 1):
        fsdp2, ours = loss["fsdp2"][step], loss["rf"][step]
        cells = [f"{fsdp2:.6f}", f"{ours:.6f}", f"{ours - fsdp2:+.1e}"]
        if step in loss["rf-resume"]:
            resumed = loss["rf-resume"][step]
            cells += [
                f"{loss['fsdp2-resume'][step]:.6f}",
                f"{resumed:.6f}",
                f"{resumed - ours:+.1e}",
            ]
        else:
            cells += ["", "", ""]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the worker (one torchrun rank) ----------------------------------------------------------------


def _cpu_device_module() -> Any:
    """``torch.cpu`` with what torchtitan's device-memory monitor calls on an accelerator."""
    import types

    import torch

    module = types.ModuleType("torchtitan_cpu_device")
    module.__dict__.update(
        {k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")}
    )
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.current_device = lambda: 0  # torch.cpu's is "cpu", which barrier(device_ids=) refuses
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total)
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    module.memory_stats = lambda device=None: {}
    return module


def _import_torchtitan_on_cpu() -> None:
    """Import torchtitan with ``cpu`` as its device type (see the module docstring)."""
    import torch
    import torch._utils

    available, device_module = (
        torch._utils._get_available_device_type,
        torch._utils._get_device_module,
    )
    cpu = _cpu_device_module()
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: (
        cpu if device_type == "cpu" else device_module(device_type)
    )
    try:
        import torchtitan.trainer  # noqa: F401
    finally:
        torch._utils._get_available_device_type = available
        torch._utils._get_device_module = device_module
    # torchtitan 0.3 calls torch.distributed.set_timeout (after the first step), which torch
    # 2.13 has under its private name
    if not hasattr(torch.distributed, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        torch.distributed.set_timeout = _set_pg_timeout
    _schedules_take_microbatches()
    # flex attention, the debug model's: compiled for an accelerator at import, and without a
    # backward on a CPU at all: its block masks built eagerly, and the attention itself run as
    # SDPA under the same mask, made dense (the same function: causal within each document)
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention._compiled_create_block_mask = create_block_mask
    attention.FlexAttention._compiled_flex_attn = _flex_attention_as_sdpa


def _schedules_take_microbatches() -> None:
    """torchtitan 0.3 steps its pipeline schedule with micro-batches it split itself
    (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)``, a later
    torch's ``step``); torch 2.13's ``step`` takes the whole batch and splits it, and has the
    micro-batch path under its private ``_step_microbatches``. Each schedule class's ``step``
    is wrapped to take that path when handed micro-batches, after the same per-step set-up."""
    import inspect

    from torch.distributed.pipelining import schedules

    def takes_microbatches(step: Any) -> Any:
        def wrapper(
            self: Any,
            *args: Any,
            arg_mbs: list | None = None,
            kwarg_mbs: list | None = None,
            target_mbs: list | None = None,
            losses: list | None = None,
            return_outputs: bool = True,
            loss_kwargs: dict | None = None,
            **kwargs: Any,
        ) -> Any:
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return step(
                    self, *args, losses=losses, return_outputs=return_outputs,
                    loss_kwargs=loss_kwargs, **kwargs,
                )  # fmt: skip
            stages = self._stages if hasattr(self, "_stages") else [self._stage]
            for stage in stages:  # what 2.13's step does before splitting
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
            )
            last = [stage for stage in stages if stage.is_last]
            return self._merge_outputs(last[0].output_chunks) if last and return_outputs else None

        return wrapper

    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" not in inspect.signature(schedule.step).parameters:  # a later torch's has
            schedule.step = takes_microbatches(schedule.step)


def _flex_attention_as_sdpa(
    q: Any,
    k: Any,
    v: Any,
    *,
    score_mod: Any,
    block_mask: Any,
    scale: Any,
    enable_gqa: bool,
    return_aux: Any,
    kernel_options: Any,
) -> Any:
    """``flex_attention(q, k, v, block_mask=...)`` (no ``score_mod``, no log-sum-exp asked) by
    ``scaled_dot_product_attention`` with ``block_mask``'s mask function made dense."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None or return_aux.lse or return_aux.max_scores:
        raise NotImplementedError("score_mod / auxiliary outputs of flex attention on a CPU")
    batch, _, q_len, _ = q.shape
    mask = create_mask(block_mask.mask_mod, batch, 1, q_len, k.shape[-2], device=q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, AuxOutput()


def _watch_clipping(trainer: Any, fp64: dict[str, float], full_norm: bool) -> None:
    """Wrap torchtitan's ``clip_grad_norm_``: each step, record in ``fp64`` the norm of the
    gathered full gradients computed in fp64 (what each implementation's fp32 norm is measured
    against); with ``full_norm``, clip by the fp32 norm of the gathered gradients instead of
    torchtitan's norm of each rank's pieces. Under pipeline parallelism a rank holds its stages'
    gradients only: both norms are then combined over the stages as torchtitan combines its own
    (the squares summed over the ``pp`` mesh)."""
    import torch
    import torchtitan.trainer as titan_trainer

    clip = titan_trainer.dist_utils.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        parameters = list(parameters)
        pp_mesh = kwargs.get("pp_mesh")
        full = [p.grad.full_tensor() for p in parameters if p.grad is not None]
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in full])
        fp64[str(trainer.step)] = _over_stages(torch.linalg.vector_norm(norms), pp_mesh).item()
        if not full_norm:
            return clip(parameters, max_norm, *args, **kwargs)
        total = _over_stages(torch.nn.utils.get_total_norm(full), pp_mesh)
        # one call per mesh: under expert parallelism the experts' mesh is not the others'
        # (torch's foreach multiply refuses DTensors of two meshes); the same scale for all
        by_mesh: dict[Any, list[Any]] = {}
        for p in parameters:
            by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    titan_trainer.dist_utils.clip_grad_norm_ = clip_grad_norm_


def _over_stages(norm: Any, pp_mesh: Any) -> Any:
    """``norm`` (the 2-norm of this rank's stages' gradients) over every pipeline stage, the
    squares summed over ``pp_mesh`` as torchtitan sums its own; ``norm`` itself without one."""
    import torch.distributed as dist

    if pp_mesh is None:
        return norm
    squares = norm.square()
    dist.all_reduce(squares, group=pp_mesh.get_group())
    return squares.sqrt()


def _worker(args: argparse.Namespace) -> int:
    _import_torchtitan_on_cpu()
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig, text_datasets
    from torchtitan.tools.logging import init_logger

    init_logger()
    data = args.out / "data"
    text_datasets.DATASETS["local_text"] = DatasetConfig(
        path=str(data / "data.json"),
        loader=lambda path: load_dataset(
            "json", data_files=path, split="train", cache_dir=str(data / "cache")
        ),
        sample_processor=lambda sample: sample["text"],
    )
    import torchtitan.distributed.fsdp as titan_fsdp

    divide_off = titan_fsdp.disable_fsdp_gradient_division

    def divide_off_with_sums(model: Any) -> None:
        """torchtitan's gradient-division switch (factor 1), reduced by SUM: FSDP2 reduces an
        undivided gradient with NCCL's PREMUL_SUM otherwise, which Gloo has not."""
        divide_off(model)
        for module in model.modules():
            if isinstance(module, titan_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = divide_off_with_sums
    if args.impl == "rf":
        import raggedfsdp as rf

        titan_fsdp.fully_shard = rf.fully_shard  # the one change

    module, function = MODELS[args.model]
    config = getattr(importlib.import_module(module), function)()
    config.hf_assets_path = str(args.tokenizer)
    config.dump_folder = str(args.out / args.phase)
    config.dataloader.dataset = "local_text"
    config.training.local_batch_size = args.batch
    config.training.seq_len = args.seq_len
    config.training.steps = STEPS
    config.training.mixed_precision_param = args.param_dtype
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    if not args.seed:  # the seed checkpoint is the whole model, made by one process
        config.parallelism.pipeline_parallel_degree = args.pp
        config.parallelism.expert_parallel_degree = args.ep
    config.validator.enable = False
    config.debug.seed = 0
    config.checkpoint.enable = True
    config.checkpoint.interval = RESUME_FROM
    config.checkpoint.keep_latest_k = 0
    if args.seed:
        config.checkpoint.create_seed_checkpoint = True
    elif not args.phase.endswith("-resume"):
        config.checkpoint.initial_load_path = str(args.out / "seed" / "checkpoint" / "step-0")
        config.checkpoint.initial_load_model_only = True

    trainer = config.build()
    metrics: dict[str, dict[str, float]] = {"loss": {}, "grad_norm": {}}
    log = trainer.metrics_processor.log

    def record(step: int, loss: float, max_loss: float, grad_norm: float, **kwargs: Any) -> None:
        metrics["loss"][str(step)] = float(loss)
        metrics["grad_norm"][str(step)] = float(grad_norm)
        log(step, loss, max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = record
    metrics["grad_norm_fp64"] = {}
    _watch_clipping(trainer, metrics["grad_norm_fp64"], args.norm_from_full_gradients)
    try:
        if args.seed:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        trainer.close()
    import torch.distributed as dist

    # the rank that logs the loss under pipeline parallelism: the first of the last stage
    # (torchtitan's ensure_pp_loss_visible); rank 0 without
    logging_rank = dist.get_world_size() // args.pp * (args.pp - 1)
    if dist.get_rank() == logging_rank and not args.seed:
        kinds = sorted({type(p).__name__ for p in trainer.model_parts[0].parameters()})
        metrics["parameter_types"] = kinds  # type: ignore[assignment]
        (args.out / args.phase / "metrics.json").write_text(json.dumps(metrics, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
