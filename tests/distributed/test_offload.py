"""``offload_policy=CPUOffloadPolicy()``'s copy path (host shards, device unsharded buffers), run
on CPU with ``DBufferConfig(host_copies_on_cpu=True)`` (the same code, separate host buffers):
the same training as without it, bit for bit, and as FSDP2's offload; the buffers where they
belong; a control that breaks the copy; checkpoints. One Gloo launch of 2 ranks; the tests judge
its collected results.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import raggedfsdp as rf
from harness import error_message, run_distributed
from parity_models import OddModel, make_batches
from raggedfsdp.runtime._offload import HostOffload, check_host_backend, offload_for
from raggedfsdp.runtime._transport import is_gloo
from raggedfsdp.spawn import run_on_ranks

WORLD = 2
STEPS = 3


def _model(offload: bool, **kwargs: Any) -> nn.Module:
    """OddModel sharded per block and at the root; ``offload``: on the forced copy path."""
    torch.manual_seed(0)
    model = OddModel()
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    config = kwargs.get("dbuffer_config", rf.DBufferConfig())
    kwargs["dbuffer_config"] = dataclasses.replace(config, host_copies_on_cpu=True)
    for block in model.blocks:
        rf.fully_shard(block, **kwargs)
    rf.fully_shard(model, **kwargs)
    return model


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([v.reshape(-1).float() for v in rf.full_state_dict(model).values()])


def _train(model: nn.Module, rank: int, *, micro: int = 1, sync_each: bool = True) -> None:
    """STEPS AdamW steps of ``micro`` backwards each: gradients kept unsharded between them
    (no_sync) unless ``sync_each``, when the reduced ones accumulate on the sharded gradients."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = make_batches(STEPS * micro, 2 * WORLD)
    for step in range(STEPS):
        for k in range(micro):
            idx, targets = batches[step * micro + k]
            model.set_requires_gradient_sync(sync_each or k == micro - 1)
            (
                model(idx[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]) / micro
            ).backward()
        opt.step()
        opt.zero_grad()


def _trained(rank: int, offload: bool, **kwargs: Any) -> torch.Tensor:
    model = _model(offload, **kwargs)
    _train(model, rank)
    return _flat(model)


def _fsdp2_offload(rank: int) -> torch.Tensor:
    """FSDP2 with CPUOffloadPolicy on CPU (it accepts it there, unpinned)."""
    torch.manual_seed(0)
    model = OddModel()
    for block in model.blocks:
        torch_fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
    torch_fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    _train(model, rank)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return torch.cat([v.reshape(-1).float() for v in full.values()])


