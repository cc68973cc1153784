"""Rendering, tool-call parsing and token-in-token-out history matching, without an engine.

The "engine" here is the tokenizer: a model reply is the encoding of a chosen text plus EOS, the
way a real engine samples it, so the tests can pick replies that are tool calls (the tiny random
model never writes one).
"""

from __future__ import annotations

import json
import random

import pytest

from gateway.render import (
    IncrementalDecoder,
    Renderer,
    StopTrimmer,
    TokenHistory,
    ToolCallParser,
    load_renderer,
    parse_tool_call_json,
    parse_tool_calls,
)
from gateway.trajectory import Turn, build_segments

TOOLS = [
    {
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
]


@pytest.fixture(scope="module")
def renderer(tiny_model_path) -> Renderer:
    return load_renderer(tiny_model_path)


def sample(renderer: Renderer, text: str, eos: bool = True) -> list[int]:
    """Ids an engine would have sampled for `text` (ending on EOS like a finished turn)."""
    return renderer.encode(text) + ([renderer.tokenizer.eos_token_id] if eos else [])


# ------------------------------------------------------------------------------ tool calls


def test_parse_tool_calls_hermes():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0].id.startswith("call_")


def test_parse_two_calls_and_malformed_json_stays_content():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        "<tool_call>{not json</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'  # no name
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].arguments) == {"x": 1}
    assert content == '<tool_call>{not json</tool_call><tool_call>{"arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        "plain text only",
        "a < b and <tool but not a call",
        '<tool_call>{"name": "add", "arguments": {"a": 1}}',  # unterminated but complete
        "<tool_call>{unterminated and broken",
        'x<tool_call>{"name": "q", "arguments": {"s": "</tool"}}</tool_call>y',
        "<<<tool_call>>>",
        "\x00\ufffd" * 5,
    ],
)
def test_streaming_parser_equals_whole_parse_at_every_split(text):
    whole_content, whole_calls = parse_tool_calls(text)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(3, len(text) + 1)))
        parser = ToolCallParser()
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        events = [e for p in pieces for e in parser.push(p)] + parser.finish()
        streamed = "".join(v for k, v in events if k == "text")
        names = [(v.name, v.arguments) for k, v in events if k == "tool_call"]
        assert streamed == whole_content == parser.content
        assert names == [(c.name, c.arguments) for c in whole_calls]


def test_unterminated_call_is_accepted_when_complete():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n')
    assert content == "" and calls[0].name == "add"


def test_parse_tool_call_json_never_raises():
    for raw in ["", "[]", "1", '{"name": 3}', "{" * 5000, '{"name": "x", "arguments": "no"}']:
        assert parse_tool_call_json(raw) is None


def test_parser_prefix_for_forced_tool_choice():
    parser = ToolCallParser(prefix='<tool_call>\n{"name": "add", "arguments": ')
    events = parser.push('{"a": 1, "b": 2}}\n</tool_call>') + parser.finish()
    assert [k for k, _ in events] == ["tool_call"]
    assert parser.calls[0].name == "add" and parser.content == ""


# ------------------------------------------------------------------------------ text helpers


def test_stop_trimmer_streaming():
    trim = StopTrimmer(["STOP", "\n\n"])
    out = "".join(trim.push(p) for p in ["hello ST", "O", "P and more"]) + trim.finish()
    assert out == "hello " and trim.matched == "STOP"
    trim = StopTrimmer(["END"])
    assert "".join(trim.push(p) for p in ["abc", "E", "N"]) + trim.finish() == "abcEN"
    assert trim.matched is None


def test_incremental_decoder_matches_full_decode(renderer):
    rng = random.Random(1)
    text = "Héllo wörld — 你好, 🤖 emojis and\nnew lines <tool_call>{}</tool_call>"
    for ids in [renderer.encode(text), [rng.randrange(49152) for _ in range(200)]]:
        dec = IncrementalDecoder(renderer)
        out, i = "", 0
        while i < len(ids):
            step = rng.randint(1, 3)
            out += dec.push(ids[i : i + step])
            i += step
        out += dec.finish()
        assert out == renderer.decode(ids)


# ------------------------------------------------------------------------------ rendering


def test_renderer_reads_chatml_template(renderer):
    assert renderer.generation_prompt == "<|im_start|>assistant\n"
    assert renderer.assistant_tail == "<|im_end|>\n"
    assert renderer.closing_ids(sample(renderer, "hi")) == renderer.encode("\n")
    assert renderer.closing_ids(renderer.encode("cut sh")) == renderer.encode("<|im_end|>\n")
    assert renderer.append_only and not renderer.native_tools


