"""Chat rendering, token-in-token-out history matching and tool-call parsing.

The gateway never lets an engine see text: `Renderer` turns OpenAI chat messages into token ids
with the tokenizer's own chat template, and turns sampled ids back into the text and tool calls
the client gets.

Tools. When the template renders tools itself (it mentions `tools`), messages, `tools` and
assistant `tool_calls` go to it unchanged. Otherwise (ChatML models without tool support, such
as SmolLM2) the Hermes / Qwen2.5 convention is used:
- the tool schemas go at the end of the system prompt inside `<tools></tools>` (a system
  message is added when there is none), with an instruction to answer with
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message's `tool_calls` are rendered after its content as
  `<tool_call>\n{json}\n</tool_call>` blocks;
- consecutive `tool` messages become one `user` turn of `<tool_response>\n...\n</tool_response>`
  blocks.
Generated text is parsed with the same `<tool_call>` convention in both cases (it is what
Hermes, Qwen2.5 and Qwen3 emit). Malformed JSON stays in `content`; parsing never raises.

Token in, token out. `TokenHistory` remembers, per session, each call's exact prompt ids, the
sampled ids of each choice, and the message the client got back. A new request whose messages
start with an earlier request's messages followed by the assistant message that call returned
reuses `prompt_ids + output_ids + closing ids` (the template tokens the model did not generate,
e.g. the `\\n` ChatML puts after `<|im_end|>`) and renders only the new messages plus the
generation prompt. A request that matches nothing while the session has history is a fork: it
is rendered from scratch and counted.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

Message = dict[str, Any]
"""An OpenAI chat message with string content: role, content, tool_calls, tool_call_id, name."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_MARK = "\u2063LOONGSAGE_MARK\u2063"

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class RenderError(ValueError):
    """Messages the template cannot render; the message names the field."""


