"""clip_grad_norm_ in one process, on plain parameters: torch's norm and clipping, no gradients
is a norm of 0, a bad norm type named. (Over ragged shards at W = 1..4:
tests/distributed/test_clip.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raggedfsdp.clip import clip_grad_norm_


def test_single_process_matches_torch_and_rejects_bad_norm_type() -> None:
    gen = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(5))]
    ref = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(5))]
    for a, b in zip(ours, ref, strict=True):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    total = clip_grad_norm_(ours, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.1)
    assert torch.allclose(total, expected, rtol=1e-6)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-6) for a, b in zip(ours, ref, strict=True))
    assert clip_grad_norm_([nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0  # no gradients
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(ours, 1.0, norm_type=-1.0)
