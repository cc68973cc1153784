"""The gateway tried as a hostile or careless client would (issue 17): every failure once seen
is a regression test here. The rules: no 5xx from client input, every error in OpenAI's shape
(Anthropic's under /v1/messages) naming the field, one request's numbers never harm another's,
admin routes behind the admin token, invalid requests create nothing, nothing is lost.

The property test of the whole HTTP surface is in `test_gateway_fuzz.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.engines.base import MIN_TEMPERATURE, DelegatingEngine, EngineError, SamplingParams
from gateway.server import Gateway, GatewayConfig, RequestLimits
from gateway.server.auth import open_session_id
from gateway.trajectory import TrajectoryLog, read_trajectories

MODEL = "tiny-random"
HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}


def make(engine, renderer, path, **cfg) -> Gateway:
    cfg.setdefault("admin_token", "admin")
    return Gateway(engine, path, GatewayConfig(**cfg), renderer=renderer)


@pytest.fixture
async def gw(engine, renderer, tiny_model_path):
    gateway = make(engine, renderer, tiny_model_path, auth="keys")
    yield gateway
    await gateway.aclose()


@pytest.fixture
async def open_gw(engine, renderer, tiny_model_path):
    gateway = make(engine, renderer, tiny_model_path, auth="open")
    yield gateway
    await gateway.aclose()


def client(gateway: Gateway, key: str | bytes | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": b"Bearer " + key if isinstance(key, bytes) else f"Bearer {key}"}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway.app),
        base_url="http://gw",
        headers=headers if key else {},
        timeout=120,
    )


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": [value]}
    return value


# ---------------------------------------------------------------------------------------------
# Numbers: temperature, NaN/inf, types


def test_tiny_temperatures_mean_greedy():
    for t in (0.0, 1e-300, 1e-40, 3.3e-39, MIN_TEMPERATURE / 2):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    for bad in (float("nan"), float("inf"), -1e-9, "0.5", True):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)


async def test_bystander_unharmed_by_tiny_temperatures(gw):
    """A request with temperature 1e-300 / 1e-40 / 3.3e-39 once failed the engine batch: another
    session's request (7 times in 10) and its running stream. Now it is greedy, and both the
    hostile requests and the bystander's stream succeed."""
    _, bystander = gw.create_session()
    _, hostile = gw.create_session()
    async with client(gw, bystander) as b, client(gw, hostile) as h:
        body = {**CHAT, "max_tokens": 48, "temperature": 1.0, "seed": 1, "stream": True}
        stream = b.stream("POST", "/v1/chat/completions", json=body)
        response = await stream.__aenter__()
        assert response.status_code == 200
        chunks = response.aiter_lines()
        await chunks.__anext__()  # the stream is running
        results = await asyncio.gather(
            *(
                h.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "temperature": t})
                for t in (1e-300, 1e-40, 3.3e-39, 0.0) * 3
            ),
            b.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "temperature": 0.7}),
        )
        rest = [line async for line in chunks]
        await stream.__aexit__(None, None, None)
    assert [r.status_code for r in results] == [200] * len(results)
    greedy = {r.json()["choices"][0]["message"]["content"] for r in results[:-1]}
    assert len(greedy) == 1  # every tiny temperature sampled exactly as temperature 0
    assert "data: [DONE]" in rest
    finishes = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert finishes[-1]["choices"][0]["finish_reason"] in ("length", "stop")


