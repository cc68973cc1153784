"""Token fidelity against the engine's own record (tests/engine_oracle.py), not the trajectory.

Every test wraps the engine in `RecordingEngine`, drives multi-turn sessions through the
gateway's HTTP surfaces, and checks the closed trajectory with `check_trajectory`: trained
tokens are exactly what the engine emitted after exactly the ids the gateway sent (logprobs and
versions too), and nothing else is trained. Fast tests: the tiny model on all four surfaces
(streaming or not), ids no tokenizer would write (scripted: the tiny model's samples mostly
re-encode to the same ids, so only this test is sure to catch a re-tokenized history), `n > 1`,
a client that disconnects, a partial rollout across a weight swap, and the fake SGLang servers.
The slow test: SmolLM2 making real tool calls under forced `tool_choice`, with the tool results
in the next prompts.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import orjson
import pytest
from engine_oracle import (
    RecordingEngine,
    ScriptedEngine,
    assert_token_in_token_out,
    check_trajectory,
)
from fake_sglang import serve_fake

from gateway.engines import EngineConfig, make_engine
from gateway.engines.local import LocalEngine
from gateway.render import load_renderer
from gateway.server import Gateway, GatewayConfig

MODEL = "m"
SURFACES = ["chat", "completions", "responses", "messages"]


def gateway(engine, renderer, path) -> tuple[Gateway, RecordingEngine]:
    rec = RecordingEngine(engine)
    gw = Gateway(rec, path, GatewayConfig(auth="keys"), renderer=renderer, model_name=MODEL)
    return gw, rec


def http(gw: Gateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app),
        base_url="http://gw",
        headers={"Authorization": f"Bearer {key}", "x-api-key": key},
    )


def sse(text: str) -> list[dict]:
    return [orjson.loads(x[6:]) for x in text.splitlines()
            if x.startswith("data: ") and x != "data: [DONE]"]  # fmt: skip


async def post(c: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r


async def chat_turns(c, stream: bool, turns: int, **kw) -> None:
    """A multi-turn conversation: each reply goes back as the assistant message."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    for i in range(turns):
        body = {"model": MODEL, "messages": messages, "stream": stream, **kw}
        r = await post(c, "/v1/chat/completions", body)
        if stream:
            text = "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in sse(r.text) if e["choices"])  # fmt: skip
        else:
            text = r.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"And then? ({i})"}]  # fmt: skip


async def completions_turns(c, records, stream: bool, turns: int, **kw) -> None:
    """A raw-completions client that continues in token ids (as RL clients do): its next
    prompt is the previous prompt and output ids, plus new ids."""
    prompt: str | list[int] = "Once upon a time"
    for i in range(turns):
        await post(c, "/v1/completions", {"model": MODEL, "prompt": prompt, "stream": stream, **kw})
        last = records()[-1]
        prompt = last.input_ids + last.output_ids + [100 + i, 200 + i]


async def responses_turns(c, stream: bool, turns: int, **kw) -> None:
    items: list[dict] = [{"role": "user", "content": "Tell me a story."}]
    kw["max_output_tokens"] = kw.pop("max_tokens")
    for i in range(turns):
        r = await post(c, "/v1/responses", {"model": MODEL, "input": items, "stream": stream, **kw})
        out = sse(r.text)[-1]["response"]["output"] if stream else r.json()["output"]
        items += [*out, {"role": "user", "content": f"And then? ({i})"}]


async def messages_turns(c, stream: bool, turns: int, **kw) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    for i in range(turns):
        body = {"model": MODEL, "messages": messages, "stream": stream, **kw}
        r = await post(c, "/v1/messages", body)
        if stream:
            text = "".join(e["delta"].get("text", "") for e in sse(r.text)
                           if e["type"] == "content_block_delta")  # fmt: skip
        else:
            text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
        messages += [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                     {"role": "user", "content": f"And then? ({i})"}]  # fmt: skip


