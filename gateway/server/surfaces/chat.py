"""OpenAI `/v1/chat/completions`: messages, tools, `n`, logprobs, streaming with usage."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from gateway.render import Message
from gateway.server.request import Event, GenRequest, Job, ToolChoice
from gateway.server.surfaces.base import Surface, sse, stops, text_of, usage
from gateway.server.validation import ApiError, StrictModel, validate

SEED = Field(None, ge=-(2**63), le=2**63 - 1)


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: bool = False


class ChatCompletionRequest(StrictModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = SEED


class ChatCompletions(Surface):
    name = "chat"
    path = "/v1/chat/completions"

    def parse(self, body: Any) -> GenRequest:
        req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        choice: ToolChoice = (
            req.tool_choice or "auto"
            if isinstance(req.tool_choice, str | None)
            else ("named", req.tool_choice.function.name)
        )
        return GenRequest(
            endpoint=self.name,
            model=req.model,
            messages=[_message(m, i) for i, m in enumerate(req.messages)],
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            tool_choice=choice,
            n=req.n,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=stops(req.stop),
            top_logprobs=req.top_logprobs or 0,
            stream=req.stream,
            wire=req,
        )

    def token_logprobs(self, ev: Event) -> list[dict[str, Any]]:
        """`logprobs.content`: each token with its `top_logprobs` alternatives."""

        def entry(tid: int, lp: float) -> dict[str, Any]:
            text = self.renderer.token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        tops = ev.top or [[] for _ in ev.tokens]
        return [
            {**entry(tid, lp), "top_logprobs": [entry(t, x) for t, x in top]}
            for (tid, lp), top in zip(ev.tokens, tops, strict=True)
        ]

    def reply(self, job: Job, results: list[Event]) -> dict[str, Any]:
        logprobs = job.req.wire.logprobs
        choices = []
        for i, ev in enumerate(results):
            msg: dict[str, Any] = {"role": "assistant", "content": ev.text}
            if ev.tool_calls:
                msg["tool_calls"] = [c.to_openai() for c in ev.tool_calls]
                if not ev.text.strip():
                    msg["content"] = None
            choices.append(
                {
                    "index": i,
                    "message": msg,
                    "finish_reason": ev.client_finish,
                    "logprobs": {"content": self.token_logprobs(ev)} if logprobs else None,
                }
            )
        return {
            "id": "chatcmpl-" + job.request_id,
            "object": "chat.completion",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(job.prompt_ids), sum(ev.output_tokens for ev in results)),
        }

    def streamer(self, job: Job) -> _ChatStream:
        return _ChatStream(self, job)


class _ChatStream:
    def __init__(self, surface: ChatCompletions, job: Job) -> None:
        self.surface, self.job = surface, job
        wire = job.req.wire
        self.logprobs = wire.logprobs
        self.include_usage = bool(wire.stream_options and wire.stream_options.include_usage)
        self.head = {
            "id": "chatcmpl-" + job.request_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": surface.model_name,
        }
        self.started: set[int] = set()
        self.num_calls: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}

    def _chunk(self, i: int, delta: dict, logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**self.head, "choices": [choice]})

    def events(self, i: int, ev: Event) -> list[bytes]:
        out = []
        if i not in self.started:
            self.started.add(i)
            out.append(self._chunk(i, {"role": "assistant", "content": ""}))
        delta: dict[str, Any] = {}
        if ev.text:
            delta["content"] = ev.text
        if ev.tool_calls:
            k = self.num_calls.get(i, 0)
            delta["tool_calls"] = [
                {"index": k + j, **c.to_openai()} for j, c in enumerate(ev.tool_calls)
            ]
            self.num_calls[i] = k + len(ev.tool_calls)
        lp = None
        if self.logprobs and ev.tokens:
            lp = {"content": self.surface.token_logprobs(ev)}
        if delta or lp:
            out.append(self._chunk(i, delta, lp))
        if ev.finish is not None:
            self.completion_tokens[i] = ev.output_tokens
            out.append(self._chunk(i, {}, finish=ev.client_finish))
        return out

    def end(self) -> list[bytes]:
        out = []
        if self.include_usage:
            used = usage(len(self.job.prompt_ids), sum(self.completion_tokens.values()))
            out.append(sse({**self.head, "choices": [], "usage": used}))
        out.append(b"data: [DONE]\n\n")
        return out

    def error(self, e: ApiError) -> bytes:
        return sse(e.openai_body())


def _message(m: ChatMessage, i: int) -> Message:
    content = text_of(m.content, f"messages.{i}.content")
    role = "system" if m.role == "developer" else m.role
    msg: Message = {"role": role, "content": content}
    if m.tool_calls:
        msg["tool_calls"] = [
            {
                "id": c.id or f"call_{i}_{j}",
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": c.function.arguments
                    if isinstance(c.function.arguments, str)
                    else json.dumps(c.function.arguments),
                },
            }
            for j, c in enumerate(m.tool_calls)
        ]
    if m.role == "tool":
        msg["tool_call_id"] = m.tool_call_id or ""
    if m.name:
        msg["name"] = m.name
    return msg
