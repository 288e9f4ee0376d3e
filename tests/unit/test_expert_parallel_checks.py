"""Expert parallelism's checks on the Hugging Face MoEs, in this process: the experts modules of
meta-device tiny-mixtral and tiny-qwen2-moe are found and split at any ep that divides their 4
experts; a model without experts, an ep that does not divide, and a structure the forward does
not know are one ``ValueError`` naming the model or the module. On a group of one (ep=1), the
split model computes HF's own loss and gradients, whatever experts implementation the config
names, and an unsplit model keeps HF's dispatch. (Four ranks: tests/distributed/
test_expert_parallel_hf.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from raggedfsdp.models import expert_parallel
from raggedfsdp.models.expert_parallel import (
    check_expert_parallel,
    expert_modules,
    parallelize_experts,
)
from raggedfsdp.models.gpt import GPT, GPTConfig

MOES = ("tiny-mixtral", "tiny-qwen2-moe")
EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(2)]


def _meta(name: str) -> nn.Module:
    pytest.importorskip("transformers")
    from raggedfsdp.models.hf import build_hf_model

    return build_hf_model(name, "meta")


@pytest.mark.parametrize("name", MOES)
def test_experts_modules_are_found_in_model_order(name):
    model = _meta(name)
    found = expert_modules(model)
    assert [fqn for fqn, _ in found] == EXPERTS
    assert [module for _, module in found] == [model.get_submodule(fqn) for fqn in EXPERTS]
    for ep in (1, 2, 4):
        check_expert_parallel(model, ep)


def test_a_model_without_experts_cannot_take_ep():
    llama = _meta("tiny-llama")
    gpt = GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=16), device="meta")
    conv = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Linear(4, 4))  # a 3-D weight, not experts
    for model in (llama, gpt, conv):
        assert expert_modules(model) == []
        with pytest.raises(ValueError, match="a model without experts cannot take --ep"):
            check_expert_parallel(model, 2)


@pytest.mark.parametrize("name", MOES)
def test_an_ep_that_does_not_divide_the_experts_names_the_module(name):
    model = _meta(name)
    for ep in (3, 8):
        with pytest.raises(ValueError) as error:
            check_expert_parallel(model, ep)
        message = str(error.value)
        assert f"experts module '{EXPERTS[0]}'" in message, message
        assert f"holds 4 experts, which {ep} expert-parallel ranks cannot split" in message
    for ep in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="ep must be a positive integer"):
            check_expert_parallel(model, ep)


def _transposed(model: nn.Module) -> None:
    model.model.layers[1].mlp.experts.is_transposed = True


def _biased(model: nn.Module) -> None:
    experts = model.model.layers[1].mlp.experts
    experts.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 256, device="meta"))


def _list_of_mlps(model: nn.Module) -> None:
    model.model.layers[1].mlp.experts = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))


def _other_call(model: nn.Module) -> None:
    experts = model.model.layers[1].mlp.experts

    class Experts(type(experts)):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return hidden_states

    experts.__class__ = Experts


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_transposed, "sets is_transposed=True"),
        (_biased, "holds the parameters ['down_proj', 'gate_up_proj', 'gate_up_proj_bias']"),
        (_list_of_mlps, "holds the parameters ['0.bias', '0.weight'"),
        (_other_call, "is called as forward('hidden_states',)"),
    ],
)
def test_an_unknown_structure_names_the_module(change, problem):
    model = _meta("tiny-mixtral")
    change(model)
    with pytest.raises(ValueError) as error:
        check_expert_parallel(model, 2)
    message = str(error.value)
    assert message.startswith(f"MixtralForCausalLM: experts module '{EXPERTS[1]}'"), message
    assert problem in message and "knows transformers' stacked experts" in message


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", MOES)
def test_one_rank_computes_hf_numbers_whatever_the_implementation(name, group_of_one, monkeypatch):
    pytest.importorskip("transformers")
    from raggedfsdp.models.hf import build_hf_model

    torch.manual_seed(0)
    reference = build_hf_model(name, "cpu")
    model = copy.deepcopy(reference)
    split = parallelize_experts(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    assert split == [model.get_submodule(fqn) for fqn in EXPERTS]
    assert all(isinstance(module.gate_up_proj, DTensor) for module in split)
    with pytest.raises(ValueError, match="is already split by expert parallelism"):
        check_expert_parallel(model, 1)
    calls = []
    dispatch = expert_parallel._dispatch
    monkeypatch.setattr(
        expert_parallel, "_dispatch", lambda *args: calls.append(1) or dispatch(*args)
    )
    x, y = _batch()
    want = reference(x, y)
    want.backward()
    assert calls == []  # the unsplit model: HF's dispatch (grouped_mm by default)
    for implementation in ("eager", "grouped_mm"):
        model.config._experts_implementation = implementation
        model.zero_grad()
        got = model(x, y)
        got.backward()
        assert len(calls) == 2  # one dispatch per layer, whatever the config names
        calls.clear()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        references = dict(reference.named_parameters())
        assert references.keys() == dict(model.named_parameters()).keys()
        for key, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(grad, references[key].grad, rtol=1e-5, atol=1e-6, msg=key)
