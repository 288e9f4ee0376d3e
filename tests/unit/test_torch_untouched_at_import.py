"""``import raggedfsdp`` and ``raggedfsdp plan`` leave torch exactly as it was; the first ragged
placement, RaggedTensor or ``fully_shard`` adapts it, once. Each case runs in a fresh
interpreter and compares, by identity, every object raggedfsdp's adaptations replace, before
and after."""

from __future__ import annotations

import json
import subprocess
import sys

#: Run in a fresh interpreter before the case's code: ``snapshot()`` holds every object an
#: adaptation replaces; ``changed(a, b)`` names those that differ between two snapshots.
_SNAPSHOT = """
import json, sys
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.checkpoint.state_dict  # binds distribute_tensor by name
import torch.distributed.fsdp as fsdp
import torch.distributed.fsdp._fully_shard as torch_fully_shard
import torch.distributed.tensor as dtensor
import torch.distributed.tensor._api as dtensor_api
from torch.utils._foreach_utils import _foreach_supported_types

def snapshot():
    return {
        "torch.distributed.fsdp.register_fsdp_forward_method": fsdp.register_fsdp_forward_method,
        "_fully_shard.register_fsdp_forward_method": torch_fully_shard.register_fsdp_forward_method,
        "torch.distributed.tensor.distribute_tensor": dtensor.distribute_tensor,
        "torch.distributed.tensor._api.distribute_tensor": dtensor_api.distribute_tensor,
        "_state_dict_utils.distribute_tensor": state_dict_utils.distribute_tensor,
        "_state_dict_utils._distribute_tensors": state_dict_utils._distribute_tensors,
        "_foreach_supported_types": tuple(_foreach_supported_types),
        "bindings": {
            name: module.distribute_tensor
            for name, module in list(sys.modules.items())
            if callable(getattr(module, "distribute_tensor", None))
        },
    }

def changed(before, after):
    out = []
    for key, value in before.items():
        if key == "bindings":  # a module loaded since must hold torch's own function
            original = before["torch.distributed.tensor._api.distribute_tensor"]
            if any(v is not value.get(name, original) for name, v in after[key].items()):
                out.append("bindings of distribute_tensor")
        elif key == "_foreach_supported_types":
            if len(value) != len(after[key]) or any(a is not b for a, b in zip(value, after[key])):
                out.append(key)
        elif after[key] is not value:
            out.append(key)
    return out

def group_of_one():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

first = snapshot()
"""

TENSOR_ADAPTATIONS = [
    "torch.distributed.tensor.distribute_tensor",
    "torch.distributed.tensor._api.distribute_tensor",
    "_state_dict_utils.distribute_tensor",
    "_state_dict_utils._distribute_tensors",
    "_foreach_supported_types",
    "bindings of distribute_tensor",
]
ALL_ADAPTATIONS = [
    "torch.distributed.fsdp.register_fsdp_forward_method",
    "_fully_shard.register_fsdp_forward_method",
    *TENSOR_ADAPTATIONS,
]


def _run(case: str) -> dict[str, list[str]]:
    """The case's ``result`` (names of changed objects per step), from a fresh interpreter."""
    code = _SNAPSHOT + case + "\nprint(json.dumps(result))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _changed_by_installing_twice() -> str:
    """Case code: after ``after = snapshot()``, install everything twice, compare each time."""
    return """
import raggedfsdp
raggedfsdp.integration.install()
once = snapshot()
raggedfsdp.integration.install()
result["install after first use"] = changed(after, once)
result["install again"] = changed(once, snapshot())
"""


def test_import_and_plan_leave_torch_as_it_was() -> None:
    result = _run("""
import raggedfsdp
result = {"import raggedfsdp": changed(first, snapshot())}
from raggedfsdp.cli import main
status = main(["plan", "--model", "gpt-tiny", "--world", "2,3", "--optimizer", "muon"])
result["raggedfsdp plan"] = changed(first, snapshot()) if status == 0 else ["exit", status]
""")
    assert result == {"import raggedfsdp": [], "raggedfsdp plan": []}


def test_first_ragged_placement_adapts_torch_once() -> None:
    """Negative control: the same comparison sees the tensor's adaptations once a placement is
    made (no group needed); installing everything after that adds only fully_shard's route."""
    result = _run(
        """
import raggedfsdp as rf
rf.RaggedShardPlacement(rf.ShardLayout((2, 3), 1, ((0, 6),)))
after = snapshot()
result = {"placement": changed(first, after)}
"""
        + _changed_by_installing_twice()
    )
    assert result == {
        "placement": TENSOR_ADAPTATIONS,
        "install after first use": ALL_ADAPTATIONS[:2],
        "install again": [],
    }


def test_first_ragged_tensor_adapts_torch_once() -> None:
    result = _run(
        """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
import raggedfsdp as rf
group_of_one()
mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
before = snapshot()
layout = rf.ShardLayout((2, 3), 1, ((0, 6),))
rf.RaggedTensor.from_piece(torch.zeros(2, 3), layout, mesh)
after = snapshot()
result = {"mesh": changed(first, before), "RaggedTensor": changed(before, after)}
"""
        + _changed_by_installing_twice()
    )
    assert result == {
        "mesh": [],
        "RaggedTensor": TENSOR_ADAPTATIONS,
        "install after first use": ALL_ADAPTATIONS[:2],
        "install again": [],
    }


def test_first_fully_shard_adapts_torch_once() -> None:
    result = _run(
        """
import torch
import raggedfsdp as rf
group_of_one()
rf.fully_shard(torch.nn.Linear(4, 4))
after = snapshot()
result = {"fully_shard": changed(first, after)}
"""
        + _changed_by_installing_twice()
    )
    assert result == {
        "fully_shard": ALL_ADAPTATIONS,
        "install after first use": [],
        "install again": [],
    }
