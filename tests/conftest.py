"""Shared fixtures: small models whose real CPU runs are the ground truth."""

from __future__ import annotations

import pytest
import torch

from vramplan.trace.policy import CpuPolicy, CudaPolicy


@pytest.fixture
def cpu_policy() -> CpuPolicy:
    return CpuPolicy()


@pytest.fixture
def cuda_policy() -> CudaPolicy:
    return CudaPolicy()


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