async def test_numbers_are_strict_and_finite(gw):
    _, key = gw.create_session()
    async with client(gw, key) as c, client(gw, "admin") as admin:
        cases = [
            ({**CHAT, "max_tokens": "10"}, "max_tokens"),
            ({**CHAT, "max_tokens": True}, "max_tokens"),
            ({**CHAT, "max_tokens": 2.0}, "max_tokens"),
            ({**CHAT, "stream": "yes"}, "stream"),
            ({**CHAT, "temperature": "0.5"}, "temperature"),
            ({**CHAT, "temperature": True}, "temperature"),
            ({**CHAT, "n": "2"}, "n"),
            ({**CHAT, "seed": 2**70}, "seed"),
            ({**CHAT, "top_k": False}, "top_k"),
        ]
        for body, param in cases:
            assert_error(await c.post("/v1/chat/completions", json=body), 400, param)
        for raw in (b'{"temperature": NaN}', b'{"temperature": Infinity}', b'{"x": 1e400}'):
            r = await c.post("/v1/chat/completions", content=raw)
            assert assert_error(r, 400)["code"] == "invalid_json"
        sid, _ = gw.create_session()
        for reward in ("NaN", "Infinity", True, "1", None):
            r = await admin.post(f"/sessions/{sid}/reward", json={"reward": reward})
            assert_error(r, 400, "reward")
        r = await admin.post(f"/sessions/{sid}/reward", content=b'{"reward": 1e400}')
        assert_error(r, 400)
        assert gw.trajectory(sid).reward is None
    for reward in (float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="reward"):
            gw.attach_reward(sid, reward)


async def test_engine_error_fails_only_its_own_request(engine, renderer, tiny_model_path):
    """An engine error on one request (e.g. a row whose logits went non-finite) ends that
    request alone, as a clean error; the bystander's stream and request go on."""

    class OneRowFails(DelegatingEngine):
        async def stream(self, ids, params, request_id=None, session_id=None):
            async for i, chunk in _enumerate(self.inner.stream(ids, params, request_id)):
                if params.seed == 666 and i == 1:
                    raise EngineError("non-finite logits in this request's row")
                yield chunk

    gw = Gateway(
        OneRowFails(engine), tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer
    )
    _, bystander = gw.create_session()
    _, victim = gw.create_session()
    body = {**CHAT, "max_tokens": 24, "temperature": 1.0}
    async with client(gw, bystander) as b, client(gw, victim) as v:
        plain_bad, stream_bad, plain_ok, stream_ok = await asyncio.gather(
            v.post("/v1/chat/completions", json={**body, "seed": 666}),
            v.post("/v1/chat/completions", json={**body, "seed": 666, "stream": True}),
            b.post("/v1/chat/completions", json={**body, "seed": 1}),
            b.post("/v1/chat/completions", json={**body, "seed": 2, "stream": True}),
        )
    assert assert_error(plain_bad, 503)["code"] == "engine_error"
    assert stream_bad.status_code == 200  # the error came after the first token: in the stream
    assert '"code":"engine_error"' in stream_bad.text and "[DONE]" not in stream_bad.text
    assert plain_ok.status_code == 200 and plain_ok.json()["usage"]["completion_tokens"] > 1
    assert stream_ok.text.endswith("data: [DONE]\n\n")
    await gw.aclose()


async def _enumerate(aiter):
    i = 0
    async for x in aiter:
        yield i, x
        i += 1


# ---------------------------------------------------------------------------------------------
# Sizes and counts


async def test_deep_nesting_is_400_and_leaves_nothing_broken(gw):
    """JSON nested ~253+ levels once answered 500 and broke the session for good."""
    sid, key = gw.create_session()
    deep = nested(300)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    async with client(gw, key) as c, client(gw, "admin") as admin:
        bodies = [
            ("/v1/chat/completions", {**CHAT, "tools": [tool]}),
            (
                "/v1/chat/completions",
                {**CHAT, "messages": [*HI, {"role": "assistant", "tool_calls": [call]}]},
            ),
            ("/v1/responses", {"model": MODEL, "input": "hi", "metadata": deep}),
        ]
        for path, body in bodies:
            assert assert_error(await c.post(path, json=body), 400)["code"] == "too_deep"
        r = await admin.post(f"/sessions/{sid}/reward", json={"reward": 1, "info": deep})
        assert assert_error(r, 400)["code"] == "too_deep"
        r = await admin.post("/sessions", json={"metadata": deep})
        assert_error(r, 400)
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await admin.get("/sessions")).status_code == 200
        assert (await admin.get(f"/sessions/{sid}/trajectory")).status_code == 200
        assert (await admin.post(f"/sessions/{sid}/close")).status_code == 200


