"""The megatron backend as several ranks (Ray actors placed by trainer/cluster.py, gloo on CPU):
tensor, pipeline and data parallel each give what one rank gives, and TransferMesh streams
their weights to an engine bit-exactly."""

from __future__ import annotations

import pytest
import ray
import torch
from test_megatron import BATCH, megatron

from gateway.engines import EngineConfig, make_engine
from trainer.actors import init_ray
from trainer.cluster import node_of, placed_trainer
from trainer.config import load
from trainer.transfer import TransferConfig, TransferMesh

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

TRAIN = {"lr": 1e-2, "micro_batch_tokens": 20, "grad_clip": 0.5}


@pytest.fixture(scope="module")
def ray_local():
    init_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_rank(tiny_model_path):
    """What a single rank in this process computes: log-probs, then two steps' metrics and
    the weights after them."""
    backend = megatron(tiny_model_path, **TRAIN)
    logprobs = backend.logprobs(BATCH)
    metrics = [backend.train_step(BATCH), backend.train_step(BATCH[::-1])]
    return logprobs, metrics, backend.state_dict()


@pytest.mark.parametrize(
    "layout",
    [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    ids=["tensor_parallel=2", "pipeline_parallel=2", "data_parallel=2"],
)
async def test_two_ranks_match_one(ray_local, tiny_model_path, one_rank, layout):
    tp, pp, dp = layout
    cfg = load(
        [
            f"model.name={tiny_model_path}",
            "train.kind=megatron",
            f"train.tensor_parallel={tp}",
            f"train.pipeline_parallel={pp}",
            f"train.data_parallel={dp}",
            "rollout.temperature=0.7",
            "run.steps=10",
        ]
        + [f"train.{k}={v}" for k, v in TRAIN.items()]
    )
    want_logprobs, want_metrics, want_weights = one_rank
    with placed_trainer(cfg) as group:
        assert len(group.ranks) == 2
        assert len({node_of(r) for r in group.ranks}) == 1  # one node here
        for got, want in zip(group.logprobs(BATCH), want_logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-5)
        got_metrics = [group.train_step(BATCH), group.train_step(BATCH[::-1])]
        for got, want in zip(got_metrics, want_metrics, strict=True):
            assert set(got) == set(want)
            for key in (k for k in want if not k.startswith("perf/")):  # timed: not equal
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        # Adam moves every weight by up to lr per step whatever the gradient's size, so where
        # gradients are ~0 (embedding rows of unseen tokens) rounding differences between
        # layouts show in full: weights are held to 1% of one step's largest move.
        weights = dict(group.state_dict())
        assert set(weights) == set(want_weights)
        for name, tensor in want_weights.items():
            assert torch.allclose(weights[name], tensor, atol=0.01 * TRAIN["lr"]), name
        assert group.step == 2
        # TransferMesh streams the ranks' weights by HF name to an engine over each CPU route:
        # rank 0 packs the buckets, the other rank gathers each parameter with it (TP
        # all-gather, or its pipeline stage sends it); small buckets, so there are many
        engine = make_engine(EngineConfig(), tiny_model_path)
        try:
            for version, route in enumerate(["shm", "broadcast", "disk"], start=1):
                mesh = TransferMesh(group, [engine], TransferConfig(route=route, bucket_mb=0.1))
                report = await mesh.push(version)
                await mesh.close()
                assert not report.failed and engine.weight_version == version, report.failed
                assert len(mesh._buckets) > 3
                got = engine.weights()
                for name, tensor in weights.items():
                    assert torch.equal(got[name], tensor), (route, name)
        finally:
            await engine.close()
