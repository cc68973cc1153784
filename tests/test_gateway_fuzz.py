"""Property test of the gateway's whole HTTP surface (hypothesis): whatever a client sends —
valid bodies with fields replaced by arbitrary JSON, deep nesting, NaN literals, raw bytes,
non-ASCII and odd headers, any method on any route — the answer is never a 5xx (other than a 503
the client may retry) and every error has the API's error shape.

Bounded for CI: a fixed number of examples, derandomized (the same inputs every run), generation
capped at a few tokens by the gateway's own `max_tokens_limit`.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.server import Gateway, GatewayConfig

MODEL = "tiny-random"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
VALID = {
    "/v1/chat/completions": {
        "model": MODEL,
        "max_tokens": 2,
        "tools": [TOOL],
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "u"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ],
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "r"},
    ], "tools": [{"type": "function", "name": "f", "parameters": {}}]},
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "system": "s", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "r"}]},
    ], "tools": [{"name": "f", "input_schema": {}}]},
    "/sessions": {"metadata": {"a": 1}, "sampling": {"temperature": 1.0}},
    "/sessions/s-fuzz/reward": {"reward": 1.0, "info": {"k": "v"}},
    "/sessions/s-fuzz/close": {"status": "ok", "reason": "r"},
    "/pause": {"mode": "in_place"},
}  # fmt: skip

KEYS = ["model", "messages", "role", "content", "tools", "tool_choice", "type", "function",
        "name", "arguments", "stream", "n", "stop", "max_tokens", "input", "prompt", "text",
        "tool_calls", "id", "input_schema", "system", "call_id", "output", "logprobs",
        "top_logprobs", "temperature", "top_p", "top_k", "seed", "stop_sequences", "metadata",
        "reward", "info", "status", "mode", "sampling", "echo", "max_output_tokens",
        "max_completion_tokens", "stream_options", "include_usage"]  # fmt: skip

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        [
            "auto",
            "none",
            "required",
            "user",
            "assistant",
            "tool",
            "text",
            "tool_use",
            "tool_result",
            "function",
            "function_call",
            MODEL,
        ]
    ),  # fmt: skip
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def deep(depth: int, kind: str) -> object:
    value: object = {}
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


deep_values = st.builds(deep, st.integers(1, 400), st.sampled_from(["list", "dict"]))


@st.composite
def mutated(draw, body: dict) -> dict:
    """`body` with up to three fields (at any depth) replaced, deleted or added."""
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        node = body
        path_len = draw(st.integers(0, 3))
        for _ in range(path_len):
            children = list(node) if isinstance(node, dict) else range(len(node))
            children = [k for k in children if isinstance(node[k], dict | list) and node[k]]
            if not children:
                break
            node = node[draw(st.sampled_from(children))]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        value = draw(json_values | deep_values)
        if action == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(KEYS))] = value
        elif action == "add" and isinstance(node, list):
            node.append(value)
        elif keys and action == "delete":
            del node[draw(st.sampled_from(keys))]
        elif keys:
            node[draw(st.sampled_from(keys))] = value
    return body


def encode(body: object) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity literals too


header_text = st.text(
    st.characters(blacklist_characters="\r\n\x00", blacklist_categories=("Cs",)), max_size=40
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "authorization": st.one_of(
            st.just("Bearer admin"),
            st.just("Bearer fuzz-key"),
            header_text.map(lambda t: ("Bearer " + t).encode()),
            st.binary(max_size=30).filter(lambda b: not set(b) & {0, 10, 13}),
        ),
        "x-api-key": header_text.map(str.encode),
        "content-type": st.sampled_from(["application/json", "text/plain", "ü"]).map(str.encode),
    },
)
requests = st.one_of(
    st.tuples(
        st.just("POST"),
        st.sampled_from(sorted(VALID)),
    ).flatmap(
        lambda mp: st.tuples(st.just(mp[0]), st.just(mp[1]), mutated(VALID[mp[1]]).map(encode))
    ),
    st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
        st.sampled_from(
            [
                *VALID,
                "/v1/models",
                "/v1/models/x",
                "/health",
                "/metrics",
                "/weight_version",
                "/resume",
                "/sessions/s-fuzz",
                "/sessions/s-fuzz/trajectory",
                "/nope",
                "/sessions/s-fuzz/v1/chat/completions",
                "/sessions/%2F/trajectory",
                "/sessions/é/trajectory",
            ]  # fmt: skip
        ),
        st.one_of(st.binary(max_size=64), json_values.map(encode), deep_values.map(encode)),
    ),
)


def check_shape(path: str, r: httpx.Response) -> None:
    assert r.status_code < 500 or r.status_code == 503, (path, r.status_code, r.text[:500])
    if r.status_code < 400:
        return
    body = r.json()
    if path.endswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("auth", ["open", "keys"])
def test_no_input_gets_a_5xx(auth, engine, renderer, tiny_model_path):
    loop = asyncio.new_event_loop()
    cfg = GatewayConfig(auth=auth, admin_token="admin", default_max_tokens=2, max_tokens_limit=4)
    gw = Gateway(engine, tiny_model_path, cfg, renderer=renderer)
    gw.create_session(session_id="s-fuzz")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app), base_url="http://gw")
    seen: set[int] = set()

    @settings(
        max_examples=300,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=requests, hdrs=headers)
    def run(request, hdrs):
        method, path, content = request

        async def go() -> None:
            r = await client.request(method, path, content=content, headers=hdrs)
            check_shape(path, r)
            seen.add(r.status_code)
            await gw.resume()

        loop.run_until_complete(go())

    try:
        run()
        # after all that, the gateway still serves and lists
        admin = {"authorization": "Bearer admin"}
        r = loop.run_until_complete(client.get("/sessions", headers=admin))
        assert r.status_code == 200
        assert {200, 400, 404, 405} <= seen, seen  # it reached generation and every refusal
        assert 401 in seen or auth == "open"
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(gw.aclose())
        loop.close()