async def test_counts_and_lengths_are_limited_on_every_surface(engine, renderer, tiny_model_path):
    limits = RequestLimits(max_messages=8, max_tools=2, max_tool_schema_bytes=2048, max_n=4)
    gw = make(engine, renderer, tiny_model_path, auth="keys", limits=limits, max_tokens_limit=64)
    _, key = gw.create_session()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    big = {"type": "function", "function": {"name": "g", "description": "x" * 4000}}
    async with client(gw, key) as c:
        chat = [
            ({**CHAT, "stop": ["x"] * 17}, "stop"),
            ({**CHAT, "stop": "y" * 300}, "stop"),
            ({**CHAT, "n": 5}, "n"),
            ({**CHAT, "messages": HI * 9}, "messages"),
            ({**CHAT, "tools": [tool] * 3}, "tools"),
            ({**CHAT, "tools": [big]}, "tools.0"),
            ({**CHAT, "max_tokens": 65}, "max_tokens"),
        ]
        for body, param in chat:
            assert_error(await c.post("/v1/chat/completions", json=body), 400, param)
        messages = {"model": MODEL, "max_tokens": 2, "messages": HI}
        r = await c.post("/v1/messages", json={**messages, "stop_sequences": ["s"] * 10_000})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "stop_sequences" in r.json()["error"]["message"]
        r = await c.post("/v1/messages", json={**messages, "max_tokens": 65})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        responses = {"model": MODEL, "input": [{"role": "user", "content": "x"}] * 9}
        assert_error(await c.post("/v1/responses", json=responses), 400, "input")
        r = await c.post("/v1/responses", json={**responses, "input": "x", "max_output_tokens": 99})
        assert_error(r, 400, "max_output_tokens")
        r = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["a"] * 17}
        )
        assert_error(r, 400, "stop")
    await gw.aclose()


async def test_absent_max_tokens_is_the_configured_default(engine, renderer, tiny_model_path):
    """No max_tokens once meant the rest of the context (4,065 tokens, 41 s for one call)."""
    gw = make(engine, renderer, tiny_model_path, auth="keys", default_max_tokens=5)
    sid, key = gw.create_session()
    async with client(gw, key) as c:
        body = {"model": MODEL, "messages": HI, "temperature": 1.0, "seed": 3}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "hi", "seed": 3})
        assert r.status_code == 200
    assert all(len(t.output_ids) <= 5 for t in gw.trajectory(sid).turns)
    assert len(gw.trajectory(sid).turns) == 2
    await gw.aclose()


async def test_large_input_is_refused_or_tokenized_off_the_loop(open_gw, monkeypatch):
    """A 15 MB body once blocked the event loop for 30-40 s (/health stalled for everyone)."""
    async with client(open_gw, "big") as c:
        # far over the context: refused without tokenizing
        huge = {**CHAT, "messages": [{"role": "user", "content": "x " * 7_000_000}]}
        started = time.monotonic()
        r = await c.post("/v1/chat/completions", json=huge)
        assert assert_error(r, 400, "messages")["code"] == "context_length_exceeded"
        assert time.monotonic() - started < 30
        # within the bound but over the context: tokenized on a worker thread while the loop
        # answers others. The tokenizer waits for /health to answer first: on the loop it
        # would wait in vain (and /health answer only after it), whatever the machine's speed.
        entered, answered, in_time = threading.Event(), threading.Event(), []
        render = open_gw.renderer.render

        def gated(*args, **kwargs):
            entered.set()
            in_time.append(answered.wait(60))
            return render(*args, **kwargs)

        monkeypatch.setattr(open_gw.renderer, "render", gated)
        big = {**CHAT, "messages": [{"role": "user", "content": "x " * 150_000}]}
        task = asyncio.create_task(c.post("/v1/chat/completions", json=big))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).status_code == 200
        answered.set()
        assert_error(await task, 400, "messages")
        assert in_time == [True], "the tokenizer held the event loop: /health waited for it"
    assert open_gw.list_sessions() == []  # nothing was created by the refused requests