async def converse(surface: str, c, records, stream: bool, turns: int = 3, **kw) -> None:
    """`turns` calls of one session on `surface`; `records()` are the session's engine records."""
    kw = {"max_tokens": 6, "temperature": 1.0, **kw}
    if surface == "completions":
        await completions_turns(c, records, stream, turns, **kw)
    else:
        run = {"chat": chat_turns, "responses": responses_turns, "messages": messages_turns}
        await run[surface](c, stream, turns, **kw)


def check_session(traj, rec: RecordingEngine, sid: str, turns: int) -> None:
    records = rec.of_session(sid)
    assert len(records) == turns and all(r.finish_reason for r in records)
    assert_token_in_token_out(records)  # at the engine: ids went back verbatim
    used = check_trajectory(traj, records)
    assert [id(r) for r in used] == [id(r) for r in records]  # every output trained, in order
    assert len(traj.segments) == 1


async def one_session(engine, renderer, path, surface: str, stream: bool, turns=3, **kw) -> None:
    """One session of `turns` calls on `surface`, its trajectory checked against the engine."""
    gw, rec = gateway(engine, renderer, path)
    try:
        sid, key = gw.create_session()
        async with http(gw, key) as c:
            await converse(surface, c, lambda: rec.of_session(sid), stream, turns, **kw)
        check_session(await gw.close_session(sid), rec, sid, turns)
    finally:
        await gw.aclose()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("surface", SURFACES)
async def test_multi_turn_sessions_match_the_engine(engine, renderer, tiny_model_path, surface,
                                                    stream):  # fmt: skip
    await one_session(engine, renderer, tiny_model_path, surface, stream, seed=7)


@pytest.mark.parametrize("surface", ["chat", "responses", "messages"])
async def test_ids_no_tokenizer_would_write_go_back_verbatim(renderer, tiny_model_path, surface):
    """A model may sample "Hel" + "lo" where the tokenizer has "Hello": the reply's text then
    encodes to other ids, and only a gateway that sends the sampled ids back passes (the
    tiny model's samples re-encode the same most of the time, so this is scripted)."""
    engine = ScriptedEngine()
    engine.script = [t for piece in ("Hel", "lo", " the", "re") for t in renderer.encode(piece)]
    assert renderer.encode(renderer.decode(engine.script)) != engine.script
    await one_session(engine, renderer, tiny_model_path, surface, False, turns=2)


async def test_n_choices_are_sibling_segments(engine, renderer, tiny_model_path):
    gw, rec = gateway(engine, renderer, tiny_model_path)
    try:
        sid, key = gw.create_session()
        async with http(gw, key) as c:
            msgs = [{"role": "user", "content": "Hi"}]
            body = {"model": MODEL, "messages": msgs, "n": 3, "max_tokens": 5, "temperature": 1}
            r = (await post(c, "/v1/chat/completions", body)).json()
            reply = r["choices"][1]["message"]["content"]
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go"}]
            await post(c, "/v1/chat/completions", {**body, "n": 1, "stream": True})
        traj = await gw.close_session(sid)
    finally:
        await gw.aclose()
    records = rec.of_session(sid)
    siblings, follow = records[:3], records[3]
    assert len({tuple(r.input_ids) for r in siblings}) == 1
    chosen = next(r for r in siblings if renderer.decode(r.output_ids) == reply)
    assert_token_in_token_out([chosen, follow])
    used = check_trajectory(traj, records)
    assert sorted(map(id, used)) == sorted(map(id, records))
    assert len(traj.segments) == 3 and traj.forks == 0


