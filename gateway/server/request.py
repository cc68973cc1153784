"""The one internal request every API surface translates to, and what the core makes of it.

`GenRequest` is a request in the gateway's terms (chat messages or a raw prompt, tools, sampling,
limits-relevant sizes); `check_limits` applies `RequestLimits` and the `max_tokens` maximum to
it, so a limit exists once and holds on every surface. `Job` is a planned request (prompt ids,
one `SamplingParams` per choice); `Event` is what one engine chunk of one choice became.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.engines.base import SamplingParams
from gateway.render import Message, ToolCall, _Call
from gateway.server.validation import ApiError, RequestLimits
from gateway.sessions import Session
from gateway.trajectory import Turn

ToolChoice = str | tuple[str, str]
"""`auto`, `none`, `required`, or ("named", function name)."""


@dataclass
class GenRequest:
    """One request of any API surface, in the gateway's terms."""

    endpoint: str
    model: str
    messages: list[Message] | None = None
    """Chat messages (chat, responses, messages); None for a raw completions prompt."""
    prompt: str | list[int] | None = None
    """Completions: the prompt text or token ids (no chat template)."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI chat tools: {"type": "function", "function": {name, description, parameters}}."""
    tool_choice: ToolChoice = "auto"
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    stream: bool = False
    wire: Any = None
    """The surface's validated request, for building its reply."""
    names: dict[str, str] = field(default_factory=dict)
    """Wire names of fields that differ from the internal ones (for error messages)."""
    body_bytes: int = 0

    def name(self, field_name: str) -> str:
        return self.names.get(field_name, field_name)


@dataclass
class Event:
    """What one engine chunk of one choice turned into for the client."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tokens: list[tuple[int, float]] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, the most likely (id, logprob) at its position (when top logprobs are asked)."""
    finish: str | None = None
    """Set on the last event: stop, length, tool_calls or abort."""
    stop_sequence: str | None = None
    output_tokens: int = 0

    @property
    def client_finish(self) -> str:
        # "abort" (stopped by close or pause) is not an OpenAI finish reason: the output is cut
        return "length" if self.finish == "abort" else self.finish or "stop"


@dataclass
class Job:
    """One request on its way to the engine: prompt ids and how to read each choice's output."""

    session: Session
    req: GenRequest
    call: _Call
    prompt_ids: list[int]
    params: list[SamplingParams]
    parse_tools: bool
    prefill: str
    request_id: str = field(default_factory=lambda: secrets.token_hex(8))
    created: int = field(default_factory=lambda: int(time.time()))
    turns: list[Turn] = field(default_factory=list)
    client_gone: bool = False

    def rid(self, index: int) -> str:
        """The engine's request id of choice `index`."""
        return f"{self.request_id}-{index}"

    def mark_undelivered(self) -> None:
        self.client_gone = True
        for turn in self.turns:
            turn.delivered = False


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


def check_limits(req: GenRequest, limits: RequestLimits, max_tokens_limit: int | None) -> None:
    """The limits of `RequestLimits` and `max_tokens`, the same for every surface."""
    lim = limits
    if req.messages is not None and len(req.messages) > lim.max_messages:
        name = req.name("messages")
        raise ApiError(400, f"{name}: at most {lim.max_messages} items", param=name)
    if len(req.stop) > lim.max_stop or any(not s or len(s) > lim.max_stop_chars for s in req.stop):
        name = req.name("stop")
        raise ApiError(
            400,
            f"{name}: up to {lim.max_stop} non-empty strings of at most "
            f"{lim.max_stop_chars} characters",
            param=name,
        )
    if req.tools:
        if len(req.tools) > lim.max_tools:
            raise ApiError(400, f"tools: at most {lim.max_tools} tools", param="tools")
        for i, tool in enumerate(req.tools):
            if len(orjson.dumps(tool)) > lim.max_tool_schema_bytes:
                raise ApiError(
                    400,
                    f"tools.{i}: the tool definition is over {lim.max_tool_schema_bytes} bytes",
                    param=f"tools.{i}",
                )
    if not 1 <= req.n <= lim.max_n:
        raise ApiError(400, f"n: must be in [1, {lim.max_n}]", param="n")
    if req.max_tokens is not None:
        name = req.name("max_tokens")
        if req.max_tokens < 1:
            raise ApiError(400, f"{name}: must be >= 1", param=name)
        if max_tokens_limit and req.max_tokens > max_tokens_limit:
            raise ApiError(
                400,
                f"{name}: at most {max_tokens_limit} on this gateway",
                param=name,
            )


def tool_prefill(req: GenRequest) -> str:
    """Text written into the prompt to force a tool call (any engine can do that; no
    constrained decoding)."""
    choice, tools = req.tool_choice, req.tools or []
    if choice == "required":
        if not tools:
            raise ApiError(400, "tool_choice=required needs tools", param="tool_choice")
        return '<tool_call>\n{"name": "'
    if not isinstance(choice, tuple):
        return ""
    name = choice[1]
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise ApiError(
            400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    # up to the first argument's opening quote when it has parameters, which keeps small
    # models on the JSON-object track
    schema = tool["function"].get("parameters") or {}
    has_params = isinstance(schema, dict) and bool(schema.get("properties"))
    return (
        '<tool_call>\n{"name": '
        + json.dumps(name)
        + ', "arguments": {'
        + ('"' if has_params else "")
    )


def sampling_params(session: Session, req: GenRequest, max_tokens: int) -> list[SamplingParams]:
    """One SamplingParams per choice (seed + i each); the session's forced fields win."""
    try:
        return [
            SamplingParams(
                **{
                    "max_tokens": max_tokens,
                    "temperature": 1.0 if req.temperature is None else req.temperature,
                    "top_p": 1.0 if req.top_p is None else req.top_p,
                    "top_k": req.top_k or 0,
                    "stop": tuple(req.stop),
                    "seed": None if req.seed is None else req.seed + i,
                    "top_logprobs": req.top_logprobs,
                    **session.sampling,
                }
            )
            for i in range(req.n)
        ]
    except ValueError as e:
        raise ApiError(400, str(e)) from None
