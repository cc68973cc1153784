"""TransferMesh in one process: the torch backend's HF-named weights to the real embedded engine
(tiny model), the HF-name view, and what a push reports."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
import torch

from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from trainer.backends import TrainSample
from trainer.backends.torch_backend import TorchBackend
from trainer.config import AlgorithmConfig, TrainBackendConfig
from trainer.transfer import StateDictSource, TransferMesh

SEQ = [1, 15, 27, 300, 301, 302, 2]


def trained_backend(path) -> TorchBackend:
    backend = TorchBackend(
        path,
        TrainBackendConfig(device="cpu", lr=1e-2, dtype="fp32"),
        AlgorithmConfig(),
        temperature=1.0,
    )
    sample = TrainSample(SEQ, [0, 0, 0, 1, 1, 1, 1], [0.0] * 3 + [-10.0] * 4, 1.0)
    backend.train_step([sample])
    return backend


def hf_folder_specs(folder) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) from the HF folder's safetensors headers."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as handle:
            (n,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(n))
        header.pop("__metadata__", None)
        out |= {k: (v["dtype"], v["shape"]) for k, v in header.items()}
    return out


def test_the_hf_view_has_the_hf_folders_names_and_shapes(tiny_model_path):
    backend = trained_backend(tiny_model_path)
    specs = StateDictSource(backend.state_dict()).hf_specs()
    want = hf_folder_specs(tiny_model_path)
    assert {s.name: ("F32", list(s.shape)) for s in specs} == want
    assert len(specs) == len(want)  # lm_head.weight is the tied embedding: once, as on disk


async def test_push_makes_the_engine_score_like_the_trainer(tiny_model_path):
    backend = trained_backend(tiny_model_path)
    async with LocalEngine(tiny_model_path) as engine:
        before = (await engine.score([SEQ], [1]))[0]
        mesh = TransferMesh(backend, [engine])
        assert [route for _, route, _ in mesh.plan.entries] == ["in_process"]
        assert "engine0" in mesh.plan.describe() and "same process" in mesh.plan.describe()
        report = await mesh.push(1)
        after = (await engine.score([SEQ], [1]))[0]
        assert engine.weight_version == 1
        assert mesh.status() == [
            {"engine": "engine0", "route": "in_process", "version": 1, "error": ""}
        ]
        for name, tensor in backend.state_dict().items():  # in_process: the very same values
            assert torch.equal(engine.weights()[name], tensor), name
    want = backend.logprobs([TrainSample(SEQ, [1] * len(SEQ), [0.0] * len(SEQ), 0.0)])[0][1:]
    assert torch.allclose(torch.tensor(after), torch.tensor(want), atol=1e-4)
    assert not torch.allclose(torch.tensor(before), torch.tensor(want), atol=1e-4)
    params = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    assert report.bytes == params  # the tied embedding counted once
    assert report.receivers == report.delivered == 1 and not report.failed
    assert report.seconds > 0 and report.gb_per_s > 0
    metrics = report.metrics()
    assert metrics["weights/in_process/bytes"] == params
    assert metrics["weights/in_process/gb_per_s"] > 0
    assert metrics["weights/stall_s/engine0"] == report.stalls["engine0"] > 0


@pytest.mark.parametrize("mode", ["continue", "abort_resubmit"])
async def test_push_during_generation_stamps_new_versions(tiny_model_path, mode):
    backend = trained_backend(tiny_model_path)
    async with LocalEngine(tiny_model_path) as engine:
        params = SamplingParams(max_tokens=48, ignore_eos=True, seed=1)
        stream = engine.stream([1, 15, 27], params)
        first = await anext(stream)
        push = asyncio.create_task(TransferMesh(backend, [engine], mode=mode).push(1))
        versions = list(first.versions)
        async for chunk in stream:
            versions += chunk.versions
        await push
    assert len(versions) == 48
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)  # one switch, never back


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="rollout.partial_rollout"):
        TransferMesh({}, [], mode="drop")
    from trainer.transfer import TransferConfig

    with pytest.raises(ValueError, match="transfer.bucket_mb"):
        TransferConfig(bucket_mb=0)
    with pytest.raises(ValueError, match="transfer.route"):
        TransferConfig(route="carrier_pigeon")


def test_tied_weights_are_one_tensor_in_the_view():
    w = torch.zeros(10, 4)
    source = StateDictSource({"a": w, "b": w, "c": torch.zeros(3, dtype=torch.bfloat16)})
    assert [(s.name, s.nbytes) for s in source.hf_specs()] == [("a", 160), ("c", 6)]


class Recorder(StateDictSource):
    """A source that records the tensors it yields (what a sharded trainer's ranks gather)."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.gathered: list[str] = []

    def hf_tensors(self, names):
        for name, tensor in super().hf_tensors(names):
            self.gathered.append(name)
            yield name, tensor


def test_the_sending_rank_makes_every_announced_gather_even_when_its_route_fails():
    from trainer.transfer import make_buckets
    from trainer.transfer.buckets import pack
    from trainer.transfer.endpoints import ScriptedReads, follow_reads

    state = {f"w{i}": torch.full((4,), float(i)) for i in range(5)}
    buckets = make_buckets(StateDictSource(state).hf_specs(), bucket_bytes=32)
    reads = [b.names for b in buckets]
    assert len(reads) == 3

    def failing_route(source) -> None:  # packs the first bucket, stops inside the second
        out = torch.empty(32, dtype=torch.uint8)
        pack(source.hf_tensors(buckets[0].names), buckets[0], out)
        half = source.hf_tensors(buckets[1].names)
        next(half)
        raise ConnectionError("receiver gone")

    lead, other = Recorder(state), Recorder(state)
    scripted = ScriptedReads(lead, reads)
    with pytest.raises(ConnectionError):
        try:
            failing_route(scripted)
        finally:
            scripted.finish()
    follow_reads(other, reads)
    assert lead.gathered == other.gathered == list(state)  # all of them, in the same order
    # a gather the route did not announce would leave the other ranks out of step: refused
    with pytest.raises(AssertionError, match="not announced"):
        ScriptedReads(lead, reads).hf_tensors(buckets[1].names)
