"""Shared pytest setup: one thread per process keeps multi-process tests fast on 2 cores."""

import torch

torch.set_num_threads(1)
