"""Shared fixtures: small real models and a clean simulated device per test."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_collect():
    torch.manual_seed(0)
    yield
    # free what a test left in reference cycles (tensors the next test's device would count);
    # then freeze the survivors, so the next collection looks only at what that test makes
    gc.collect()
    gc.freeze()


@pytest.fixture
def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
