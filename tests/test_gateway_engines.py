"""The gateway over each engine kind `make_engine` builds, and its engine-facing behaviour:
streamed `n > 1`, close aborting in-flight requests (their tokens still logged), pause with an
engine mode, Prometheus metrics.

`kind=sglang` runs against two fake SGLang servers (SGLang needs a GPU), through the real
`Router` and `SGLangEngine` clients.
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from fake_sglang import serve_fake

from gateway.engines import EngineConfig, make_engine
from gateway.engines.base import DelegatingEngine, Engine, SamplingParams
from gateway.engines.local import LocalEngine
from gateway.server import Gateway, GatewayConfig

MODEL = "tiny-random"


def test_engine_config_checks():
    with pytest.raises(ValueError, match="engine.urls"):
        EngineConfig(kind="sglang")
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)


async def test_make_local_engine(tiny_model_path):
    engine = make_engine(EngineConfig(max_context=512), tiny_model_path)
    try:
        assert isinstance(engine, LocalEngine) and engine.max_context == 512
    finally:
        await engine.close()


async def test_a_delegating_engine_forwards_the_protocol(engine):
    """Every call of a `DelegatingEngine` reaches the inner engine, and its `generate` goes
    through its own `stream`, so a subclass that overrides `stream` sees every generation."""
    seen = []

    class Watching(DelegatingEngine):
        def stream(self, input_ids, params, request_id=None, session_id=None):
            seen.append(list(input_ids))
            return super().stream(input_ids, params, request_id, session_id)

    wrapped = Watching(engine)
    assert isinstance(wrapped, Engine)
    params = SamplingParams(max_tokens=5, temperature=0)
    ours = await wrapped.generate([1, 2, 3], params)
    assert ours.output_ids == (await engine.generate([1, 2, 3], params)).output_ids
    assert seen == [[1, 2, 3]]
    assert (wrapped.weight_version, wrapped.max_context) == (
        engine.weight_version,
        engine.max_context,
    )
    assert await wrapped.score([[1, 2, 3]], [1]) == await engine.score([[1, 2, 3]], [1])
    assert await wrapped.health() and wrapped.load == 0
    assert wrapped.weights().keys() == engine.weights().keys()  # beyond the protocol


async def test_gateway_over_sglang_router(renderer, tiny_model_path):
    with serve_fake() as url1, serve_fake("--incremental") as url2:
        engine = make_engine(EngineConfig(kind="sglang", urls=[url1, url2]), tiny_model_path)
        gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer)
        try:
            sessions = [gw.create_session() for _ in range(4)]

            async def run(key: str) -> list[str]:
                client = gw.openai_client(key)
                messages = [{"role": "user", "content": "hello"}]
                outs = []
                for i in range(3):
                    r = await client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=12, temperature=1.0,
                        stream=i == 1,
                    )  # fmt: skip
                    if i == 1:
                        text = "".join([c.choices[0].delta.content or "" async for c in r
                                        if c.choices])  # fmt: skip
                    else:
                        text = r.choices[0].message.content
                    outs.append(text)
                    messages += [{"role": "assistant", "content": text},
                                 {"role": "user", "content": f"more {i}"}]  # fmt: skip
                return outs

            results = await asyncio.gather(*(run(key) for _, key in sessions))
            for (sid, _), outs in zip(sessions, results, strict=True):
                traj = await gw.close_session(sid)
                assert [gw.renderer.decode(t.output_ids) for t in traj.turns] == outs
                assert traj.forks == 0 and len(traj.segments) == 1
                assert all(len(t.output_logprobs) == len(t.output_ids) for t in traj.turns)
        finally:
            await gw.aclose()
            await engine.close()


@pytest.fixture
async def gw(engine, renderer, tiny_model_path):
    gateway = Gateway(
        engine, tiny_model_path, GatewayConfig(auth="keys", admin_token="adm"), renderer=renderer
    )
    yield gateway
    await gateway.aclose()


async def test_streamed_n_choices(gw):
    sid, key = gw.create_session()
    client = gw.openai_client(key)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3,
        temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    turns = gw.trajectory(sid).turns
    assert sorted(gw.renderer.decode(t.output_ids) for t in turns) == sorted(texts.values())
    assert set(finishes) == {0, 1, 2}
    assert usage.completion_tokens == sum(len(t.output_ids) for t in turns)


class NoEos(DelegatingEngine):
    """Never stops on EOS, so a reply sampled from the random tiny model cannot end by
    itself before the test closes its session."""

    def stream(self, input_ids, params, request_id=None, session_id=None):
        params = dataclasses.replace(params, ignore_eos=True)
        return super().stream(input_ids, params, request_id, session_id)


async def test_close_aborts_in_flight_and_logs_their_tokens(engine, renderer, tiny_model_path):
    gw = Gateway(NoEos(engine), tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer)
    try:
        await _close_aborts_in_flight(gw)
    finally:
        await gw.aclose()


async def _close_aborts_in_flight(gw):
    sid, key = gw.create_session()
    client = gw.openai_client(key, max_retries=0)
    task = asyncio.create_task(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "go"}],
            max_tokens=2000,
            temperature=1.0,
        )  # fmt: skip
    )
    session = gw.sessions.get(sid)
    while not session.request_ids:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    traj = await gw.close_session(sid, status="aborted", reason="timeout")
    r = await task
    (turn,) = traj.turns
    assert turn.finish_reason == "abort" and 0 < len(turn.output_ids) < 2000
    assert traj.status == "aborted" and traj.reason == "timeout"
    assert r.choices[0].message.content == gw.renderer.decode(turn.output_ids)


async def test_pause_with_engine_mode_and_metrics(gw):
    sid, key = gw.create_session()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app), base_url="http://gw"
    ) as c:
        agent = {"Authorization": f"Bearer {key}"}
        admin = {"Authorization": "Bearer adm"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
        assert (await c.post("/v1/chat/completions", json=body, headers=agent)).status_code == 200
        r = await c.post("/pause", json={"mode": "in_place"}, headers=admin)
        assert r.json() == {"paused": True} and gw.paused
        r = await c.post("/v1/chat/completions", json=body, headers=agent)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert (await c.post("/resume", headers=admin)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=body, headers=agent)).status_code == 200
        text = (await c.get("/metrics")).text
        assert (await c.get("/health")).json()["status"] == "ok"
    assert 'gateway_requests_total{endpoint="chat",status="200"} 2.0' in text
    assert 'gateway_requests_total{endpoint="chat",status="503"} 1.0' in text
    assert "gateway_output_tokens_total 6.0" in text
    assert "gateway_active_sessions 1.0" in text
    assert "gateway_segment_forks_total 0.0" in text
    assert "gateway_engine_healthy 1.0" in text
    assert "gateway_engine_queue_depth" in text