def test_hermes_tool_rendering(renderer):
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "7"},
    ]
    text = renderer.render_text(messages, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
        "<|im_end|>\n"
    ) in text
    # consecutive tool results become one user turn (Qwen2.5 convention)
    assert (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    # a system message gets the tools appended
    text = renderer.render_text([{"role": "system", "content": "Be brief."}] + messages[:1], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


# ------------------------------------------------------------------------------ token in, token out


def run_turn(renderer, history, messages, reply_text, tools=TOOLS):
    """One call: prompt from the history, a 'sampled' reply, the message the client gets."""
    prompt, call = history.prompt(renderer, messages, tools)
    output_ids = sample(renderer, reply_text)
    content, calls = parse_tool_calls(renderer.decode(output_ids))
    reply = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
    history.record(renderer, call, reply, output_ids)
    turn = Turn(prompt.ids, output_ids, [-0.5] * len(output_ids), [0] * len(output_ids), "stop")
    client_msg = {"role": "assistant", "content": content or None}
    if calls:
        client_msg["tool_calls"] = [c.to_openai() for c in calls]
    return prompt, turn, client_msg


def test_multi_turn_tool_session_is_one_segment_of_sampled_tokens(renderer):
    history = TokenHistory()
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "1+2?"},
    ]
    # the model writes the call with its own spacing; the client gets it back parsed
    replies = [
        'Sure.<tool_call>{"name":"add","arguments":{"b":2,"a":1}}</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 3}}\n</tool_call>',
        "The answer is 6.",
    ]
    turns = []
    for i, reply_text in enumerate(replies):
        prompt, turn, client_msg = run_turn(renderer, history, messages, reply_text)
        assert not prompt.forked
        if i > 0:
            prev = turns[-1]
            assert prompt.ids[: len(prev.prompt_ids) + len(prev.output_ids)] == (
                prev.prompt_ids + prev.output_ids
            )
        turns.append(turn)
        messages = messages + [client_msg]
        if client_msg.get("tool_calls"):
            for call in client_msg["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "3"})
        else:
            messages.append({"role": "user", "content": "thanks"})
    segments, forks = build_segments(turns)
    assert forks == 0 and len(segments) == 1
    seg = segments[0]
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert sampled == [t for turn in turns for t in turn.output_ids]
    # the model's own spacing was kept: a re-render would have normalized the first call
    first_call = renderer.encode(
        'Sure.<tool_call>{"name":"add","arguments":{"b":2,"a":1}}</tool_call>'
    )
    assert first_call == seg.token_ids[len(turns[0].prompt_ids) :][: len(first_call)]
    # and every token that is not sampled is the template's: the full render of the messages
    # differs only inside the (re-rendered) assistant turns
    assert renderer.decode(seg.token_ids).startswith(renderer.decode(turns[0].prompt_ids))


def test_tito_equals_full_render_for_canonical_replies(renderer):
    """With replies in the template's own format, reused ids are exactly a fresh render."""
    history = TokenHistory()
    messages = [{"role": "user", "content": "hello"}]
    for reply in ["Hi! How can I help?", "Sure, here it is."]:
        prompt, _turn, client_msg = run_turn(renderer, history, messages, reply, tools=None)
        assert prompt.ids == renderer.render(messages)
        messages = messages + [client_msg, {"role": "user", "content": "more please"}]
    prompt, _ = history.prompt(renderer, messages, None)
    assert prompt.reused > 0 and prompt.ids == renderer.render(messages)


def test_edited_history_forks_and_retries_are_siblings(renderer):
    history = TokenHistory()
    messages = [{"role": "user", "content": "hello"}]
    _p, t1, msg = run_turn(renderer, history, messages, "Hi there.", tools=None)
    # a retry of the same request is a sibling (same prompt), not a fork
    p_retry, t_retry, _ = run_turn(renderer, history, messages, "Hello!", tools=None)
    assert not p_retry.forked and p_retry.ids == t1.prompt_ids
    # the client edits the assistant's reply: no earlier call matches, so the prompt forks
    edited = messages + [
        {"role": "assistant", "content": "EDITED"},
        {"role": "user", "content": "ok"},
    ]
    p_fork, t_fork, _ = run_turn(renderer, history, edited, "fine", tools=None)
    assert p_fork.forked and p_fork.reused == 0
    # continuing from the sibling's reply matches the sibling
    cont = messages + [
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "hey"},
    ]
    p_cont, t_cont, _ = run_turn(renderer, history, cont, "yo", tools=None)
    assert not p_cont.forked
    assert p_cont.ids[: len(t_retry.prompt_ids) + len(t_retry.output_ids)] == (
        t_retry.prompt_ids + t_retry.output_ids
    )
    segments, forks = build_segments([t1, t_retry, t_fork, t_cont])
    assert forks == 1
    # changing the tools also breaks the match
    p_tools, _ = history.prompt(renderer, cont, TOOLS)
    assert p_tools.forked


