"""A fake OpenAI upstream for LiteLLM's side of the gateway benchmark.

As cheap as the fake SGLang server (`tests/fake_sglang.py`: the same Starlette + uvicorn +
orjson stack, no model): `/v1/chat/completions` answers `max_tokens` (default 16) tokens of
fixed text, non-streaming or as SSE chunks (one per token, then a finish chunk, the usage chunk
when `stream_options.include_usage`, and `[DONE]`), and `/v1/models` lists one model.

Run: `python bench/gateway/fake_openai.py --port N`.
"""

from __future__ import annotations

import argparse
import time

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

MODEL = "tiny-random"


async def chat(request: Request) -> Response:
    body = orjson.loads(await request.body())
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    created = int(time.time())
    rid = f"chatcmpl-{time.time_ns():x}"
    model = body.get("model", MODEL)
    prompt_tokens = sum(len(str(m.get("content", ""))) // 4 + 4 for m in body["messages"])
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
    }
    if not body.get("stream"):
        answer = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " tok" * n},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
        }
        return Response(orjson.dumps(answer), media_type="application/json")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(delta: dict, finish: str | None) -> bytes:
        event = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(event) + b"\n\n"

    async def events():
        yield chunk({"role": "assistant", "content": ""}, None)
        for _ in range(n):
            yield chunk({"content": " tok"}, None)
        yield chunk({}, "length")
        if include_usage:
            event = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            yield b"data: " + orjson.dumps(event) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request: Request) -> Response:
    data = {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}],
    }
    return Response(orjson.dumps(data), media_type="application/json")


async def health(request: Request) -> Response:
    return Response(status_code=200)


app = Starlette(
    routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
