"""OpenAI `/v1/responses` (the subset agent SDKs use; store=false: send the whole input).

Input items become chat messages: `message` items by role, `function_call` items the assistant's
tool calls (consecutive assistant items are one turn), `function_call_output` items tool
messages; `reasoning` items are skipped.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.render import Message, ToolCall
from gateway.server.request import Event, GenRequest, Job, ToolChoice
from gateway.server.surfaces.base import Surface, named_sse, stops, text_of
from gateway.server.surfaces.chat import SEED
from gateway.server.validation import ApiError, StrictModel, validate


class ResponsesTool(StrictModel):
    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    """Extension (not in OpenAI's Responses API): stop strings, as in chat completions."""
    seed: int | None = SEED
    """Extension: a sampling seed, as in chat completions."""


class Responses(Surface):
    name = "responses"
    path = "/v1/responses"

    def parse(self, body: Any) -> GenRequest:
        req: ResponsesRequest = validate(ResponsesRequest, body)
        if req.previous_response_id:
            raise ApiError(
                400,
                "previous_response_id is not supported: send the whole input (store=false)",
                param="previous_response_id",
            )
        tools = None
        if req.tools:
            tools = []
            for i, t in enumerate(req.tools):
                if t.type != "function" or not t.name:
                    raise ApiError(
                        400,
                        f"tools[{i}]: only function tools (with a name) are supported, got "
                        f"type {t.type!r}",
                        param=f"tools.{i}",
                    )
                fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
                tools.append(
                    {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}
                )
        return GenRequest(
            endpoint=self.name,
            model=req.model,
            messages=_messages(req),
            tools=tools,
            tool_choice=_tool_choice(req.tool_choice),
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=stops(req.stop),
            stream=req.stream,
            wire=req,
            names={"messages": "input", "max_tokens": "max_output_tokens"},
        )

    def response(self, job: Job, status: str, output: list[dict], ev: Event | None) -> dict:
        req: ResponsesRequest = job.req.wire
        obj: dict[str, Any] = {
            "id": "resp_" + job.request_id,
            "object": "response",
            "created_at": job.created,
            "status": status,
            "model": self.model_name,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "parallel_tool_calls": True,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "max_output_tokens": req.max_output_tokens,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": None,
        }
        if ev is not None:
            if ev.client_finish == "length":
                obj["status"] = "incomplete"
                obj["incomplete_details"] = {"reason": "max_output_tokens"}
            p, c = len(job.prompt_ids), ev.output_tokens
            obj["usage"] = {
                "input_tokens": p,
                "output_tokens": c,
                "total_tokens": p + c,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return obj

    @staticmethod
    def message_item(job: Job, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": "msg_" + job.request_id,
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else content,
        }

    @staticmethod
    def call_item(c: ToolCall, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": "fc_" + c.id.removeprefix("call_"),
            "call_id": c.id,
            "name": c.name,
            "arguments": c.arguments if status == "completed" else "",
            "status": status,
        }

    def reply(self, job: Job, results: list[Event]) -> dict[str, Any]:
        (ev,) = results
        output = []
        if ev.text and not (ev.tool_calls and not ev.text.strip()):
            output.append(self.message_item(job, ev.text, "completed"))
        output += [self.call_item(c, "completed") for c in ev.tool_calls]
        return self.response(job, "completed", output, ev)

    def streamer(self, job: Job) -> _ResponseStream:
        return _ResponseStream(self, job)


class _ResponseStream:
    def __init__(self, surface: Responses, job: Job) -> None:
        self.surface, self.job = surface, job
        self.seq = 0
        self.text_parts: list[str] = []
        self.output: list[dict[str, Any]] = []
        self.msg_open = False

    def event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return named_sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def close_message(self) -> list[bytes]:
        if not self.msg_open:
            return []
        self.msg_open = False
        text = "".join(self.text_parts)
        idx = len(self.output)
        item = self.surface.message_item(self.job, text, "completed")
        self.output.append(item)
        common = {"item_id": item["id"], "output_index": idx, "content_index": 0}
        return [
            self.event("response.output_text.done", **common, text=text, logprobs=[]),
            self.event("response.content_part.done", **common, part=item["content"][0]),
            self.event("response.output_item.done", output_index=idx, item=item),
        ]

    def events(self, _i: int, ev: Event) -> list[bytes]:
        surface, job = self.surface, self.job
        out: list[bytes] = []
        if self.seq == 0:
            start = surface.response(job, "in_progress", [], None)
            out += [
                self.event("response.created", response=start),
                self.event("response.in_progress", response=start),
            ]
        if ev.text:
            idx = len(self.output)
            if not self.msg_open:
                self.msg_open = True
                item = surface.message_item(job, "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += [
                    self.event("response.output_item.added", output_index=idx, item=item),
                    self.event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=idx,
                        content_index=0,
                        part=part,
                    ),
                ]
            self.text_parts.append(ev.text)
            out.append(
                self.event(
                    "response.output_text.delta",
                    item_id="msg_" + job.request_id,
                    output_index=idx,
                    content_index=0,
                    delta=ev.text,
                    logprobs=[],
                )
            )
        for c in ev.tool_calls:
            out += self.close_message()
            idx = len(self.output)
            item, done = surface.call_item(c, "in_progress"), surface.call_item(c, "completed")
            self.output.append(done)
            ids = {"item_id": item["id"], "output_index": idx}
            out += [
                self.event("response.output_item.added", output_index=idx, item=item),
                self.event("response.function_call_arguments.delta", **ids, delta=c.arguments),
                self.event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=c.name,
                    arguments=c.arguments,
                ),
                self.event("response.output_item.done", output_index=idx, item=done),
            ]
        if ev.finish is not None:
            out += self.close_message()
            final = surface.response(job, "completed", self.output, ev)
            done_kind = "completed" if final["status"] == "completed" else "incomplete"
            out.append(self.event("response." + done_kind, response=final))
        return out

    def end(self) -> list[bytes]:
        return []

    def error(self, e: ApiError) -> bytes:
        return self.event("error", code=e.code, message=e.message, param=e.param)


def _tool_choice(choice: str | dict[str, Any] | None) -> ToolChoice:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ApiError(
                400, "tool_choice: auto, none, required or a function", param="tool_choice"
            )
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400, "tool_choice: only {type: function, name} is supported", param="tool_choice"
        )
    return ("named", name)


def _messages(req: ResponsesRequest) -> list[Message]:
    messages: list[Message] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(
                    400,
                    f"{where}.role: user, assistant, system or developer",
                    param=f"{where}.role",
                )
            text = text_of(item.get("content"), f"{where}.content")
            role = "system" if role == "developer" else role
            prev = messages[-1] if messages else None
            # consecutive assistant items (text and function calls, in any order) are one turn
            if role == "assistant" and prev and prev["role"] == "assistant":
                prev["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            args = item.get("arguments", "")
            if not all(isinstance(x, str) for x in (name, call_id, args)):
                raise ApiError(
                    400,
                    f"{where}: function_call needs string name, call_id, arguments",
                    param=where,
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            prev = messages[-1] if messages else None
            if prev and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else text_of(output, f"{where}.output")
            call_id = item.get("call_id")
            messages.append(
                {
                    "role": "tool",
                    "content": text,
                    "tool_call_id": call_id if isinstance(call_id, str) else "",
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(
                400,
                f"{where}.type: {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                param=f"{where}.type",
            )
    if not messages or all(m["role"] == "system" for m in messages):
        raise ApiError(400, "input: no messages", param="input")
    return messages