def test_truncated_reply_gets_the_end_of_turn_tokens(renderer):
    history = TokenHistory()
    messages = [{"role": "user", "content": "count"}]
    prompt, call = history.prompt(renderer, messages, None)
    out = renderer.encode("one two thr")  # cut by max_tokens: no EOS
    history.record(renderer, call, {"role": "assistant", "content": "one two thr"}, out)
    nxt = messages + [
        {"role": "assistant", "content": "one two thr"},
        {"role": "user", "content": "go on"},
    ]
    p2, _ = history.prompt(renderer, nxt, None)
    tail = p2.ids[len(prompt.ids) + len(out) :]
    # the end-of-turn the model never sampled (`<|im_end|>` and its newline), then the next turn
    assert (
        tail[:2] == renderer.encode("<|im_end|>\n") and renderer.token_text(tail[0]) == "<|im_end|>"
    )
    assert p2.ids == renderer.render(nxt)


def test_a_remembered_render_is_the_render_and_never_another_requests(tiny_model_path):
    """The render memo gives a repeated first turn back from memory: the same ids as rendering
    it, a copy the caller may change, and never one request's ids for another that differs in
    messages, tools or prefill. It holds at most `max_tokens`, least recently used out first."""
    from transformers import AutoTokenizer

    r = Renderer(AutoTokenizer.from_pretrained(tiny_model_path))
    r.renders.max_tokens = 800
    variants = [
        ([{"role": "user", "content": "add 1 and 2"}], None, ""),
        ([{"role": "user", "content": "add 1 and 3"}], None, ""),
        ([{"role": "user", "content": "add 1 and 2"}], TOOLS, ""),
        ([{"role": "user", "content": "add 1 and 2"}], None, "<tool_call>"),
        ([{"role": "system", "content": "add 1 and 2"}], None, ""),
    ]
    fresh = [r.encode(r.render_text(m, t) + p) for m, t, p in variants]
    assert len({tuple(ids) for ids in fresh}) == len(variants)
    for _ in range(3):
        for (m, t, p), want in zip(variants, fresh, strict=True):
            got = r.render(m, t, p)
            assert got == want
            got.append(-1)  # the caller's list; the memo keeps its own
    assert (r.renders.hits, r.renders.misses) == (2 * len(variants), len(variants))
    for i in range(30):  # ~36 tokens each: the oldest go
        r.render([{"role": "user", "content": f"add {i} and 2"}])
        assert r.renders.held <= 800
    hits, misses = r.renders.hits, r.renders.misses
    r.render([{"role": "user", "content": "add 29 and 2"}])
    r.render(*variants[0])
    assert (r.renders.hits, r.renders.misses) == (hits + 1, misses + 1)
    long = [{"role": "user", "content": "word " * 300}]  # over a quarter of the bound: not kept
    assert r.render(long) == r.render(long) and r.renders.misses == misses + 3
    # a template that reads the clock renders differently later: nothing is remembered
    r.tokenizer.chat_template += "{# strftime_now #}"
    assert not Renderer(r.tokenizer).renders.enabled


def test_non_append_only_template_forks(tiny_model_path):
    """A template that drops earlier assistant turns cannot be extended: the prompt forks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = Renderer(tok)
    assert not r.append_only
    history = TokenHistory()
    messages = [{"role": "user", "content": "a"}]
    _p, _t, msg = run_turn(r, history, messages, "b", tools=None)
    p2, _ = history.prompt(r, messages + [msg, {"role": "user", "content": "c"}], None)
    assert p2.forked and p2.ids == r.render(messages + [msg, {"role": "user", "content": "c"}])


@pytest.mark.slow
def test_smollm2_renders_and_reuses(smollm2_path):
    r = load_renderer(smollm2_path)
    assert r.append_only and r.generation_prompt == "<|im_start|>assistant\n"
    history = TokenHistory()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt, turn, msg = run_turn(
        r,
        history,
        messages,
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>',
    )
    assert msg["tool_calls"][0]["function"]["name"] == "add"
    nxt = messages + [
        msg,
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "4"},
    ]
    p2, _ = history.prompt(r, nxt, TOOLS)
    assert (
        p2.ids[: len(turn.prompt_ids) + len(turn.output_ids)] == turn.prompt_ids + turn.output_ids
    )


def test_whitespace_only_content_next_to_tool_calls_still_matches(renderer):
    """The reply had "\\n" before its call; the client sends content None: same message."""
    history = TokenHistory()
    messages = [{"role": "user", "content": "add"}]
    prompt, turn, client_msg = run_turn(
        renderer,
        history,
        messages,
        '\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
    )
    assert client_msg["content"] == "\n"
    client_msg["content"] = None  # what the gateway returns, and the client sends back
    call_id = client_msg["tool_calls"][0]["id"]
    nxt = messages + [client_msg, {"role": "tool", "tool_call_id": call_id, "content": "1"}]
    p2, _ = history.prompt(renderer, nxt, TOOLS)
    assert not p2.forked and p2.reused == len(turn.prompt_ids) + len(turn.output_ids) + 1