async def test_a_disconnected_reply_is_never_trained(engine, renderer, tiny_model_path):
    gw, rec = gateway(engine, renderer, tiny_model_path)
    server = await gw.start_http()
    try:
        sid, key = gw.create_session()
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        msgs = [{"role": "user", "content": "Hi"}]
        async with httpx.AsyncClient(headers=headers) as c:
            r = await c.post(url, json={"model": MODEL, "messages": msgs, "max_tokens": 5})
            text = r.json()["choices"][0]["message"]["content"]
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "More"}]
            body = {"model": MODEL, "messages": msgs, "max_tokens": 3000, "stream": True}
            async with c.stream("POST", url, json=body) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        break  # leave with tokens on the wire
        session = gw.sessions.get(sid)
        for _ in range(500):
            if session.requests == 0:
                break
            await asyncio.sleep(0.02)
        traj = await gw.close_session(sid)
    finally:
        await server.stop()
        await gw.aclose()
    first, gone = rec.of_session(sid)
    # the gateway aborted it (or stopped reading) when the client left, tokens on the wire
    assert gone.finish_reason in (None, "abort") and 0 < len(gone.output_ids) < 3000
    assert [id(r) for r in check_trajectory(traj, [first, gone])] == [id(first)]


async def test_partial_rollout_across_a_weight_swap(tiny_model_path, renderer):
    """Tokens sampled before and after an in-place weight swap keep their own versions."""
    async with LocalEngine(tiny_model_path, max_batch_size=4) as engine:
        gw, rec = gateway(engine, renderer, tiny_model_path)
        try:
            sid, key = gw.create_session()
            state = {k: v.clone() for k, v in engine.model.state_dict().items()}

            async def swap_after_some_tokens() -> None:
                while not rec.records or len(rec.records[-1].output_ids) < 4:
                    await asyncio.sleep(0.005)
                await engine.pause("in_place")
                await gw.update_weights(state, 1)
                await engine.resume()

            async with http(gw, key) as c:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 64, "temperature": 1.0, "seed": 3, "stream": True}  # fmt: skip
                _, r = await asyncio.gather(
                    swap_after_some_tokens(), post(c, "/v1/chat/completions", body)
                )
                text = "".join(e["choices"][0]["delta"].get("content") or ""
                               for e in sse(r.text) if e["choices"])  # fmt: skip
                body["messages"] += [{"role": "assistant", "content": text},
                                     {"role": "user", "content": "More"}]  # fmt: skip
                await post(c, "/v1/chat/completions", {**body, "max_tokens": 4})
            traj = await gw.close_session(sid)
        finally:
            await gw.aclose()
    first, second = rec.of_session(sid)
    assert {0, 1} <= set(first.versions) and set(second.versions) == {1}
    assert first.versions == sorted(first.versions)
    assert_token_in_token_out([first, second])
    check_trajectory(traj, [first, second])
    assert sorted(set(traj.segments[0].versions)) == [-1, 0, 1]


@pytest.mark.parametrize("stream", [False, True])
async def test_fake_sglang_sessions_match_the_engine(renderer, tiny_model_path, stream):
    with serve_fake() as url1, serve_fake("--incremental") as url2:
        engine = make_engine(EngineConfig(kind="sglang", urls=[url1, url2]), tiny_model_path)
        gw, rec = gateway(engine, renderer, tiny_model_path)
        try:
            sessions = [gw.create_session() for _ in range(4)]

            async def run(i: int, sid: str, key: str) -> None:
                async with http(gw, key) as c:
                    await converse(SURFACES[i], c, lambda: rec.of_session(sid), stream,
                                   max_tokens=12)  # fmt: skip

            await asyncio.gather(*(run(i, *s) for i, s in enumerate(sessions)))
            for sid, _ in sessions:
                check_session(await gw.close_session(sid), rec, sid, 3)
        finally:
            await gw.aclose()
            await engine.close()


# ------------------------------------------------------------------ SmolLM2: real tool calls

ADD = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
QUESTION = "What is 17 + 25? Use the add tool."


def result(args: dict) -> str:
    return str(sum(v for v in args.values() if isinstance(v, int)))


