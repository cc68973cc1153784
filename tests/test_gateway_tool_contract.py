"""Issue 18, gateway side: a session's forced max_tokens cap, and the tool-call contract.

- A session created with `sampling.max_tokens` caps every call: a request asking for more, or
  for nothing, is cut at the cap; each turn logs the cap used and what the agent asked for.
- With a forced `tool_choice` (required or named), a reply that does not parse into a valid call
  is a failed call (the model's raw text as `arguments`, never content: the opening text is the
  gateway's prefill, not the model's); as OpenAI returns a forced call that was cut short.
- A reply cut by max_tokens reports `length` (Responses: incomplete; Anthropic: max_tokens) even
  when a call parsed before the cut, on all four surfaces, streaming and not; the trajectory
  keeps the true finish reason.

The tool-call tests need model output that is exactly a given text, which no real model can be
made to write on demand: `ScriptedEngine` (tests/engine_oracle.py) replays the token ids of a text,
cut at the request's max_tokens with `length`, as an engine would. The cap tests use the real
tiny model.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from engine_oracle import ScriptedEngine

from gateway.server import Gateway, GatewayConfig

MODEL = "tiny-random"
HI = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PREFILL = '<tool_call>\n{"name": "'  # what the gateway writes for tool_choice=required


@pytest.fixture
async def scripted(renderer, tiny_model_path):
    engine = ScriptedEngine()
    gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer)
    yield gw, engine
    await gw.aclose()


def body(surface: str, choice: str, stream: bool, max_tokens: int) -> tuple[str, dict]:
    """The request of `surface` with tool_choice `choice` (auto, required or named)."""
    if surface == "chat":
        tc = {"required": "required", "auto": "auto"}.get(
            choice, {"type": "function", "function": {"name": TOOL["name"]}}
        )
        return "/v1/chat/completions", {
            "model": MODEL, "messages": HI, "max_tokens": max_tokens, "stream": stream,
            "tools": [{"type": "function", "function": TOOL}], "tool_choice": tc,
        }  # fmt: skip
    if surface == "responses":
        tc = {"required": "required", "auto": "auto"}.get(
            choice, {"type": "function", "name": TOOL["name"]}
        )
        return "/v1/responses", {
            "model": MODEL, "input": HI, "max_output_tokens": max_tokens, "stream": stream,
            "tools": [{"type": "function", **TOOL}], "tool_choice": tc,
        }  # fmt: skip
    tc = {"required": {"type": "any"}, "auto": {"type": "auto"}}.get(
        choice, {"type": "tool", "name": TOOL["name"]}
    )
    tool = {"name": TOOL["name"], "description": TOOL["description"]}
    return "/v1/messages", {
        "model": MODEL, "messages": HI, "max_tokens": max_tokens, "stream": stream,
        "tools": [{**tool, "input_schema": TOOL["parameters"]}], "tool_choice": tc,
    }  # fmt: skip


def events(text: str) -> list[dict]:
    return [
        orjson.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def read(surface: str, stream: bool, r: httpx.Response) -> tuple[str | None, list, str]:
    """(content, [(name, arguments)], finish) of any surface's reply, streamed or not."""
    assert r.status_code == 200, r.text
    if surface == "chat":
        if not stream:
            choice = r.json()["choices"][0]
            msg = choice["message"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"])
                for c in msg.get("tool_calls") or []
            ]
            return msg["content"], calls, choice["finish_reason"]
        content, calls, finish = "", [], None
        for ev in events(r.text):
            for c in ev["choices"]:
                content += c["delta"].get("content") or ""
                calls += [
                    (t["function"]["name"], t["function"]["arguments"])
                    for t in c["delta"].get("tool_calls") or []
                ]
                finish = c["finish_reason"] or finish
        return content or None, calls, finish
    if surface == "responses":
        resp = r.json() if not stream else events(r.text)[-1]["response"]
        text = "".join(
            p["text"]
            for item in resp["output"]
            if item["type"] == "message"
            for p in item["content"]
        )
        calls = [
            (i["name"], i["arguments"]) for i in resp["output"] if i["type"] == "function_call"
        ]
        finish = "length" if resp["status"] == "incomplete" else ("tool_calls" if calls else "stop")
        return text or None, calls, finish
    if not stream:
        msg = r.json()
        blocks = msg["content"]
    else:
        blocks, msg = [], {}
        for ev in events(r.text):
            if ev["type"] == "content_block_start":
                blocks.append(dict(ev["content_block"]))
            elif ev["type"] == "content_block_delta" and ev["delta"]["type"] == "text_delta":
                blocks[-1]["text"] += ev["delta"]["text"]
            elif ev["type"] == "content_block_delta":
                blocks[-1]["input"] = orjson.loads(ev["delta"]["partial_json"])
            elif ev["type"] == "message_delta":
                msg["stop_reason"] = ev["delta"]["stop_reason"]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [
        (b["name"], orjson.dumps(b["input"]).decode()) for b in blocks if b["type"] == "tool_use"
    ]
    finish = {"max_tokens": "length", "tool_use": "tool_calls"}.get(msg["stop_reason"], "stop")
    return text or None, calls, finish