# ---------------------------------------------------------------------------------------------
# Auth


async def test_open_mode_admin_routes_need_the_admin_token(open_gw):
    async with client(open_gw, "alice") as alice, client(open_gw, "admin") as admin:
        assert (await alice.post("/v1/chat/completions", json=CHAT)).status_code == 200
        sid = open_session_id("alice")
        async with client(open_gw, "mallory") as mallory:
            for method, path, body in [
                ("POST", "/pause", {}),
                ("POST", "/resume", None),
                ("GET", "/weight_version", None),
                ("GET", "/sessions", None),
                ("POST", "/sessions", {}),
                ("POST", f"/sessions/{sid}/close", {}),
                ("POST", f"/sessions/{sid}/reward", {"reward": 1}),
            ]:
                r = await mallory.request(method, path, json=body)
                assert_error(r, 401)
            # another's session and a missing one look the same
            for path in (f"/sessions/{sid}", f"/sessions/{sid}/trajectory", "/sessions/alice"):
                assert_error(await mallory.get(path), 404)
            assert_error(await mallory.get("/sessions/o-nothing/trajectory"), 404)
        assert not open_gw.paused
        listed = (await admin.get("/sessions")).json()["data"]
        assert [s["id"] for s in listed] == [sid]
        assert "alice" not in json.dumps(listed)  # listings never reveal keys
        assert (await alice.get("/sessions/alice/trajectory")).json()["session_id"] == sid
        assert (await admin.get(f"/sessions/{sid}/trajectory")).status_code == 200


async def test_non_ascii_keys_are_refused_not_500(gw, open_gw):
    for gateway in (gw, open_gw):
        sid, _ = gateway.create_session()
        for key in ("Bearer ключ".encode(), b"Bearer \xff\xfe", "é".encode()):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gateway.app),
                base_url="http://gw",
                headers={"Authorization": key},
            ) as c:
                assert_error(await c.get("/sessions"), 401)
                assert_error(await c.post("/pause", json={}), 401)
                assert_error(await c.get(f"/sessions/{sid}/trajectory"), 404)
                r = await c.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == (401 if gateway is gw else 200), r.text


async def test_invalid_requests_create_nothing(open_gw):
    async with client(open_gw, "x") as c:
        for i in range(50):
            async with client(open_gw, f"garbage-{i}") as g:
                await g.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0})
                await g.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
                await g.post("/v1/messages", json={"model": MODEL, "messages": HI})
                await g.post("/v1/completions", content=b"{")
                await g.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**6})
                named = {"type": "function", "function": {"name": "missing"}}
                await g.post("/v1/chat/completions", json={**CHAT, "tool_choice": named})
        assert open_gw.list_sessions() == []
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(open_gw.list_sessions()) == 1


async def test_session_ids_are_validated(gw):
    async with client(gw, "admin") as admin:
        for bad in ("a/b", "", "x" * 201, "o-reserved", "~1", "sp ace", "ü"):
            assert_error(await admin.post("/sessions", json={"id": bad}), 400, "id")
        r = await admin.post("/sessions", json={"id": "run-1.a:b"})
        assert r.status_code == 201
        assert (await admin.get("/sessions/run-1.a:b/trajectory")).status_code == 200
    with pytest.raises(ValueError, match="session id"):
        gw.create_session(session_id="a/b")


