"""Anthropic `/v1/messages`: content blocks to chat messages and back, Anthropic error shape."""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
from pydantic import Field

from gateway.render import Message, ToolCall
from gateway.server.request import Event, GenRequest, Job, ToolChoice
from gateway.server.surfaces.base import Surface, named_sse, text_of
from gateway.server.validation import ApiError, StrictModel, validate


class AnthropicTool(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicRequest(StrictModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stream: bool = False


class Messages(Surface):
    name = "messages"
    path = "/v1/messages"

    def error_body(self, e: ApiError) -> dict[str, Any]:
        return e.anthropic_body()

    def parse(self, body: Any) -> GenRequest:
        req: AnthropicRequest = validate(AnthropicRequest, body)
        tools = None
        if req.tools:
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description or "",
                        "parameters": t.input_schema,
                    },
                }
                for t in req.tools
            ]
        return GenRequest(
            endpoint=self.name,
            model=req.model,
            messages=_messages(req),
            tools=tools,
            tool_choice=_tool_choice(req.tool_choice),
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=list(req.stop_sequences or ()),
            stream=req.stream,
            wire=req,
            names={"stop": "stop_sequences"},
        )

    @staticmethod
    def stop_reason(ev: Event) -> str:
        if ev.finish == "tool_calls":  # (a streamed call came in an earlier event)
            return "tool_use"
        if ev.client_finish == "length":
            return "max_tokens"
        return "stop_sequence" if ev.stop_sequence else "end_turn"

    @staticmethod
    def tool_block(c: ToolCall) -> dict[str, Any]:
        # a failed forced call (not JSON) keeps the model's text, clearly marked
        args = orjson.loads(c.arguments) if c.valid else {"invalid_json": c.arguments}
        return {
            "type": "tool_use",
            "id": c.id,
            "name": c.name,
            "input": args if isinstance(args, dict) else {"value": args},
        }

    def reply(self, job: Job, results: list[Event]) -> dict[str, Any]:
        (ev,) = results
        content: list[dict[str, Any]] = []
        if ev.text and not (ev.tool_calls and not ev.text.strip()):
            content.append({"type": "text", "text": ev.text})
        content += [self.tool_block(c) for c in ev.tool_calls]
        return {
            "id": "msg_" + job.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": self.stop_reason(ev),
            "stop_sequence": ev.stop_sequence,
            "usage": {"input_tokens": len(job.prompt_ids), "output_tokens": ev.output_tokens},
        }

    def streamer(self, job: Job) -> _MessageStream:
        return _MessageStream(self, job)


class _MessageStream:
    def __init__(self, surface: Messages, job: Job) -> None:
        self.surface, self.job = surface, job
        self.started = False
        self.block = -1
        self.text_open = False

    @staticmethod
    def event(kind: str, **data: Any) -> bytes:
        return named_sse(kind, {"type": kind, **data})

    def events(self, _i: int, ev: Event) -> list[bytes]:
        event = self.event
        out = []
        if not self.started:
            self.started = True
            message = {
                "id": "msg_" + self.job.request_id,
                "type": "message",
                "role": "assistant",
                "model": self.surface.model_name,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": len(self.job.prompt_ids), "output_tokens": 0},
            }
            out.append(event("message_start", message=message))
        if ev.text:
            if not self.text_open:
                self.text_open = True
                self.block += 1
                block = {"type": "text", "text": ""}
                out.append(event("content_block_start", index=self.block, content_block=block))
            delta = {"type": "text_delta", "text": ev.text}
            out.append(event("content_block_delta", index=self.block, delta=delta))
        for c in ev.tool_calls:
            if self.text_open:
                self.text_open = False
                out.append(event("content_block_stop", index=self.block))
            self.block += 1
            b = self.block
            block = {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}
            block_input = self.surface.tool_block(c)["input"]
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block_input).decode()}
            out += [
                event("content_block_start", index=b, content_block=block),
                event("content_block_delta", index=b, delta=delta),
                event("content_block_stop", index=b),
            ]
        if ev.finish is not None:
            if self.text_open:
                out.append(event("content_block_stop", index=self.block))
            stop = {"stop_reason": self.surface.stop_reason(ev), "stop_sequence": ev.stop_sequence}
            out += [
                event("message_delta", delta=stop, usage={"output_tokens": ev.output_tokens}),
                event("message_stop"),
            ]
        return out

    def end(self) -> list[bytes]:
        return []

    def error(self, e: ApiError) -> bytes:
        return self.event("error", **e.anthropic_body())


def _tool_choice(choice: dict[str, Any] | None) -> ToolChoice:
    if not choice:
        return "auto"
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return ("named", choice["name"])
    if kind in ("auto", "none"):
        return kind
    raise ApiError(
        400, "tool_choice.type: auto, any, tool (with name) or none", param="tool_choice"
    )


def _messages(req: AnthropicRequest) -> list[Message]:
    messages: list[Message] = []
    if req.system:
        messages.append({"role": "system", "content": text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        text, calls = "", []
        for j, b in enumerate(blocks):
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                text += b["text"]
            elif kind == "tool_use" and m.role == "assistant" and isinstance(b.get("name"), str):
                calls.append(
                    {
                        "id": str(b.get("id") or f"toolu_{i}_{j}"),
                        "type": "function",
                        "function": {
                            "name": b["name"],
                            "arguments": json.dumps(b.get("input") or {}),
                        },
                    }
                )
            elif kind == "tool_result" and m.role == "user":
                out = b.get("content") or ""
                out = out if isinstance(out, str) else text_of(out, f"{where}.{j}.content")
                call_id = b.get("tool_use_id")
                messages.append(
                    {
                        "role": "tool",
                        "content": out,
                        "tool_call_id": call_id if isinstance(call_id, str) else "",
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ApiError(
                    400,
                    f"{where}.{j}.type: {kind!r} is not supported in a {m.role} message "
                    "(text, tool_use, tool_result)",
                    param=f"{where}.{j}.type",
                )
        if m.role == "assistant":
            msg: Message = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
        elif text or not any(b.get("type") == "tool_result" for b in blocks):
            messages.append({"role": "user", "content": text})
    return messages
