"""Every error path of the gateway: status, OpenAI error shape, the field named; no 500s."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from gateway.engines.local import LocalEngine
from gateway.server import Gateway, GatewayConfig, RequestLimits
from gateway.server.auth import open_session_id

MODEL = "tiny-random"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = LocalEngine(tiny_model_path, max_context=256)
    yield eng
    asyncio.run(eng.close())


def make(engine, renderer, path, **cfg) -> Gateway:
    cfg.setdefault("auth", "keys")
    cfg.setdefault("admin_token", "admin")
    return Gateway(engine, path, GatewayConfig(**cfg), renderer=renderer)


@pytest.fixture
async def gw(engine, renderer, tiny_model_path):
    gateway = make(
        engine, renderer, tiny_model_path, limits=RequestLimits(max_body_bytes=64 * 1024)
    )
    yield gateway
    await gateway.aclose()


def http(gateway: Gateway, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway.app), base_url="http://gw", headers=headers
    )


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def test_bad_requests_name_the_field(gw):
    _, key = gw.create_session()
    async with http(gw, key) as c:
        cases = [
            ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
            ({**CHAT, "messages": []}, "messages"),
            ({k: v for k, v in CHAT.items() if k != "messages"}, "messages"),
            ({**CHAT, "temperature": -1}, "temperature"),
            ({**CHAT, "top_p": 0}, "top_p"),
            ({**CHAT, "n": 0}, "n"),
            ({**CHAT, "max_tokens": 0}, "max_tokens"),
            ({**CHAT, "max_tokens": 10_000}, "max_tokens"),
            ({**CHAT, "stop": [""]}, "stop"),
            ({**CHAT, "tool_choice": "required"}, "tool_choice"),
            (
                {
                    **CHAT,
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}},
                },
                "tool_choice",
            ),
            (
                {
                    **CHAT,
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}
                    ],
                },
                "messages.0.content",
            ),
            (
                {"model": MODEL, "messages": [{"role": "user", "content": "x " * 300}]},
                "messages",
            ),
        ]
        for body, param in cases:
            assert_error(await c.post("/v1/chat/completions", json=body), 400, param)
        r = await c.post("/v1/chat/completions", content=b"{not json")
        assert assert_error(r, 400)["code"] == "invalid_json"
        assert_error(await c.post("/v1/chat/completions", json=[1, 2]), 400)
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]})
        assert_error(r, 400, "prompt")
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert_error(r, 404, "model")


async def test_auth_keys_mode(gw):
    sid_a, key_a = gw.create_session()
    sid_b, key_b = gw.create_session()
    async with http(gw) as c:
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 401)
    async with http(gw, "wrong") as c:
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 401)
        # a session of someone else looks exactly like one that does not exist
        foreign = await c.get(f"/sessions/{sid_a}/trajectory")
        unknown = await c.get("/sessions/s-0000/trajectory")
        same = assert_error(unknown, 404)["message"].replace("s-0000", sid_a)
        assert assert_error(foreign, 404)["message"] == same
        assert_error(await c.post("/sessions", json={}), 401)
        assert_error(await c.get("/sessions"), 401)
    async with http(gw, "admin") as c:  # the admin token is not a session key
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 401)
    async with http(gw, key_a) as c:
        # a's key cannot use, read or score b's session
        assert_error(await c.post(f"/sessions/{sid_b}/v1/chat/completions", json=CHAT), 403)
        assert_error(await c.get(f"/sessions/{sid_b}/trajectory"), 404)
        assert_error(await c.post(f"/sessions/{sid_b}/reward", json={"reward": 1}), 401)
        assert_error(await c.post(f"/sessions/{sid_a}/close", json={}), 401)
        r = await c.post(f"/sessions/{sid_a}/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        assert (await c.get(f"/sessions/{sid_a}/trajectory")).status_code == 200
    assert len(gw.trajectory(sid_a).turns) == 1 and not gw.trajectory(sid_b).turns


async def test_admin_routes(gw):
    async with http(gw, "admin") as c:
        r = await c.post("/sessions", json={"metadata": {"task": 1}, "id": "run-1"})
        assert r.status_code == 201
        created = r.json()
        assert created["id"] == "run-1" and created["base_url"] == "http://gw/v1"
        assert created["session_base_url"] == "http://gw/sessions/run-1/v1"
        assert_error(await c.post("/sessions", json={"id": "run-1"}), 409, "id")
        assert_error(await c.post("/sessions", json={"bogus": 1}), 400, "bogus")
        assert_error(await c.post("/sessions/nope/reward", json={"reward": 1}), 404)
        assert_error(await c.get("/sessions/nope/trajectory"), 404)
        r = await c.post("/sessions/run-1/reward", json={"reward": "high"})
        assert_error(r, 400, "reward")
        async with http(gw, created["api_key"]) as agent:
            assert (await agent.post("/v1/chat/completions", json=CHAT)).status_code == 200
        r = await c.post("/sessions/run-1/reward", json={"reward": 0.5, "info": {"ok": True}})
        assert r.status_code == 200
        r = await c.post("/sessions/run-1/close", json={"status": "aborted", "reason": "timeout"})
        traj = r.json()
        assert traj["status"] == "aborted" and traj["reason"] == "timeout"
        assert traj["reward"] == 0.5 and traj["info"] == {"ok": True}
        assert traj["metadata"] == {"task": 1} and len(traj["turns"]) == 1
        assert set(traj["segments"][0]) == {"token_ids", "loss_mask", "logprobs", "versions"}
        async with http(gw, created["api_key"]) as agent:
            r = await agent.post("/v1/chat/completions", json=CHAT)
            assert assert_error(r, 409)["code"] == "session_closed"
        listed = (await c.get("/sessions")).json()["data"]
        assert [s["id"] for s in listed] == ["run-1"] and listed[0]["status"] == "aborted"
        assert (await c.get("/weight_version")).json() == {"weight_version": 0}


async def test_body_too_large(gw):
    _, key = gw.create_session()
    async with http(gw, key) as c:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
        assert_error(await c.post("/v1/chat/completions", json=big), 413)

        async def chunks():  # no content-length: the limit holds while streaming the body
            for _ in range(100):
                yield b" " * 1024

        assert_error(await c.post("/v1/chat/completions", content=chunks()), 413)


async def test_pause_is_503_with_retry_after(gw):
    _, key = gw.create_session()
    async with http(gw, "admin") as admin, http(gw, key) as c:
        assert (await admin.post("/pause", json={})).json() == {"paused": True}
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert_error(r, 503)
        assert r.headers["retry-after"] == "1"
        assert (await admin.post("/resume")).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_per_session_concurrency_limit(engine, renderer, tiny_model_path):
    gw = make(engine, renderer, tiny_model_path, max_concurrent_per_session=1)
    _, key = gw.create_session()
    _, other = gw.create_session()
    async with http(gw, key) as c, http(gw, other) as c2:
        slow = asyncio.create_task(
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "temperature": 1})
        )
        while gw.sessions.by_key(key).requests == 0:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert_error(r, 429)
        assert (await c2.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await slow).status_code == 200
    await gw.aclose()


async def test_unhealthy_engine_is_503(renderer, tiny_model_path):
    dead = LocalEngine(tiny_model_path)
    await dead.close()
    gw = make(dead, renderer, tiny_model_path, health_interval_s=0.05)
    _, key = gw.create_session()
    async with http(gw, key) as c:
        assert (await c.get("/health")).status_code in (200, 503)
        await asyncio.sleep(0.2)
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert_error(r, 503)
        assert "retry-after" in r.headers
    await gw.aclose()


async def test_open_mode_key_is_session(engine, renderer, tiny_model_path):
    gw = Gateway(engine, tiny_model_path, GatewayConfig(), renderer=renderer)
    async with http(gw, "agent-7") as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/sessions/agent-9/v1/chat/completions", json=CHAT)).status_code == 200
        traj = (await c.get("/sessions/agent-7/trajectory")).json()
        assert traj["session_id"] == open_session_id("agent-7") and len(traj["turns"]) == 1
    # ids derive from the keys and do not reveal them
    assert {s["id"] for s in gw.list_sessions()} == {
        open_session_id("agent-7"),
        open_session_id("agent-9"),
    }
    await gw.aclose()


async def test_open_mode_closes_idle_sessions(engine, renderer, tiny_model_path):
    """An idle open-mode session is closed and kept; its key, back later, starts a fresh one."""
    cfg = GatewayConfig(idle_session_s=0.3, health_interval_s=0.05)
    gw = Gateway(engine, tiny_model_path, cfg, renderer=renderer)
    async with http(gw, "agent-7") as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        for _ in range(40):
            await asyncio.sleep(0.05)
            if gw.sessions.by_key("agent-7") is None:  # closed and moved to <id>~1
                break
        old = (await c.get("/sessions/agent-7~1/trajectory")).json()
        assert old["status"] == "ok" and old["reason"].startswith("idle:")
        assert len(old["turns"]) == 1
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        fresh = (await c.get("/sessions/agent-7/trajectory")).json()
        archived = (await c.get("/sessions/agent-7~1/trajectory")).json()
    assert len(fresh["turns"]) == 1
    sid = open_session_id("agent-7")
    assert {s["id"]: s["status"] for s in gw.list_sessions()} == {sid: "open", sid + "~1": "ok"}
    assert archived["session_id"] == sid + "~1" and archived["turns"] == old["turns"]
    await gw.aclose()
    with pytest.raises(ValueError, match="idle_session_s"):
        GatewayConfig(idle_session_s=-1)


def _garbage(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**70, 1.5, float("1e308"), -0.0])
    if kind == 3:
        return rng.choice(["", "x", "user", "assistant", "tool", "function", "\x00", "é" * 3])
    if kind == 4:
        return rng.choice(["auto", "none", "required", "text", "tool_use", "tool_result"])
    if kind == 5:
        return rng.choice([[], {}])
    if kind == 6:
        return [_garbage(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = [
        "model", "messages", "role", "content", "tools", "tool_choice", "type", "function",
        "name", "arguments", "stream", "n", "stop", "max_tokens", "input", "prompt", "text",
        "tool_calls", "id", "input_schema", "system", "call_id", "output", "logprobs",
    ]  # fmt: skip
    return {rng.choice(keys): _garbage(rng, depth + 1) for _ in range(rng.randrange(5))}


def _mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    node = body
    for _ in range(rng.randrange(1, 4)):
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            if rng.random() < 0.5 or not isinstance(node[key], dict | list):
                node[key] = _garbage(rng)
                break
            node = node[key]
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if rng.random() < 0.5 or not isinstance(node[i], dict | list):
                node[i] = _garbage(rng)
                break
            node = node[i]
    return body


async def test_garbage_never_500(engine, renderer, tiny_model_path):
    gw = make(engine, renderer, tiny_model_path, auth="open", admin_token=None)
    rng = random.Random(0)
    valid = {
        "/v1/chat/completions": {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "u"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
        },
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        "/v1/responses": {"model": MODEL, "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "r"},
        ], "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", "parameters": {}}]},
        "/v1/messages": {"model": MODEL, "max_tokens": 2, "system": "s", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                          "content": "r"}]},
        ], "tools": [{"name": "f", "input_schema": {}}]},
        "/sessions": {"metadata": {}},
        "/sessions/x/reward": {"reward": 1.0},
        "/pause": {},
    }  # fmt: skip
    statuses = set()
    async with http(gw, "fuzz") as c:
        for path, body in valid.items():
            admin = path.startswith(("/sessions", "/pause"))
            key = {"Authorization": f"Bearer {gw.admin_token}"} if admin else {}
            r = await c.post(path, json=body, headers=key)
            assert r.status_code in (200, 201, 404), (path, r.text)
            await gw.resume()
            for _ in range(25):
                bad = _mutate(rng, body) if rng.random() < 0.8 else _garbage(rng)
                r = await c.post(path, content=json.dumps(bad), headers=key)
                statuses.add(r.status_code)
                assert r.status_code < 500 or r.status_code == 503, (path, bad, r.text)
                await gw.resume()
            for raw in [b"", b"\xff\xfe", b"null", b"[]", b'{"model": ', b"1e999999"]:
                r = await c.post(path, content=raw, headers=key)
                assert r.status_code < 500, (path, raw, r.text)
    assert 400 in statuses
    await gw.aclose()
