"""Shared fixtures. Tiers: default (fast CPU), `slow`, `docker`, `gpu` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from gateway.models import resolve_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path():
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_model("smollm2")
