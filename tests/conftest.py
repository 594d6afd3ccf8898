"""Shared fixtures: small real models and a clean simulated device per test."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_collect():
    torch.manual_seed(0)
    yield
    gc.collect()


@pytest.fixture
def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