SURFACES = ["chat", "responses", "messages"]
CALL = 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("surface", SURFACES)
async def test_cut_after_a_call_reports_length(scripted, renderer, surface, stream):
    gw, engine = scripted
    sid, key = gw.create_session()
    cases = [  # (tool_choice, model output): a complete call, then more, cut by max_tokens
        ("required", CALL + "The weather is"),
        ("named", 'city": "Paris"}}\n</tool_call>\nThe weather is'),
        ("auto", "<tool_call>\n" + '{"name": "' + CALL + "The weather is"),
    ]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app),
        base_url="http://gw",
        headers={"Authorization": f"Bearer {key}", "x-api-key": key},
    ) as c:
        for choice, text in cases:
            engine.script = renderer.encode(text)
            cut = len(engine.script) - 2  # inside "The weather is"
            path, payload = body(surface, choice, stream, cut)
            r = await c.post(path, json=payload)
            content, calls, finish = read(surface, stream, r)
            assert finish == "length", (choice, r.text)
            assert [name for name, _ in calls] == ["get_weather"], (choice, r.text)
            assert orjson.loads(calls[0][1]) == {"city": "Paris"}
            assert gw.trajectory(sid).turns[-1].finish_reason == "length"
            # and uncut, the same reply is a call
            engine.script = renderer.encode(text.split("The weather")[0])
            path, payload = body(surface, choice, stream, 100)
            r = await c.post(path, json=payload)
            assert read(surface, stream, r)[2] == "tool_calls"
            assert gw.trajectory(sid).turns[-1].finish_reason == "tool_calls"


async def test_completions_cut_reports_length(scripted, renderer):
    gw, engine = scripted
    sid, key = gw.create_session()
    engine.script = renderer.encode("Once upon a time there was")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app),
        base_url="http://gw",
        headers={"Authorization": f"Bearer {key}"},
    ) as c:
        for stream in (False, True):
            r = await c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": stream},
            )
            replies = events(r.text) if stream else [r.json()]
            finishes = [ch["finish_reason"] for ev in replies for ch in ev["choices"]]
            assert "length" in finishes and "stop" not in finishes, r.text
    assert [t.finish_reason for t in gw.trajectory(sid).turns] == ["length", "length"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("surface", SURFACES)
async def test_forced_choice_never_returns_prefill_as_content(scripted, renderer, surface, stream):
    gw, engine = scripted
    _, key = gw.create_session()
    cases = [  # (tool_choice, model output, max_tokens, finish, arguments the client gets)
        ("required", 'get_weather", "arguments": {"city": "Par', 100, "tool_calls", '{"city": "Par'),
        ("required", 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nok', 9, "length", None),
        ("required", 'get_weather", "arguments": {city: Paris}}\n</tool_call>', 100, "tool_calls", "{city: Paris}}"),
        ("named", 'city": "Par', 100, "tool_calls", '{"city": "Par'),
        ("named", "\n\n\n", 100, "tool_calls", '{"'),
    ]  # fmt: skip
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app),
        base_url="http://gw",
        headers={"Authorization": f"Bearer {key}", "x-api-key": key},
    ) as c:
        for choice, text, max_tokens, finish, arguments in cases:
            engine.script = renderer.encode(text)
            path, payload = body(surface, choice, stream, max_tokens)
            r = await c.post(path, json=payload)
            content, calls, got_finish = read(surface, stream, r)
            assert "<tool_call>" not in r.text and PREFILL.strip() not in (content or "")
            assert not content, (choice, text, r.text)
            assert len(calls) == 1 and calls[0][0] == "get_weather", r.text
            assert got_finish == finish, (choice, text, r.text)
            if arguments is not None and surface != "messages":
                assert calls[0][1] == arguments  # the model's own text, as a failed call
            if surface == "messages":  # input must be an object: the raw text, marked
                assert "invalid_json" in calls[0][1] or max_tokens == 9


async def test_session_max_tokens_cap(engine, renderer, tiny_model_path):
    gw = Gateway(
        engine, tiny_model_path, GatewayConfig(auth="keys", admin_token="adm"), renderer=renderer
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app), base_url="http://gw", timeout=60
    ) as c:
        created = await c.post(
            "/sessions",
            json={"sampling": {"temperature": 1.0, "max_tokens": 4}},
            headers={"Authorization": "Bearer adm"},
        )
        assert created.status_code == 201
        sid, key = created.json()["id"], created.json()["api_key"]
        agent = {"Authorization": f"Bearer {key}"}
        for asked in (None, 100, 2):
            chat = {"model": MODEL, "messages": HI, "seed": 5}
            if asked is not None:
                chat["max_tokens"] = asked
            r = await c.post("/v1/chat/completions", json=chat, headers=agent)
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] <= min(4, asked or 4)
        r = await c.post(
            "/v1/messages",
            json={"model": MODEL, "messages": HI, "max_tokens": 4000},
            headers={"x-api-key": key},
        )
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= 4
        bad = await c.post(
            "/sessions",
            json={"sampling": {"max_tokens": 0}},
            headers={"Authorization": "Bearer adm"},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling.max_tokens"
    turns = gw.trajectory(sid).turns
    assert [(t.max_tokens, t.asked_max_tokens) for t in turns] == [
        (4, None), (4, 100), (2, 2), (4, 4000),
    ]  # fmt: skip
    assert all(len(t.output_ids) <= t.max_tokens for t in turns)
    with pytest.raises(ValueError, match="max_tokens"):
        gw.create_session(sampling={"max_tokens": -1})
    await gw.aclose()
