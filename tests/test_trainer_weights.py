"""Weight push from the torch backend to the real embedded engine (tiny model)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from trainer.backends import TrainSample
from trainer.backends.torch_backend import TorchBackend
from trainer.config import AlgorithmConfig, TrainBackendConfig
from trainer.weights import InProcessPush, state_bytes

SEQ = [1, 15, 27, 300, 301, 302, 2]


def trained_backend(path) -> TorchBackend:
    backend = TorchBackend(
        path, TrainBackendConfig(device="cpu", lr=1e-2), AlgorithmConfig(), temperature=1.0
    )
    sample = TrainSample(SEQ, [0, 0, 0, 1, 1, 1, 1], [0.0] * 3 + [-10.0] * 4, 1.0)
    backend.train_step([sample])
    return backend


async def test_push_makes_the_engine_score_like_the_trainer(tiny_model_path):
    backend = trained_backend(tiny_model_path)
    async with LocalEngine(tiny_model_path) as engine:
        before = (await engine.score([SEQ], [1]))[0]
        report = await InProcessPush([engine]).push(backend.state_dict(), version=1)
        after = (await engine.score([SEQ], [1]))[0]
        assert engine.weight_version == 1
    want = backend.logprobs([TrainSample(SEQ, [1] * len(SEQ), [0.0] * len(SEQ), 0.0)])[0][1:]
    assert torch.allclose(torch.tensor(after), torch.tensor(want), atol=1e-4)
    assert not torch.allclose(torch.tensor(before), torch.tensor(want), atol=1e-4)
    params = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    assert report.bytes == params  # the tied embedding counted once
    assert report.receivers == 1 and report.seconds > 0 and report.gb_per_s > 0
    assert set(report.metrics()) == {"weights/bytes", "weights/seconds", "weights/gb_per_s"}


@pytest.mark.parametrize("mode", ["continue", "abort_resubmit"])
async def test_push_during_generation_stamps_new_versions(tiny_model_path, mode):
    backend = trained_backend(tiny_model_path)
    async with LocalEngine(tiny_model_path) as engine:
        params = SamplingParams(max_tokens=48, ignore_eos=True, seed=1)
        stream = engine.stream([1, 15, 27], params)
        first = await anext(stream)
        push = asyncio.create_task(InProcessPush([engine], mode).push(backend.state_dict(), 1))
        versions = list(first.versions)
        async for chunk in stream:
            versions += chunk.versions
        await push
    assert len(versions) == 48
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)  # one switch, never back


def test_bad_mode_names_the_field():
    with pytest.raises(ValueError, match="rollout.partial_rollout"):
        InProcessPush([], "drop")


def test_state_bytes_counts_shared_storage_once():
    w = torch.zeros(10, 4)
    assert state_bytes({"a": w, "b": w, "c": torch.zeros(3, dtype=torch.bfloat16)}) == 160 + 6
