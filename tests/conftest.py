"""Shared pytest setup: one thread per process keeps multi-process tests fast on 2 cores, and
the shared test helpers get pytest's assertion messages too."""

import pytest
import torch

pytest.register_assert_rewrite("harness", "optim_grid")
torch.set_num_threads(1)