@dataclass
class ToolCall:
    """A parsed tool call: `arguments` is a JSON string, as in OpenAI's API."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    valid: bool = True
    """False for a forced call the model did not complete: `arguments` then holds the raw text
    it wrote (not valid JSON), as OpenAI returns a forced call cut short."""

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ---------------------------------------------------------------------------------------------
# Tool-call parsing (streaming; the non-streaming parse is the same parser fed at once)


class ToolCallParser:
    """Splits generated text into content and `<tool_call>{json}</tool_call>` calls, incrementally.

    `push(text)` returns events: `("text", str)` for content that is certainly not part of a
    tool call, `("tool_call", ToolCall)` for each complete, valid call. `finish()` flushes what is
    held back. A block whose JSON is malformed (or lacks a name) is given back as text — except
    when the call was `forced` (the prompt ends inside a `<tool_call>` block, `prefix`): then it
    is a failed call (`valid=False`, the model's raw text as arguments), never content, since
    the client asked for a call and the opening text is the gateway's, not the model's.
    """

    def __init__(self, prefix: str = "", forced: bool = False) -> None:
        self._buf = prefix
        self.forced = forced
        self._in_call = False
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []

    def push(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        events: list[tuple[str, Any]] = []
        while True:
            if not self._in_call:
                i = self._buf.find(TOOL_CALL_OPEN)
                if i < 0:
                    # hold back a tail that could be the start of "<tool_call>"
                    keep = _partial_suffix(self._buf, TOOL_CALL_OPEN)
                    safe = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(safe) :]
                    self._emit_text(safe, events)
                    return events
                self._emit_text(self._buf[:i], events)
                self._buf = self._buf[i:]
                self._in_call = True
            j = self._buf.find(TOOL_CALL_CLOSE)
            if j < 0:
                return events
            block = self._buf[: j + len(TOOL_CALL_CLOSE)]
            self._buf = self._buf[len(block) :]
            self._in_call = False
            raw = block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)]
            call = parse_tool_call_json(raw) or (failed_tool_call(raw) if self.forced else None)
            if call is None:
                self._emit_text(block, events)
            else:
                self.calls.append(call)
                events.append(("tool_call", call))

    def finish(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        rest, self._buf = self._buf, ""
        if self._in_call:
            # an unterminated block: accept it when it holds a complete call (the model often
            # stops right after the JSON), else it is plain text
            raw = rest[len(TOOL_CALL_OPEN) :]
            call = parse_tool_call_json(raw) or (failed_tool_call(raw) if self.forced else None)
            if call is not None:
                self.calls.append(call)
                events.append(("tool_call", call))
                rest = ""
        self._in_call = False
        self._emit_text(rest, events)
        return events

    def _emit_text(self, text: str, events: list[tuple[str, Any]]) -> None:
        if text:
            self.content_parts.append(text)
            events.append(("text", text))

    @property
    def content(self) -> str:
        return "".join(self.content_parts)


def parse_tool_call_json(raw: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` -> ToolCall, or None when it is not one."""
    try:
        obj = json.loads(raw.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):  # OpenAI arguments (and Anthropic input) are JSON objects
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def failed_tool_call(raw: str) -> ToolCall:
    """A call the model did not complete: its name when it wrote one, and the raw text after
    `"arguments":` (or all of it) as arguments."""
    match = re.match(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"', raw)
    at = raw.find('"arguments"')
    colon = raw.find(":", at) if at >= 0 else -1
    arguments = raw[colon + 1 :] if colon >= 0 else raw
    return ToolCall(match.group(1) if match else "", arguments.strip(), valid=False)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Whole generated text -> (content outside tool calls, tool calls)."""
    parser = ToolCallParser()
    parser.push(text)
    parser.finish()
    return parser.content, parser.calls


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


class StopTrimmer:
    """Cuts text at the first stop string (OpenAI returns text *before* the stop), streaming.

    Holds back the last `max(len(stop)) - 1` characters until they cannot start a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text, if one did."""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._buf += text
        hits = [(i, s) for s in self.stops if (i := self._buf.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            out, self._buf, self.stopped = self._buf[:cut], "", True
            return out
        safe = len(self._buf) - self._hold
        if safe <= 0:
            return ""
        out, self._buf = self._buf[:safe], self._buf[safe:]
        return out

    def finish(self) -> str:
        out, self._buf = self._buf, ""
        return "" if self.stopped else out


class IncrementalDecoder:
    """Detokenizes a growing id list chunk by chunk without re-decoding everything each time.

    Keeps a short window (vLLM's prefix/read offsets) so each push decodes a few tokens, and holds
    back text that ends in an incomplete UTF-8 sequence. Special tokens are skipped.
    """

    def __init__(self, renderer: Renderer) -> None:
        self._decode = renderer.decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read]) if self._read else ""
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def finish(self) -> str:
        if self._read == len(self.ids):  # nothing held back
            return ""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


# ---------------------------------------------------------------------------------------------
# Messages


def content_text(content: Any, where: str) -> str:
    """OpenAI content (string, None or a list of text parts) -> string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise RenderError(
                    f"{where}[{i}]: only text content parts are supported, got type {kind!r}"
                )
        return "".join(parts)
    raise RenderError(f"{where}: content must be a string or a list of text parts")


def message_key(msg: Message) -> tuple:
    """What identifies a message for history matching: role, text, tool calls (ids ignored).

    Text is compared without surrounding whitespace: clients drop a whitespace-only content
    next to tool calls (None), and some strip replies; the ids reused are the sampled ones."""
    calls = tuple(
        (c["function"]["name"], _canonical_args(c["function"].get("arguments", "")))
        for c in msg.get("tool_calls") or ()
    )
    return (
        msg["role"],
        (msg.get("content") or "").strip(),
        calls,
        msg.get("tool_call_id") or "",
        msg.get("name") or "" if msg["role"] != "assistant" else "",
    )


def _canonical_args(arguments: Any) -> str:
    if not isinstance(arguments, str):
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()
    try:
        return orjson.dumps(orjson.loads(arguments), option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONDecodeError:
        return arguments


def tools_key(tools: list[dict[str, Any]] | None) -> bytes:
    return orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS)


# ---------------------------------------------------------------------------------------------
# The renderer


class RenderMemo:
    """Full renders by request content, least recently used first out, bounded by the tokens
    held (as int32 arrays: 4 bytes a token). Thread-safe: large inputs render off the loop."""

    def __init__(self, enabled: bool = True, max_tokens: int = 1 << 20) -> None:
        self.enabled, self.max_tokens = enabled, max_tokens
        self.held = self.hits = self.misses = 0
        self._ids: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> list[int] | None:
        if not self.enabled:
            return None
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                self.misses += 1
                return None
            self.hits += 1
            self._ids.move_to_end(key)
        return ids.tolist()

    def put(self, key: bytes, ids: list[int]) -> None:
        if not self.enabled or len(ids) > self.max_tokens // 4:
            return
        with self._lock:
            if key not in self._ids:
                self._ids[key] = array("i", ids)
                self.held += len(ids)
            while self.held > self.max_tokens:
                self.held -= len(self._ids.popitem(last=False)[1])


class Renderer:
    """Messages <-> token ids for one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._fast = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None
        )
        template = tokenizer.chat_template or ""
        if not isinstance(template, str):
            raise ValueError("the tokenizer has several chat templates; pass a single one")
        if not template:
            raise ValueError(
                "the tokenizer has no chat template; use an instruction-tuned model folder"
            )
        self.native_tools = "tools" in template
        # a template that reads the clock (`strftime_now`) renders differently tomorrow
        self.renders = RenderMemo(enabled="strftime_now" not in template)
        self._anchor_text: dict[bytes, str] = {}
        self.eos_ids = _eos_ids(tokenizer)
        self.special_ids = set(tokenizer.all_special_ids)
        # The text of one assistant turn around its content, found with a marker, e.g. ChatML:
        # head "<|im_start|>assistant\n", tail "<|im_end|>\n".
        anchor: list[Message] = [{"role": "system", "content": "S"}]
        base = self.render_text(anchor, None, add_generation_prompt=False)
        with_gen = self.render_text(anchor, None, add_generation_prompt=True)
        full = self.render_text(
            anchor + [{"role": "assistant", "content": _MARK}], None, add_generation_prompt=False
        )
        self.generation_prompt = with_gen[len(base) :]
        turn = full[len(base) :]
        head, _, tail = turn.partition(_MARK)
        self.assistant_tail = tail
        eos_text = tokenizer.eos_token or ""
        # After a generation that ended on EOS, the template still adds what follows EOS.
        self.tail_after_eos = (
            tail[len(eos_text) :] if eos_text and tail.startswith(eos_text) else None
        )
        self.tail_after_eos_ids = self.encode(self.tail_after_eos or "")
        self.tail_ids = self.encode(tail)
        self.append_only = head == self.generation_prompt and self._check_append_only()

    # -- tokenizer helpers

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to (x2 for merges at token boundaries): a text
        of N characters is at least N / max_token_chars tokens, whatever the tokenizer does."""
        return 2 * max(len(self.decode([i])) for i in range(len(self.tokenizer)))

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs); special tokens keep their name."""
        if token_id in self.special_ids:
            return self.tokenizer.convert_ids_to_tokens(token_id)
        return self.decode([token_id])

    # -- rendering

    def prepare(self, messages: list[Message], tools: list[dict] | None) -> list[Message]:
        """Apply the Hermes tool convention when the template does not render tools itself."""
        if self.native_tools:
            return messages
        out: list[Message] = []
        if tools:
            tools_text = HERMES_TOOLS_PROMPT.format(
                tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            )
            if messages and messages[0]["role"] == "system":
                first = dict(messages[0])
                first["content"] = (first.get("content") or "") + "\n\n" + tools_text
                messages = [first, *messages[1:]]
            else:
                messages = [{"role": "system", "content": tools_text}, *messages]
        for msg in messages:
            role = msg["role"]
            if role == "assistant" and msg.get("tool_calls"):
                text = msg.get("content") or ""
                for call in msg["tool_calls"]:
                    fn = call["function"]
                    args = fn.get("arguments") or "{}"
                    try:
                        args_obj = json.loads(args) if isinstance(args, str) else args
                    except ValueError:
                        args_obj = args
                    body = json.dumps(
                        {"name": fn["name"], "arguments": args_obj}, ensure_ascii=False
                    )
                    text += ("\n" if text else "") + f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
                out.append({"role": "assistant", "content": text})
            elif role == "tool":
                block = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
                if out and out[-1].get("_tool_turn"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "_tool_turn": True})
            else:
                out.append({"role": role, "content": msg.get("content") or ""})
        for msg in out:
            msg.pop("_tool_turn", None)
        return out

    def render_text(
        self,
        messages: list[Message],
        tools: list[dict] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        prepared = self.prepare(messages, tools)
        kwargs: dict[str, Any] = {}
        if self.native_tools and tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                prepared, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # jinja raises anything (TemplateError, TypeError, ...)
            raise RenderError(f"messages: the chat template cannot render them: {e}") from None
        return text

    def render(
        self, messages: list[Message], tools: list[dict] | None = None, prefill: str = ""
    ) -> list[int]:
        """Full render of a conversation plus the generation prompt (and an optional prefill).
        Remembered (`renders`): the n sessions of a GRPO group open with the same first turn,
        and chat templating plus tokenizing is the largest CPU cost of a short request."""
        key = orjson.dumps([messages, tools, prefill]) if self.renders.enabled else b""
        ids = self.renders.get(key)
        if ids is None:
            ids = self.encode(self.render_text(messages, tools) + prefill)
            self.renders.put(key, ids)
        return ids

    def render_continuation(
        self, prefix: list[Message], new: list[Message], tools: list[dict] | None
    ) -> list[int] | None:
        """Ids of `new` plus the generation prompt, as they follow `prefix` in a full render.

        Append-only templates render `new` alone behind a one-message anchor (cost independent
        of the history length); others render both whole and take the text difference. None when
        the full render does not extend the prefix's render (the template is not append-only
        here): the caller forks.
        """
        if self.append_only:
            anchor: list[Message] = [{"role": "system", "content": "S"}]
            key = tools_key(tools)
            base = self._anchor_text.get(key)
            if base is None:
                if len(self._anchor_text) > 64:
                    self._anchor_text.clear()
                base = self._anchor_text[key] = self.render_text(
                    anchor, tools, add_generation_prompt=False
                )
            text = self.render_text(anchor + new, tools)
            return self.encode(text[len(base) :])
        base = self.render_text(prefix, tools, add_generation_prompt=False)
        text = self.render_text(prefix + new, tools)
        if not text.startswith(base):
            return None
        return self.encode(text[len(base) :])

    def closing_ids(self, output_ids: Sequence[int]) -> list[int]:
        """Template ids that follow a sampled assistant turn in the next prompt."""
        if output_ids and output_ids[-1] in self.eos_ids and self.tail_after_eos is not None:
            return list(self.tail_after_eos_ids)
        return list(self.tail_ids)

    def _check_append_only(self) -> bool:
        """Is rendering message by message behind an anchor the same as a full render?"""
        convo: list[Message] = [
            {"role": "system", "content": "You are a test."},
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye."},
        ]
        try:
            full = self.render_text(convo, None, add_generation_prompt=True)
            anchor: list[Message] = [{"role": "system", "content": "S"}]
            base = self.render_text(anchor, None, add_generation_prompt=False)
            pieces = self.render_text(convo[:1], None, add_generation_prompt=False)
            for msg in convo[1:]:
                pieces += self.render_text(anchor + [msg], None, add_generation_prompt=False)[
                    len(base) :
                ]
            pieces += self.generation_prompt
        except RenderError:
            return False
        return pieces == full


def _eos_ids(tokenizer: Any) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    path = getattr(tokenizer, "name_or_path", "")
    gen = Path(path) / "generation_config.json" if path else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def load_renderer(model_path: str | Path) -> Renderer:
    from transformers import AutoTokenizer

    return Renderer(AutoTokenizer.from_pretrained(str(model_path)))


# ---------------------------------------------------------------------------------------------
# Token-in-token-out history


@dataclass(eq=False)
class _Call:
    """One earlier call of a session: its request, prompt ids, and what each choice returned."""

    keys: tuple[tuple, ...]
    tools: bytes
    prefill: str
    prompt_ids: list[int]
    choices: list[tuple[tuple, list[int]]] = field(default_factory=list)
    """(key of the assistant message returned, output ids + closing ids)."""
    recorded: bool = False


@dataclass
class Prompt:
    """What to send to the engine for one request."""

    ids: list[int]
    reused: int = 0
    """Leading ids taken verbatim from an earlier call (0 when rendered from scratch)."""
    forked: bool = False
    """The session had history but this request extends none of it."""


class TokenHistory:
    """A session's earlier calls, for token-in-token-out prompts."""

    def __init__(self, max_calls: int = 256) -> None:
        self.calls: list[_Call] = []
        self.max_calls = max_calls

    def prompt(
        self,
        renderer: Renderer,
        messages: list[Message],
        tools: list[dict] | None,
        prefill: str = "",
    ) -> tuple[Prompt, _Call]:
        """The prompt ids for a request, reusing earlier ids where the history matches."""
        keys = tuple(message_key(m) for m in messages)
        tkey = tools_key(tools)
        best_n, best_ids = 0, None
        for call in reversed(self.calls):
            if call.tools != tkey:
                continue
            if keys == call.keys and prefill == call.prefill:
                # the same request again (a retry, or a sibling sample): the same prompt
                ids = list(call.prompt_ids)
                return Prompt(ids, reused=len(ids)), _Call(keys, tkey, prefill, ids)
            n = len(call.keys)
            if n + 1 > len(keys) or n + 1 <= best_n or keys[:n] != call.keys:
                continue
            for reply_key, ids in call.choices:
                if keys[n] == reply_key:
                    best_n, best_ids = n + 1, call.prompt_ids + ids
                    break
        prompt: Prompt | None = None
        if best_ids is not None:
            cont = renderer.render_continuation(messages[:best_n], messages[best_n:], tools)
            if cont is not None:
                cont += renderer.encode(prefill)
                prompt = Prompt(best_ids + cont, reused=len(best_ids))
        if prompt is None:
            prompt = Prompt(renderer.render(messages, tools, prefill), forked=bool(self.calls))
        return prompt, _Call(keys, tkey, prefill, prompt.ids)

    def record(
        self, renderer: Renderer, call: _Call, reply: Message, output_ids: list[int]
    ) -> None:
        """Remember a finished choice: the message the client got and the ids behind it."""
        if not call.recorded:
            call.recorded = True
            self.calls.append(call)
            if len(self.calls) > self.max_calls:
                del self.calls[0]
        call.choices.append(
            (message_key(reply), list(output_ids) + renderer.closing_ids(output_ids))
        )