async def test_closed_open_mode_session_frees_its_key(open_gw):
    """A session closed through the admin route once locked its key out with 409 for good."""
    async with client(open_gw, "bob") as bob, client(open_gw, "admin") as admin:
        assert (await bob.post("/v1/chat/completions", json=CHAT)).status_code == 200
        sid = open_session_id("bob")
        closed = (await admin.post(f"/sessions/{sid}/close", json={"reason": "done"})).json()
        assert closed["session_id"] == sid + "~1" and len(closed["turns"]) == 1
        assert (await bob.post("/v1/chat/completions", json=CHAT)).status_code == 200
        fresh = (await bob.get("/sessions/bob/trajectory")).json()
        assert fresh["session_id"] == sid and len(fresh["turns"]) == 1
        assert (await bob.get("/sessions/bob~1/trajectory")).json()["reason"] == "done"


async def test_errors_of_the_router_are_in_the_api_shape(gw):
    async with client(gw, "admin") as c:
        assert_error(await c.get("/v2/nothing"), 404)
        assert_error(await c.get("/v1/chat/completions"), 405)
        assert_error(await c.delete("/sessions"), 405)
        r = await c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"


# ---------------------------------------------------------------------------------------------
# Disconnects, shutdown, the durable log


async def _raw_post(port: int, path: str, body: dict, key: str) -> tuple:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer


async def test_non_streaming_request_is_aborted_when_its_client_leaves(gw):
    server = await gw.start_http()
    try:
        sid, key = gw.create_session()
        body = {**CHAT, "max_tokens": 3000, "temperature": 1.0}
        _, writer = await _raw_post(server.port, "/v1/chat/completions", body, key)
        session = gw.sessions.get(sid)
        while not session.request_ids:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # some tokens, far from 3000
        writer.close()
        for _ in range(500):
            if session.requests == 0:
                break
            await asyncio.sleep(0.02)
        traj = gw.trajectory(sid)
        (turn,) = traj.turns
        assert turn.finish_reason == "abort" and 0 < len(turn.output_ids) < 3000
        assert not turn.delivered and traj.segments == []  # never trained on
    finally:
        await server.stop()


async def test_headers_are_limited_in_size_and_time(engine, renderer, tiny_model_path):
    gw = make(
        engine,
        renderer,
        tiny_model_path,
        header_timeout_s=0.5,
        body_timeout_s=0.5,
        max_header_bytes=4096,
    )
    server = await gw.start_http()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 8000 + b"\r\n\r\n")
        assert (await reader.read(100)).startswith(b"HTTP/1.1 431")
        writer.close()
        # a client trickling its headers is cut off, and so is one that says nothing
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /health HTTP/1.1\r\n")

        async def trickle() -> None:
            while not writer.is_closing():
                writer.write(b"x")
                await asyncio.sleep(0.1)

        drip = asyncio.create_task(trickle())
        answer = await asyncio.wait_for(reader.read(), 10)
        drip.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        # a body that never completes is cut off too
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 100\r\n\r\n{")
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 408") and b"body" in answer, answer
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await asyncio.wait_for(reader.read(), 10) == b""
        async with httpx.AsyncClient(base_url=server.base_url) as c:
            assert (await c.get("/health")).status_code == 200
    finally:
        await server.stop()
        await gw.aclose()


async def test_log_dir_keeps_every_trajectory(engine, renderer, tiny_model_path, tmp_path):
    gw = make(engine, renderer, tiny_model_path, auth="keys", log_dir=str(tmp_path))
    done, key1 = gw.create_session({"n": 1})
    running, key2 = gw.create_session({"n": 2})
    async with client(gw, key1) as c1, client(gw, key2) as c2:
        assert (await c1.post("/v1/chat/completions", json=CHAT)).status_code == 200
        gw.attach_reward(done, 0.5)
        await gw.close_session(done)
        path = tmp_path / "trajectories.jsonl"
        (first,) = read_trajectories(path)
        assert first.session_id == done and first.reward == 0.5 and len(first.turns) == 1
        slow = asyncio.create_task(
            c2.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3000, "temperature": 1})
        )
        while not gw.sessions.get(running).request_ids:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await gw.shutdown(grace_s=0.3)
        assert time.monotonic() - started < 30
        assert (await slow).status_code == 200  # cut short, not failed
        assert_error(await c2.post("/v1/chat/completions", json=CHAT), 503)
    first, second = read_trajectories(path)
    assert (second.session_id, second.status, second.reason) == (running, "aborted", "shutdown")
    assert second.turns[0].finish_reason == "abort"
    with open(path, "ab") as f:  # a crash in the middle of a write loses only that line
        f.write(b'{"session_id": "cut')
    assert [t.session_id for t in read_trajectories(path)] == [done, running]
    TrajectoryLog(path).append(first)  # a restarted gateway appends after the torn line
    assert [t.session_id for t in read_trajectories(path)] == [done, running, done]
    await gw.aclose()


