"""Engines and the train backend as real Ray actors (local Ray, tiny model), compared with the
same objects in this process."""

from __future__ import annotations

import math

import pytest
import ray
import torch

from gateway.engines import EngineConfig
from gateway.engines.base import EngineError, SamplingParams
from gateway.engines.local import LocalEngine
from gateway.engines.router import Router
from trainer.actors import init_ray, spawn_backend, spawn_engine
from trainer.backends import TrainSample, make_backend
from trainer.config import TrainerConfig
from trainer.transfer import TransferMesh

PROMPT = [1, 15, 27, 300, 301]
GREEDY = SamplingParams(max_tokens=12, temperature=0)
SAMPLES = [
    TrainSample([1, 15, 27, 300, 301, 302, 2], [0, 0, 0, 1, 1, 1, 1], [0.0] * 3 + [-9.0] * 4, 1.0),
    TrainSample([1, 15, 27, 400, 2], [0, 0, 0, 1, 1], [0.0] * 3 + [-8.0] * 2, -1.0),
]


@pytest.fixture(scope="module")
def ray_local():
    init_ray(num_cpus=4)  # logical CPUs: room for the engines and the backend of these tests
    init_ray(num_cpus=4)  # idempotent
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(ray_local, tiny_model_path):
    return spawn_engine(EngineConfig(max_batch_size=4), tiny_model_path, name="test-engine")


@pytest.fixture(scope="module")
def trainer_cfg(tiny_model_path) -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.model.name = str(tiny_model_path)
    cfg.train.device = "cpu"
    cfg.train.lr = 1e-2
    return cfg


@pytest.fixture(scope="module")
def backend(ray_local, trainer_cfg):
    backend = spawn_backend(trainer_cfg)
    yield backend
    backend.close()


async def test_same_greedy_tokens_logprobs_and_scores_as_in_process(engine, tiny_model_path):
    assert ray.get_actor("test-engine") is not None
    async with LocalEngine(tiny_model_path, max_batch_size=4) as local:
        want = await local.generate(PROMPT, GREEDY)
        want_scores = await local.score([PROMPT + want.output_ids], [2])
        assert engine.max_context == local.max_context
    got = await engine.generate(PROMPT, GREEDY)
    streamed = [c async for c in engine.stream(PROMPT, GREEDY)]
    assert got.output_ids == want.output_ids
    assert sum((c.token_ids for c in streamed), []) == want.output_ids
    assert streamed[-1].finish_reason == want.finish_reason == got.finish_reason
    assert torch.allclose(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs))
    scores = await engine.score([PROMPT + want.output_ids], [2])
    assert torch.allclose(torch.tensor(scores[0]), torch.tensor(want_scores[0]), atol=1e-5)
    assert got.output_versions == [engine.weight_version] * len(got.output_ids)
    assert await engine.health() and engine.load == 0


async def test_stream_arrives_incrementally_and_abort_ends_it(engine):
    params = SamplingParams(max_tokens=2000, ignore_eos=True, seed=3)
    stream = engine.stream(PROMPT, params, request_id="long")
    first = await anext(stream)
    # The first token is here while the request still runs: a buffered stream could not abort.
    assert first.finish_reason is None and len(first.token_ids) >= 1
    assert engine.load == 1
    await engine.abort("long")
    rest = [c async for c in stream]
    tokens = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
    assert rest[-1].finish_reason == "abort" and tokens < 2000
    assert engine.load == 0


async def test_a_reader_who_stops_early_frees_the_request(engine):
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    stream = engine.stream(PROMPT, params, request_id="walks-away")
    await anext(stream)
    await stream.aclose()  # what a cancelled gateway handler does
    assert engine.load == 0
    # The id is free again in the actor, so the request there was aborted.
    out = await engine.generate(PROMPT, GREEDY, request_id="walks-away")
    assert len(out.output_ids) >= 1


async def test_bad_input_raises_the_engines_value_error(engine, tiny_model_path):
    too_long = SamplingParams(max_tokens=engine.max_context)
    with pytest.raises(ValueError, match="max_tokens") as err:
        async for _ in engine.stream(PROMPT, too_long):
            pass
    assert type(err.value) is ValueError  # not Ray's wrapper
    assert "exceeds the context limit" in str(err.value) and "ray::" not in str(err.value)
    with pytest.raises(ValueError, match=r"start\[0\]"):
        await engine.score([PROMPT], [99])
    with pytest.raises(ValueError, match="input_ids"):
        await engine.generate([-1], GREEDY)
    with pytest.raises(ValueError, match="params"):
        engine.stream(PROMPT, {"max_tokens": 3})
    with pytest.raises(ValueError, match="dtype"):
        spawn_engine(EngineConfig(dtype="float7"), tiny_model_path)
    assert engine.load == 0 and await engine.health()


