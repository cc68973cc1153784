"""The real `openai` SDK against the gateway on the tiny model (in-process and over HTTP).

Every reply is checked against the session's token log: the logged output ids decode to exactly
the content the client got, and usage counts exactly the logged tokens.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from gateway.server import Gateway, GatewayConfig
from gateway.server.auth import open_session_id

MODEL = "tiny-random"


@pytest.fixture
async def gateway(engine, renderer, tiny_model_path):
    gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer)
    yield gw
    await gw.aclose()


def content_of_turn(gw: Gateway, turn) -> str:
    return gw.renderer.decode(turn.output_ids)


async def test_chat_in_process_matches_token_log(gateway):
    sid, key = gateway.create_session({"task": "t1"})
    client = gateway.openai_client(key)
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    traj = gateway.trajectory(sid)
    (turn,) = traj.turns
    assert r.choices[0].message.content == content_of_turn(gateway, turn)
    assert r.usage.prompt_tokens == len(turn.prompt_ids)
    assert r.usage.completion_tokens == len(turn.output_ids)
    assert r.choices[0].finish_reason == ("length" if turn.finish_reason == "length" else "stop")
    assert traj.metadata == {"task": "t1"}
    assert turn.prompt_ids == gateway.renderer.render([{"role": "user", "content": "Hello"}])
    assert len(turn.output_logprobs) == len(turn.output_ids) == len(turn.output_versions)


async def test_streaming_tools_and_usage(gateway):
    sid, key = gateway.create_session()
    client = gateway.openai_client(key)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "add numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Add things"}],
        tools=tools,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
    )
    text, usage, finish, n_logprobs = "", None, None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs and choice.logprobs.content:
                n_logprobs += len(choice.logprobs.content)
                for t in choice.logprobs.content:  # greedy: the sampled token is the top one
                    first, second = t.top_logprobs
                    assert (first.token, first.logprob) == (t.token, pytest.approx(t.logprob))
                    assert second.logprob <= first.logprob
    (turn,) = gateway.trajectory(sid).turns
    assert text == content_of_turn(gateway, turn)
    assert usage.completion_tokens == len(turn.output_ids) == n_logprobs
    assert usage.prompt_tokens == len(turn.prompt_ids)
    assert finish in ("length", "stop")
    # the tools are in the prompt, Hermes-style
    assert "<tools>" in gateway.renderer.decode(turn.prompt_ids)


async def test_n_seed_logprobs(gateway):
    sid, key = gateway.create_session()
    client = gateway.openai_client(key)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick"}],
        max_tokens=5,
        temperature=1.0,
        seed=7,
        n=3,
        logprobs=True,
    )
    r1 = await client.chat.completions.create(**kwargs)
    r2 = await client.chat.completions.create(**kwargs)
    assert [c.index for c in r1.choices] == [0, 1, 2]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    turns = gateway.trajectory(sid).turns
    assert len(turns) == 6
    assert r1.usage.completion_tokens == sum(len(t.output_ids) for t in turns[:3])
    by_content = {content_of_turn(gateway, t): t for t in turns[:3]}
    for choice in r1.choices:
        turn = by_content[choice.message.content]
        assert [x.logprob for x in choice.logprobs.content] == pytest.approx(turn.output_logprobs)
    traj = gateway.trajectory(sid)
    assert traj.forks == 0  # siblings and retries are not forks


async def test_stop_strings_cut_content(gateway):
    sid, key = gateway.create_session()
    client = gateway.openai_client(key)
    msgs = [{"role": "user", "content": "Say something long"}]
    free = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=0
    )
    text = free.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"greedy output too short to pick a stop string: {text!r}"
    cut = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    turn = gateway.trajectory(sid).turns[-1]
    # the log keeps every sampled token, the stop string included
    assert stop in gateway.renderer.decode(turn.output_ids)


async def test_multi_turn_session_is_one_segment(gateway):
    sid, key = gateway.create_session()
    client = gateway.openai_client(key)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    for i in range(4):
        r = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4 + i, temperature=0.8, seed=i
        )
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"turn {i}"})
    traj = await gateway.close_session(sid)
    assert traj.forks == 0 and len(traj.segments) == 1
    seg = traj.segments[0]
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert sampled == [t for turn in traj.turns for t in turn.output_ids]
    sampled_logprobs = [lp for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m]
    assert sampled_logprobs == [lp for turn in traj.turns for lp in turn.output_logprobs]


async def test_concurrent_sessions_are_isolated(gateway):
    sessions = [gateway.create_session({"i": i}) for i in range(6)]

    async def run(i: int, key: str) -> list[str]:
        client = gateway.openai_client(key)
        messages = [{"role": "user", "content": f"I am agent number {i}"}]
        outs = []
        for _ in range(2):
            r = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=1.0
            )
            outs.append(r.choices[0].message.content)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "go on"},
            ]
        return outs

    results = await asyncio.gather(*(run(i, key) for i, (_, key) in enumerate(sessions)))
    for i, ((sid, _), outs) in enumerate(zip(sessions, results, strict=True)):
        traj = gateway.trajectory(sid)
        assert [content_of_turn(gateway, t) for t in traj.turns] == outs
        assert f"agent number {i}" in gateway.renderer.decode(traj.turns[0].prompt_ids)
        assert len(traj.segments) == 1 and traj.forks == 0


async def test_session_path_alias_and_completions(gateway):
    sid, key = gateway.create_session()
    client = gateway.openai_client(key)
    client = client.with_options(base_url=f"http://gateway/sessions/{sid}/v1")
    r = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=4, temperature=0
    )
    ids = gateway.renderer.encode("Once upon")
    r2 = await client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == r2.choices[0].text
    turns = gateway.trajectory(sid).turns
    assert [t.prompt_ids for t in turns] == [ids, ids]
    assert r.usage.completion_tokens == len(turns[0].output_ids)
    chunks = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in chunks if c.choices]) == r.choices[0].text
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_sync_client_over_http_and_unix_socket(engine, renderer, tiny_model_path, tmp_path):
    """The sync SDK over a real TCP socket; the same app answers on a Unix socket."""
    ready = threading.Event()
    state: dict = {}

    async def serve() -> None:
        gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="open"), renderer=renderer)
        server = await gw.start_http("127.0.0.1", 0, str(tmp_path / "gw.sock"))
        state.update(url=server.base_url, stop=asyncio.Event(), loop=asyncio.get_running_loop())
        ready.set()
        await state["stop"].wait()
        await server.stop()
        await gw.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(60)
    try:
        client = openai.OpenAI(base_url=state["url"] + "/v1", api_key="my-agent")
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == r.choices[0].message.content
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "gw.sock"))) as h:
            # the owner reads its session by its key; the id it is stored under is not the key
            traj = h.get(
                "http://gw/sessions/my-agent/trajectory", headers={"x-api-key": "my-agent"}
            ).json()
        assert len(traj["turns"]) == 2 and traj["session_id"] == open_session_id("my-agent")
        assert len(traj["segments"]) == 2  # two samples from one prompt: siblings
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(30)


async def test_top_logprobs_in_completions_and_their_misuse_in_chat(gateway):
    import openai

    _, key = gateway.create_session()
    client = gateway.openai_client(key)
    r = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == r.usage.completion_tokens
    )
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # distinct ids can share a text
        assert top[token] == pytest.approx(logprob) and max(top.values()) == top[token]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, top_logprobs=2
        )
