"""Shared fixtures. Tiers: default (fast CPU), `slow`, `docker`, `gpu` (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import sys

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


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """The real local engine on the tiny model, shared by a test module."""
    from gateway.engines.local import LocalEngine

    eng = LocalEngine(tiny_model_path)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def renderer(tiny_model_path):
    from gateway.render import load_renderer

    return load_renderer(tiny_model_path)


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running(request):
    """A module that leaves Ray running hands the next module a Ray of the wrong size (whose
    actors then wait for CPUs forever): shut it down and fail the module that did."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.module.__name__} left Ray running: shut it down in a fixture")
