"""OpenAI `/v1/completions`: one raw prompt (text or token ids), no chat template."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.server.request import Event, GenRequest, Job
from gateway.server.surfaces.base import Surface, sse, stops, usage
from gateway.server.surfaces.chat import SEED, StreamOptions
from gateway.server.validation import ApiError, StrictModel, validate


class CompletionRequest(StrictModel):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(16, ge=1)
    """OpenAI's default for this endpoint is 16 tokens."""
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = SEED


class Completions(Surface):
    name = "completions"
    path = "/v1/completions"

    def parse(self, body: Any) -> GenRequest:
        req: CompletionRequest = validate(CompletionRequest, body)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    "prompt: send one prompt per request (a string or a list of token ids)",
                    param="prompt",
                )
            prompt = prompt[0]
        return GenRequest(
            endpoint=self.name,
            model=req.model,
            prompt=prompt,
            n=req.n,
            max_tokens=16 if req.max_tokens is None else req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=stops(req.stop),
            top_logprobs=req.logprobs or 0,
            stream=req.stream,
            wire=req,
        )

    def logprobs(self, job: Job, ev: Event) -> dict[str, Any] | None:
        if job.req.wire.logprobs is None:
            return None
        text = self.renderer.token_text
        return {
            "tokens": [text(t) for t, _ in ev.tokens],
            "token_logprobs": [lp for _, lp in ev.tokens],
            # reversed: of ids sharing a text, the likeliest is the one kept
            "top_logprobs": [{text(t): lp for t, lp in reversed(top)} for top in ev.top]
            if ev.top
            else [{} for _ in ev.tokens],
            "text_offset": [],
        }

    def echo(self, job: Job) -> str:
        return self.renderer.decode(job.prompt_ids) if job.req.wire.echo else ""

    def reply(self, job: Job, results: list[Event]) -> dict[str, Any]:
        echo = self.echo(job)
        return {
            "id": "cmpl-" + job.request_id,
            "object": "text_completion",
            "created": job.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": i,
                    "text": echo + ev.text,
                    "logprobs": self.logprobs(job, ev),
                    "finish_reason": ev.client_finish,
                }
                for i, ev in enumerate(results)
            ],
            "usage": usage(len(job.prompt_ids), sum(ev.output_tokens for ev in results)),
        }

    def streamer(self, job: Job) -> _CompletionStream:
        return _CompletionStream(self, job)


class _CompletionStream:
    def __init__(self, surface: Completions, job: Job) -> None:
        self.surface, self.job = surface, job
        self.echo = surface.echo(job)
        self.head = {
            "id": "cmpl-" + job.request_id,
            "object": "text_completion",
            "created": job.created,
            "model": surface.model_name,
        }
        self.echoed: set[int] = set()
        self.completion_tokens: dict[int, int] = {}

    def events(self, i: int, ev: Event) -> list[bytes]:
        text = ev.text
        if self.echo and i not in self.echoed:
            self.echoed.add(i)
            text = self.echo + text
        if ev.finish is not None:
            self.completion_tokens[i] = ev.output_tokens
        if not text and ev.finish is None:
            return []
        choice = {
            "index": i,
            "text": text,
            "logprobs": self.surface.logprobs(self.job, ev),
            "finish_reason": ev.client_finish if ev.finish else None,
        }
        return [sse({**self.head, "choices": [choice]})]

    def end(self) -> list[bytes]:
        out = []
        options = self.job.req.wire.stream_options
        if options and options.include_usage:
            used = usage(len(self.job.prompt_ids), sum(self.completion_tokens.values()))
            out.append(sse({**self.head, "choices": [], "usage": used}))
        out.append(b"data: [DONE]\n\n")
        return out

    def error(self, e: ApiError) -> bytes:
        return sse(e.openai_body())