def _pairs(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(without offload, with the forced offload path) after the same training."""
    bf16 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    bf16_fp32 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    int8 = rf.CommCompression(reduce_scatter=torch.int8)
    cases: dict[str, dict[str, Any]] = {
        "fp32": {},
        "bf16": {"mp_policy": bf16},
        "bf16_reduce_fp32": {"mp_policy": bf16_fp32},
        "keep_after_forward": {"reshard_after_forward": False},
        "copy_in_out": {"dbuffer_config": rf.DBufferConfig(zero_copy=False)},
        "int8_reduce_scatter": {"compression": int8},
    }
    out = {
        name: (_trained(rank, False, **kw), _trained(rank, True, **kw))
        for name, kw in cases.items()
    }
    replicas = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = (_trained(rank, False, mesh=replicas), _trained(rank, True, mesh=replicas))
    for name, micro, sync_each in (("no_sync", 3, False), ("accumulate_sharded", 2, True)):
        pair = []
        for offload in (False, True):
            model = _model(offload)
            _train(model, rank, micro=micro, sync_each=sync_each)
            pair.append(_flat(model))
        out[name] = (pair[0], pair[1])
    return out


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t  # a sharded tensor: its piece's
    return local.untyped_storage().data_ptr()


def _placement(rank: int) -> dict[str, Any]:
    """Where the forced path keeps things, checked by storage identity."""
    model = _model(True)
    groups = [s.group for s in model._all_states()]
    host_grads: list[int] = []  # storages of the host gradient buffers, as allocated
    for group in groups:
        offload = group.offload
        assert isinstance(offload, HostOffload)
        to_host = offload.to_host

        def spy(*args: Any, _to_host: Any = to_host) -> torch.Tensor:
            host = _to_host(*args)
            host_grads.append(_storage(host))
            return host

        offload.to_host = spy  # type: ignore[method-assign]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx, targets = make_batches(1, 2 * WORLD)[0]
    model(idx[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    opt.step()
    out: dict[str, Any] = {"params_in_local": True, "grads_in_host": True, "state_on_param": True}
    locals_ = {_storage(b.local) for g in groups for b in g.buckets}
    for group in groups:
        for bucket in group.buckets:
            for param in bucket.params:
                sharded = param.sharded
                out["params_in_local"] &= _storage(sharded) == _storage(bucket.local)
                if sharded.grad is not None:
                    out["grads_in_host"] &= _storage(sharded.grad) in host_grads
                    out["grads_in_host"] &= _storage(sharded.grad) not in locals_
                for value in opt.state[sharded].values():
                    if value.dim():  # exp_avg, exp_avg_sq: host tensors of their own
                        out["state_on_param"] &= value.device == sharded.device
                        out["state_on_param"] &= _storage(value) not in locals_
    out["grads_seen"] = len(host_grads)
    stats = model.stats()
    host = sum(b.local.nbytes + (b.local.nbytes if b.has_sharded_grads() else 0)
               for g in groups for b in g.buckets)  # fmt: skip
    out["offloaded_bytes"] = (stats["offloaded_bytes"], stats["persistent_bytes"], host)
    out["unsharded_on_device"], out["freed_after_reshard"] = _unsharded_where(model, groups)
    plain = _model(False)
    out["plain_views_of_local"] = _unsharded_where(plain, [s.group for s in plain._all_states()])[0]
    out["plain_offloaded_bytes"] = plain.stats()["offloaded_bytes"]
    return out


def _unsharded_where(model: nn.Module, groups: list) -> tuple[list[bool], bool]:
    """For every unsharded parameter while unsharded: whether it lies in the gathered (device)
    storage rather than a host shard; and whether that storage is freed after reshard."""
    modules = [model, model.blocks[0], model.blocks[1]]  # the root first: it initialises
    for module in modules:
        module.unshard()
    where = []
    for group in groups:
        storages = {_storage(s._bytes) for s in group._gather_storage}
        locals_ = {_storage(b.local) for b in group.buckets}
        for param in group.params:
            where.append(
                _storage(param.unsharded) in storages and _storage(param.unsharded) not in locals_
            )
    for module in modules:
        module.reshard()
    freed = all(not s.allocated for g in groups for s in g._gather_storage)
    return where, freed


def _broken_copy(rank: int) -> torch.Tensor:
    """The control: the forced path with the host->device copy skipped."""
    model = _model(True)
    for state in model._all_states():
        state.group.offload.to_device = lambda *args: None
    _train(model, rank)
    return _flat(model)


def _checkpoints(rank: int, path: str) -> dict[str, Any]:
    """DCP save of a trained offloaded model, loaded into a fresh offloaded one and a plain one;
    and ``rf.full_state_dict`` of each."""
    model = _model(True)
    _train(model, rank)
    dcp.save(model.state_dict(), checkpoint_id=path)
    out = {"saved": _flat(model)}
    for name, offload in (("offload", True), ("plain", False)):
        fresh = _model(offload)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state)
        out[name] = _flat(fresh)
    # Trains on after the load as the original does.
    fresh = _model(True)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    _train(fresh, rank)
    _train(model, rank)
    out["trained_on"] = (_flat(model), _flat(fresh))
    return out


def _errors() -> dict[str, str]:
    """Combinations refused at fully_shard (before any collective)."""
    fp8 = rf.CommCompression(all_gather=torch.float8_e4m3fn)

    def gather_compressed() -> None:
        planner = rf.StructAwarePlanner(compression=fp8)
        _model(True, compression=fp8, planner=planner)

    return {"all_gather_compressed": error_message(gather_compressed)}


def _run(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "pairs": _pairs(rank),
        "fsdp2": _fsdp2_offload(rank),
        "placement": _placement(rank),
        "broken": _broken_copy(rank),
        "checkpoints": _checkpoints(rank, path),
        "errors": _errors(),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = Path(tmp_path_factory.mktemp("offload")) / "ckpt"
    return run_distributed(_run, WORLD, str(path))


PAIRS = (
    "fp32",
    "bf16",
    "bf16_reduce_fp32",
    "keep_after_forward",
    "copy_in_out",
    "int8_reduce_scatter",
    "hsdp",
    "no_sync",
    "accumulate_sharded",
)


@pytest.mark.parametrize("case", PAIRS)
def test_offload_trains_bit_for_bit_as_without(results, case):
    for rank in results:
        plain, offloaded = rank["pairs"][case]
        assert torch.isfinite(plain).all()
        assert torch.equal(plain, offloaded)


def test_offload_trains_as_fsdp2_offload(results):
    for rank in results:
        torch.testing.assert_close(rank["pairs"]["fp32"][1], rank["fsdp2"])


def test_offload_training_differs_when_the_host_to_device_copy_is_skipped(results):
    """The control: without the copy the gathered parameters are not the shards."""
    for rank in results:
        assert not torch.equal(rank["broken"], rank["pairs"]["fp32"][1])


def test_shards_gradients_and_optimizer_state_are_in_the_host_buffers(results):
    for rank in results:
        placement = rank["placement"]
        assert placement["params_in_local"]
        assert placement["grads_seen"] > 0 and placement["grads_in_host"]
        assert placement["state_on_param"]
        offloaded, persistent, host = placement["offloaded_bytes"]
        assert offloaded == persistent == host > 0  # no residuals here: all of it on the host
        assert placement["plain_offloaded_bytes"] == 0


def test_unsharded_parameters_are_device_buffers_freed_at_reshard(results):
    for rank in results:
        placement = rank["placement"]
        assert all(placement["unsharded_on_device"])
        assert placement["freed_after_reshard"]
        # Without offload, parameters held whole are views of the shard: the check can fail.
        assert not all(placement["plain_views_of_local"])


def test_checkpoints_of_offloaded_models(results):
    for rank in results:
        ckpt = rank["checkpoints"]
        assert torch.equal(ckpt["offload"], ckpt["saved"])
        assert torch.equal(ckpt["plain"], ckpt["saved"])
        original, loaded = ckpt["trained_on"]
        assert torch.equal(original, loaded)


def test_a_compressed_all_gather_with_offload_is_refused(results):
    for rank in results:
        message = rank["errors"]["all_gather_compressed"]
        assert "CPUOffloadPolicy" in message and "all_gather=None" in message


def test_cpu_offload_policy_is_accepted_on_an_accelerator():
    """No device needed to decide: on an accelerator the policy takes the offload path (pinned
    only where an accelerator runtime is present); on CPU it is met as is."""
    cuda = torch.device("cuda", 0)
    offload = offload_for(CPUOffloadPolicy(), cuda)
    assert isinstance(offload, HostOffload) and offload.device == cuda
    assert offload.pin_memory == torch.accelerator.is_available()
    assert offload_for(CPUOffloadPolicy(), torch.device("cpu")) is None
    assert offload_for(None, cuda) is None
    forced = offload_for(CPUOffloadPolicy(), torch.device("cpu"), host_copies_on_cpu=True)
    assert isinstance(forced, HostOffload) and not forced.pin_memory


def test_offload_needs_a_group_that_reduces_host_tensors():
    """An NCCL-only group (stood in for: no GPU here) is refused before any collective, naming
    the fix; a group with a CPU backend passes."""

    def group(name: str, *types: str) -> Any:
        return type(
            "Group", (), {"group_name": name, "_device_types": [*map(torch.device, types)]}
        )()

    with pytest.raises(ValueError, match=r"'0' has backends for cuda only; .*cpu:gloo,cuda:nccl"):
        check_host_backend([group("0", "cuda")])
    check_host_backend([group("1", "cuda", "cpu")])


def _per_device_backends(rank: int, world: int) -> dict[str, Any]:
    """The same training under the world group, which names its backend per device type
    (``"cpu:gloo"``, as ``"cpu:gloo,cuda:nccl"`` does on a GPU node), and under a plain Gloo
    group: offload copies, a compressed reduce-scatter."""
    torch.set_num_threads(1)
    int8 = rf.CommCompression(reduce_scatter=torch.int8)
    gloo = DeviceMesh.from_group(torch.distributed.new_group(backend="gloo"), "cpu")
    out: dict[str, Any] = {
        "backend": str(torch.distributed.get_backend()),
        "gloo_carries_cpu": is_gloo(None, torch.device("cpu")),
    }
    for name, mesh in (("per_device", None), ("gloo", gloo)):
        model = _model(True, compression=int8, mesh=mesh)
        _train(model, rank)
        out[name] = _flat(model)
    return out


def test_a_group_with_a_backend_per_device_type():
    """It trains as a Gloo group does, and the runtime sees that Gloo carries its CPU tensors
    (so it takes its own Gloo collectives, cheaper than Gloo's native ones)."""
    [first, second] = run_on_ranks(_per_device_backends, WORLD, backend="cpu:gloo", timeout=300)
    assert first["backend"] == "cpu:gloo"
    for rank in (first, second):
        assert rank["gloo_carries_cpu"]
        assert torch.equal(rank["per_device"], rank["gloo"])