def test_ray_backend_trains_like_the_in_process_backend(backend, trainer_cfg):
    local = make_backend(trainer_cfg)
    step = backend.step
    for _ in range(step):  # other tests may have stepped the shared actor: catch up
        local.train_step(SAMPLES)
    want = local.train_step(SAMPLES)
    got = backend.train_step(SAMPLES)
    assert backend.step == local.step == step + 1
    assert set(got) == set(want)
    for key, value in want.items():
        if key.startswith("perf/"):  # FLOPs over wall time: two clocks, not two computations
            continue
        assert math.isclose(got[key], value, rel_tol=1e-4, abs_tol=1e-6), key
    lps = backend.logprobs(SAMPLES)
    for a, b in zip(lps, local.logprobs(SAMPLES), strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    with pytest.raises(ValueError, match="at least one sample"):
        backend.train_step([])


async def test_mesh_serves_the_backends_weights(ray_local, backend, tiny_model_path):
    """Backend actor -> engine actor over the planned route (shm: one host, CPU), bit-exact."""
    backend.train_step(SAMPLES)
    version = backend.step
    receiver = spawn_engine(EngineConfig(), tiny_model_path)
    before = await receiver.generate(PROMPT, GREEDY)
    mesh = TransferMesh(backend, [receiver])
    assert mesh.plan.sender.pid != receiver.placement.pid
    assert [route for _, route, _ in mesh.plan.entries] == ["shm"]
    report = await mesh.push(version)
    assert receiver.weight_version == version
    assert report.version == version and report.delivered == 1 and not report.failed
    state = backend.state_dict()  # a copy pulled into this process
    assert report.bytes == sum(t.numel() * 4 for n, t in state.items() if n != "lm_head.weight")
    assert report.seconds > 0 and report.gb_per_s > 0

    after = await receiver.generate(PROMPT, GREEDY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine actor (one Ray CPU): MKL then sums in the same order
    try:
        async with LocalEngine(tiny_model_path) as local:
            await local.update_weights(state, version)
            want = await local.generate(PROMPT, GREEDY)
    finally:
        torch.set_num_threads(threads)
    assert after.output_ids == want.output_ids
    assert after.output_logprobs == want.output_logprobs  # the same weights, bit for bit
    # The tiny random model may keep its greedy tokens after one step; its log-probs move.
    assert not torch.allclose(
        torch.tensor(after.output_logprobs[:1]), torch.tensor(before.output_logprobs[:1])
    )
    assert after.output_versions == [version] * len(after.output_ids)
    retracting = TransferMesh(backend, [receiver], mode="abort_resubmit")
    again = await retracting.push(version + 1)
    await retracting.close()
    assert again.delivered == 1 and receiver.weight_version == version + 1

    # A push while a request streams: its later tokens carry the new version (partial rollout).
    # Paused in place around the push so the request cannot finish first on a fast machine.
    stream = receiver.stream(PROMPT, SamplingParams(max_tokens=1000, ignore_eos=True), "mid")
    versions = list((await anext(stream)).versions)
    await receiver.pause("in_place")
    await mesh.push(version + 2)
    await receiver.resume()
    aborted = False
    async for chunk in stream:
        versions += chunk.versions
        if versions[-1] == version + 2 and not aborted:
            aborted = True
            await receiver.abort("mid")
    assert versions[0] == version + 1 and versions[-1] == version + 2
    assert versions == sorted(versions) and len(versions) < 1000
    await mesh.close()

    # Behind the gateway's Router like any engine; closing the router ends the actor.
    router = Router([receiver])
    routed = await router.generate(PROMPT, GREEDY, session_id="s1")
    assert routed.output_ids == want.output_ids and router.weight_version == version + 2
    await router.close()  # the actor is gone: calls are engine errors, health is False
    # (ray.kill is asynchronous: a call just after it may still reach the closed engine)
    with pytest.raises(EngineError, match="engine actor|engine is closed"):
        await receiver.generate(PROMPT, GREEDY)
    assert not await receiver.health()


def test_ray_backend_checkpoints_round_trip(backend, tmp_path):
    backend.save_checkpoint(tmp_path / "ckpt", {"data": [1, 2]})
    step = backend.step
    before = backend.logprobs(SAMPLES)
    backend.train_step(SAMPLES)
    assert backend.load_checkpoint(tmp_path / "ckpt") == {"data": [1, 2]}
    assert backend.step == step
    assert backend.logprobs(SAMPLES) == before
    backend.save_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    with pytest.raises(ValueError, match="run.resume"):
        backend.load_checkpoint(tmp_path / "missing")
