"""The `Surface` interface and the wire-format helpers every surface shares."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from gateway.render import Renderer, RenderError, content_text
from gateway.server.request import Event, GenRequest, Job
from gateway.server.validation import ApiError


class Streamer(Protocol):
    """Formats one streamed reply; one instance per request."""

    def events(self, index: int, ev: Event) -> list[bytes]:
        """SSE bytes for an event of choice `index`."""
        ...

    def end(self) -> list[bytes]:
        """SSE bytes after every choice finished."""
        ...

    def error(self, e: ApiError) -> bytes:
        """An error event (the HTTP status is already 200 once streaming started)."""
        ...


class Surface:
    name: str
    """Endpoint name: metrics label and `Turn.endpoint`."""
    path: str
    """Route under the root (and under `/sessions/{sid}`)."""

    def __init__(self, model_name: str, renderer: Renderer) -> None:
        self.model_name = model_name
        self.renderer = renderer

    def parse(self, body: Any) -> GenRequest:
        raise NotImplementedError

    def reply(self, job: Job, results: list[Event]) -> dict[str, Any]:
        raise NotImplementedError

    def streamer(self, job: Job) -> Streamer:
        raise NotImplementedError

    def error_body(self, e: ApiError) -> dict[str, Any]:
        return e.openai_body()


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def named_sse(kind: str, data: dict[str, Any]) -> bytes:
    """An SSE event with an `event:` line (Responses and Anthropic streams)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def text_of(content: Any, where: str) -> str:
    """OpenAI/Anthropic content (a string or text parts) -> string; 400 naming `where`."""
    try:
        return content_text(content, where)
    except RenderError as e:
        raise ApiError(400, str(e), param=where) from None