async def chat_tools(c, stream: bool) -> None:
    msgs = [{"role": "user", "content": QUESTION}]
    forced = {"type": "function", "function": {"name": "add"}}
    kw = {"model": MODEL, "tools": [{"type": "function", "function": ADD}], "max_tokens": 40,
          "temperature": 0}  # fmt: skip
    for choice in (forced, "auto"):
        r = await post(c, "/v1/chat/completions",
                       {**kw, "messages": msgs, "tool_choice": choice, "stream": stream})  # fmt: skip
        if choice == "auto":
            return
        if stream:
            events = [e for e in sse(r.text) if e["choices"]]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            deltas = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls") or []]
            call = {"id": deltas[0]["id"], "type": "function", "function": {
                "name": deltas[0]["function"]["name"],
                "arguments": "".join(d["function"].get("arguments") or "" for d in deltas)}}  # fmt: skip
        else:
            message = r.json()["choices"][0]["message"]
            content, (call,) = message["content"], message["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        msgs += [{"role": "assistant", "content": content, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": result(args)}]  # fmt: skip


async def responses_tools(c, stream: bool) -> None:
    items: list[dict] = [{"role": "user", "content": QUESTION}]
    body = {"model": MODEL, "tools": [{"type": "function", **ADD}], "max_output_tokens": 40,
            "temperature": 0, "stream": stream}  # fmt: skip
    for choice in ({"type": "function", "name": "add"}, "auto"):
        r = await post(c, "/v1/responses", {**body, "input": items, "tool_choice": choice})
        out = sse(r.text)[-1]["response"]["output"] if stream else r.json()["output"]
        fc = next((o for o in out if o["type"] == "function_call"), None)
        if choice == "auto":
            return
        items += [*out, {"type": "function_call_output", "call_id": fc["call_id"],
                         "output": result(json.loads(fc["arguments"]))}]  # fmt: skip


async def messages_tools(c, stream: bool) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": stream,
            "tools": [{"name": "add", "input_schema": ADD["parameters"]}]}  # fmt: skip
    for choice in ({"type": "tool", "name": "add"}, {"type": "auto"}):
        r = await post(c, "/v1/messages", {**body, "messages": messages, "tool_choice": choice})
        if choice["type"] == "auto":
            return
        if stream:
            events = sse(r.text)
            start = next(e["content_block"] for e in events if e["type"] == "content_block_start"
                         and e["content_block"]["type"] == "tool_use")  # fmt: skip
            partial = "".join(e["delta"].get("partial_json", "") for e in events
                              if e["type"] == "content_block_delta")  # fmt: skip
            text = "".join(e["delta"].get("text", "") for e in events
                           if e["type"] == "content_block_delta")  # fmt: skip
            block = {**start, "input": json.loads(partial)}
            content = ([{"type": "text", "text": text}] if text else []) + [block]
        else:
            content = r.json()["content"]
            block = next(b for b in content if b["type"] == "tool_use")
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id":
                      block["id"], "content": result(block["input"])}]}]  # fmt: skip


@pytest.fixture(scope="module")
def smol(smollm2_path):
    eng = LocalEngine(smollm2_path)
    yield eng, load_renderer(smollm2_path), smollm2_path
    asyncio.run(eng.close())


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_smollm2_tool_sessions_match_the_engine(smol, stream):
    """A forced tool call, its result, then a free reply, on chat, responses and messages: one
    segment each, whose trained tokens are the engine's two outputs and whose tool result and
    template tokens are never trained."""
    engine, renderer, path = smol
    gw, rec = gateway(engine, renderer, path)
    try:
        for run in (chat_tools, responses_tools, messages_tools):
            sid, key = gw.create_session()
            async with http(gw, key) as c:
                await run(c, stream)
            traj = await gw.close_session(sid)
            assert traj.turns[0].finish_reason == "tool_calls", run.__name__
            check_session(traj, rec, sid, 2)
            (seg,) = traj.segments
            untrained = renderer.decode([t for t, m in zip(seg.token_ids, seg.loss_mask,
                                                           strict=True) if not m])  # fmt: skip
            assert "<tool_response>" in untrained  # the tool result went in, untrained
    finally:
        await gw.aclose()
