"""`/v1/responses` and Anthropic `/v1/messages`: shapes, streaming events, token log, reuse.

Fast tests run the tiny model (text replies); the slow SmolLM2 tests force a tool call with
`tool_choice` and check the tool-call shapes of all three APIs and that the tool result turn
extends the same segment.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import orjson
import pytest

from gateway.engines.local import LocalEngine
from gateway.render import load_renderer
from gateway.server import Gateway, GatewayConfig

MODEL = "tiny-random"


@pytest.fixture
async def gw(engine, renderer, tiny_model_path):
    gateway = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer)
    yield gateway
    await gateway.aclose()


def client(gateway: Gateway, key: str, anthropic: bool = False) -> httpx.AsyncClient:
    headers = {"x-api-key": key} if anthropic else {"Authorization": f"Bearer {key}"}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway.app), base_url="http://gw", headers=headers
    )


def sse_events(text: str) -> list[dict]:
    return [
        orjson.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def test_responses_text_and_reuse(gw):
    sid, key = gw.create_session()
    async with client(gw, key) as c:
        body = {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": "Hello there",
            "max_output_tokens": 5,
            "temperature": 1.0,
            "seed": 1,
        }
        r = (await c.post("/v1/responses", json=body)).json()
        assert r["object"] == "response" and r["status"] == "incomplete"
        assert r["incomplete_details"] == {"reason": "max_output_tokens"}
        (item,) = r["output"]
        text = item["content"][0]["text"]
        assert item["type"] == "message" and item["role"] == "assistant"
        turn = gw.trajectory(sid).turns[0]
        assert text == gw.renderer.decode(turn.output_ids)
        assert r["usage"]["input_tokens"] == len(turn.prompt_ids)
        assert r["usage"]["output_tokens"] == len(turn.output_ids)
        # send the history back the way agent SDKs do: the output item, then a new user item
        body["input"] = [
            {"role": "user", "content": "Hello there"},
            item,
            {"role": "user", "content": [{"type": "input_text", "text": "And?"}]},
        ]
        body["stream"] = True
        stream = await c.post("/v1/responses", json=body)
        events = sse_events(stream.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == streamed
    traj = gw.trajectory(sid)
    assert streamed == gw.renderer.decode(traj.turns[1].output_ids)
    assert traj.forks == 0 and len(traj.segments) == 1


async def test_responses_function_items_render_as_tool_turns(gw):
    sid, key = gw.create_session()
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    body = {
        "model": MODEL,
        "tools": tools,
        "max_output_tokens": 2,
        "input": [
            {"role": "user", "content": "1+2"},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
            {"type": "reasoning", "summary": []},
            # a streamed reply lists its items in generation order: call first, then text
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2}'},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Then."}]},
            {"type": "function_call_output", "call_id": "c2", "output": "4"},
        ],
    }
    async with client(gw, key) as c:
        assert (await c.post("/v1/responses", json=body)).status_code == 200
        bad = {**body, "tools": [{"type": "web_search"}]}
        r = await c.post("/v1/responses", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0"
    prompt = gw.renderer.decode(gw.trajectory(sid).turns[0].prompt_ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in prompt
    assert "<tool_response>\n3\n</tool_response>" in prompt and '"name": "add"' in prompt
    # one assistant turn for the call + text pair, whatever their order
    assert 'assistant\nThen.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}' in prompt


async def test_anthropic_messages_and_stream(gw):
    sid, key = gw.create_session()
    async with client(gw, key, anthropic=True) as c:
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "Hi"}],
            "temperature": 1.0,
        }
        r = (await c.post("/v1/messages", json=body)).json()
        assert r["type"] == "message" and r["stop_reason"] == "max_tokens"
        text = r["content"][0]["text"]
        turn = gw.trajectory(sid).turns[0]
        assert text == gw.renderer.decode(turn.output_ids)
        assert r["usage"] == {"input_tokens": len(turn.prompt_ids), "output_tokens": 4}
        body["messages"] += [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": "More"},
        ]
        body["stream"] = True
        s = await c.post("/v1/messages", json=body)
        events = sse_events(s.text)
        # errors come back in Anthropic's shape on this route
        err = await c.post("/v1/messages", json={"model": MODEL, "messages": []})
        assert err.status_code == 400 and err.json()["type"] == "error"
        assert err.json()["error"]["type"] == "invalid_request_error"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    streamed = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    traj = gw.trajectory(sid)
    assert streamed == gw.renderer.decode(traj.turns[1].output_ids)
    assert events[-2]["usage"]["output_tokens"] == len(traj.turns[1].output_ids)
    assert traj.forks == 0 and len(traj.segments) == 1


async def test_anthropic_tool_blocks_render(gw):
    sid, key = gw.create_session()
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "1+2"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}],
            },
        ],
    }
    async with client(gw, key, anthropic=True) as c:
        assert (await c.post("/v1/messages", json=body)).status_code == 200
        bad = {**body, "messages": [{"role": "user", "content": [{"type": "image"}]}]}
        r = await c.post("/v1/messages", json=bad)
        assert r.status_code == 400 and "messages.0.content.0.type" in r.text
    prompt = gw.renderer.decode(gw.trajectory(sid).turns[0].prompt_ids)
    assert 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in prompt
    assert "\nuser\n<tool_response>\n3\n</tool_response>\nassistant\n" in prompt


# ------------------------------------------------------------------ SmolLM2: real tool calls

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    eng = LocalEngine(smollm2_path)
    yield eng, load_renderer(smollm2_path), smollm2_path
    asyncio.run(eng.close())


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_smollm2_forced_tool_call_all_apis(smol, stream):
    engine, renderer, path = smol
    gw = Gateway(engine, path, GatewayConfig(auth="keys"), renderer=renderer, model_name="m")
    question = "What is 17 + 25? Use the add tool."
    try:
        # chat completions: forced call, then the tool result extends the same segment
        sid, key = gw.create_session()
        oa = gw.openai_client(key)
        msgs = [{"role": "user", "content": question}]
        kw = dict(model="m", tools=[ADD], max_tokens=40, temperature=0)
        forced = {"type": "function", "function": {"name": "add"}}
        if stream:
            chunks = await oa.chat.completions.create(
                messages=msgs, tool_choice=forced, stream=True, **kw
            )
            calls: dict[int, dict] = {}
            content = ""
            async for ch in chunks:
                content += (ch.choices[0].delta.content or "") if ch.choices else ""
                for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                    entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
                    entry["name"] += tc.function.name or ""
                    entry["args"] += tc.function.arguments or ""
            (call,) = calls.values()
            call_id, name, args = call["id"], call["name"], call["args"]
        else:
            r = await oa.chat.completions.create(messages=msgs, tool_choice=forced, **kw)
            assert r.choices[0].finish_reason == "tool_calls"
            (tc,) = r.choices[0].message.tool_calls
            call_id, name, args = tc.id, tc.function.name, tc.function.arguments
            content = r.choices[0].message.content
        assert name == "add" and isinstance(json.loads(args), dict)
        msgs += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": str(sum(json.loads(args).values())),
            },
        ]
        await oa.chat.completions.create(messages=msgs, **kw)
        traj = await gw.close_session(sid)
        assert traj.turns[0].finish_reason == "tool_calls"
        assert traj.forks == 0 and len(traj.segments) == 1
        seg = traj.segments[0]
        assert [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m] == [
            t for turn in traj.turns for t in turn.output_ids
        ]

        # Responses: function_call item out, function_call_output in
        sid, key = gw.create_session()
        async with client(gw, key) as c:
            body = {
                "model": "m",
                "input": question,
                "tools": [{"type": "function", **ADD["function"]}],
                "tool_choice": {"type": "function", "name": "add"},
                "max_output_tokens": 40,
                "temperature": 0,
                "stream": stream,
            }
            r = await c.post("/v1/responses", json=body)
            if stream:
                events = sse_events(r.text)
                assert "response.function_call_arguments.done" in [e["type"] for e in events]
                out = events[-1]["response"]["output"]
            else:
                out = r.json()["output"]
            fc = next(o for o in out if o["type"] == "function_call")
            assert fc["name"] == "add" and isinstance(json.loads(fc["arguments"]), dict)
            body["input"] = [
                {"role": "user", "content": question},
                *out,
                {"type": "function_call_output", "call_id": fc["call_id"], "output": "42"},
            ]
            body["tool_choice"] = "auto"
            assert (await c.post("/v1/responses", json=body)).status_code == 200
        traj = await gw.close_session(sid)
        assert traj.forks == 0 and len(traj.segments) == 1

        # Anthropic: tool_use block out, tool_result block in
        sid, key = gw.create_session()
        async with client(gw, key, anthropic=True) as c:
            body = {
                "model": "m",
                "max_tokens": 40,
                "temperature": 0,
                "messages": [{"role": "user", "content": question}],
                "tools": [{"name": "add", "input_schema": ADD["function"]["parameters"]}],
                "tool_choice": {"type": "tool", "name": "add"},
                "stream": stream,
            }
            r = await c.post("/v1/messages", json=body)
            if stream:
                events = sse_events(r.text)
                start = next(e for e in events if e["type"] == "content_block_start"
                             and e["content_block"]["type"] == "tool_use")  # fmt: skip
                partial = "".join(e["delta"].get("partial_json", "") for e in events
                                  if e["type"] == "content_block_delta")  # fmt: skip
                block = {**start["content_block"], "input": json.loads(partial)}
                assert events[-2]["delta"]["stop_reason"] == "tool_use"
                text = "".join(e["delta"].get("text", "") for e in events
                               if e["type"] == "content_block_delta")  # fmt: skip
                content = ([{"type": "text", "text": text}] if text else []) + [block]
            else:
                msg = r.json()
                assert msg["stop_reason"] == "tool_use"
                block = next(b for b in msg["content"] if b["type"] == "tool_use")
                content = msg["content"]
            assert block["name"] == "add" and isinstance(block["input"], dict)
            body["messages"] += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": block["id"], "content": "42"}]},
            ]  # fmt: skip
            body["tool_choice"] = {"type": "auto"}
            assert (await c.post("/v1/messages", json=body)).status_code == 200
        traj = await gw.close_session(sid)
        assert traj.forks == 0 and len(traj.segments) == 1
    finally:
        await gw.aclose()