# ~25 MB of SSE (4 choices x 4000 tokens x 20 top logprobs): more than the socket buffers hold,
# so a client that reads one line keeps the request in flight. Seeded: the tiny model samples its
# EOS with p ~2e-5 a token, so an unseeded choice ended as `stop` before the cut in a few runs
# in a hundred; seeds 0-3 give 4000 tokens each without one.
HUGE_STREAM = {
    **CHAT,
    "max_tokens": 4000,
    "n": 4,
    "temperature": 1.0,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
    "seed": 0,
}


@contextlib.contextmanager
def _hold_stream(url: str, key: str) -> Iterator[socket.socket]:
    """Send HUGE_STREAM, read its first bytes and no more: the reply stays in flight."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(HUGE_STREAM).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        yield sock


def _start_serve(*args: str) -> tuple[subprocess.Popen, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve", "model=tiny", "port=0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "admin token:" in line:
            return proc, "".join(lines)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("".join(lines))


def test_serve_token_file_drain_and_second_signal(tmp_path):
    proc, out = _start_serve("shutdown_grace_s=60", f"log_dir={tmp_path / 'log'}")
    token_file = out.split("(also in ")[1].split(")")[0]
    try:
        url = out.split("OPENAI_BASE_URL=")[1].split("/v1")[0]
        token = out.split("admin token: ")[1].split(" ")[0]
        assert open(token_file).read().strip() == token
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/sessions").status_code == 401
            assert (
                c.get("/sessions", headers={"Authorization": f"Bearer {token}"}).status_code == 200
            )
            with _hold_stream(url, "long"):
                proc.send_signal(signal.SIGTERM)  # drains: would wait up to 60 s
                time.sleep(1)
                assert proc.poll() is None
                assert c.get("/health").status_code == 200
                refused = c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "k2"})
                assert refused.status_code == 503
                proc.send_signal(signal.SIGTERM)  # the second signal: now
                assert proc.wait(10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if os.path.exists(token_file):  # an exit "at once" leaves it
            os.unlink(token_file)


def test_serve_sigterm_drain_is_bounded_and_logged(tmp_path):
    log = tmp_path / "log"
    proc, out = _start_serve("shutdown_grace_s=1", f"log_dir={log}")
    try:
        url = out.split("OPENAI_BASE_URL=")[1].split("/v1")[0]
        token_file = out.split("(also in ")[1].split(")")[0]
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "a"}).is_success
            with _hold_stream(url, "b"):
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0 and time.monotonic() - started < 30
        trajs = {t.session_id: t for t in read_trajectories(log / "trajectories.jsonl")}
        assert set(trajs) == {open_session_id("a") + "~1", open_session_id("b") + "~1"}
        assert all((t.status, t.reason) == ("aborted", "shutdown") for t in trajs.values())
        cut = trajs[open_session_id("b") + "~1"].turns
        assert len(cut) == 4 and all(t.finish_reason == "abort" for t in cut)
        assert not os.path.exists(token_file)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
