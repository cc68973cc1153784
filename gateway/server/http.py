"""HTTP plumbing: JSON bodies within limits, error responses, and the uvicorn server.

`read_json` reads a body chunk by chunk (413 as soon as it passes `max_body_bytes`, before any
parsing), parses it (on a worker thread when large) and checks its nesting depth. `HttpServer`
serves the app on TCP and a Unix socket with limits uvicorn does not set by itself: the request
head must arrive within `header_timeout_s` and stay under `max_header_bytes` (431), the body
within `body_timeout_s` (408), so a slow or endless client cannot hold a connection open (nor a
shutdown drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.server.validation import ApiError, RequestLimits, check_depth

log = logging.getLogger("loongsage.gateway")

PARSE_OFF_LOOP_BYTES = 256 * 1024


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers, media_type="application/json")


def error_response(e: ApiError, anthropic: bool = False) -> Response:
    return json_response(e.anthropic_body() if anthropic else e.openai_body(), e.status, e.headers)


async def read_json(request: Request, limits: RequestLimits, empty: Any = None) -> tuple[Any, int]:
    """The parsed JSON body and its size; `empty` stands for an empty body when not None."""
    limit = limits.max_body_bytes
    too_large = ApiError(413, f"request body over {limit} bytes", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    try:  # (a body that trickles in is cut off by the HTTP server: `body_timeout_s`)
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer; 499 only tells the metrics
        raise ApiError(499, "the client went away while sending", code="client_gone") from None
    if size == 0 and empty is not None:
        return empty, 0
    raw = b"".join(chunks)
    parse = _parse_checked
    if size > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse, raw, limits.max_json_depth), size
    return parse(raw, limits.max_json_depth), size


def _parse_checked(raw: bytes, max_depth: int) -> Any:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    check_depth(data, max_depth)
    return data


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def http_error(request: Request, exc: Exception) -> Response:
    """404/405 of the router, in OpenAI's (or, under /v1/messages, Anthropic's) error shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path[:200]!r}; see /v1/models, /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path[:200]!r}"
    else:
        message = exc.detail
    err = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return error_response(err, anthropic=request.url.path.endswith("/v1/messages"))


async def internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error in %s", request.url.path, exc_info=exc)
    return error_response(ApiError(500, "internal gateway error; see the gateway log"))


class _GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on the request head and body and a size
    limit on the head (one timer per request: at the head's deadline it re-arms itself for the
    rest of the body's time when the head is done)."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0
    max_header_bytes = 64 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0
        self._in_headers = True  # from the first byte of a request to the end of its headers
        self._in_body = False  # from there to the end of its body
        self._body_deadline = 0.0
        self._refused = False
        self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._header_bytes > self.max_header_bytes:
            self._refuse(431, "Request Header Fields Too Large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:  # the next request on a kept-alive connection
            self._in_headers, self._header_bytes = True, 0
            self._deadline.cancel()
            self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def on_headers_complete(self) -> None:
        self._in_headers, self._in_body = False, True
        self._body_deadline = self.loop.time() + self.body_timeout_s
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.max_header_bytes:
            self._refuse(431, "Request Header Fields Too Large")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._deadline.cancel()
        if not self._refused:
            super().on_message_complete()

    def _too_slow(self) -> None:
        if self._in_body:
            left = self._body_deadline - self.loop.time()
            if left > 0:
                self._deadline = self.loop.call_later(left, self._too_slow)
            else:
                self._refuse(408, "Request Timeout", "the request body did not arrive in time")
        elif self._in_headers and self._header_bytes:
            self._refuse(408, "Request Timeout")
        elif self._in_headers and not self.transport.is_closing():
            self.transport.close()  # connected and silent

    def _refuse(self, status: int, reason: str, message: str = "") -> None:
        self._refused = True
        if self.transport.is_closing():
            return
        message = message or f"request headers: {reason.lower()}"
        body = orjson.dumps(ApiError(status, message, code="bad_request_head").openai_body())
        self.transport.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: whoever runs the loop decides what a
    signal does (`gateway.serve`: drain, then stop; a second signal: exit at once)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn serving one app on TCP and optionally a Unix socket, inside the current loop."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        uds: str | None,
        header_timeout_s: float = 10.0,
        max_header_bytes: int = 64 * 1024,
        body_timeout_s: float = 60.0,
    ) -> None:
        self.sockets: list[socket.socket] = []
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then;
        # without it each keep-alive response waits for the client's delayed ACK (~40 ms)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        tcp = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, port))
        self.host, self.port = host, tcp.getsockname()[1]
        self.sockets.append(tcp)
        self.uds = uds
        if uds:
            path = Path(uds)
            if path.is_socket():
                path.unlink()
            unix = socket.socket(socket.AF_UNIX)
            unix.bind(uds)
            path.chmod(0o666)  # the sandbox user must be able to connect
            self.sockets.append(unix)
        protocol = type(
            "GatewayHttp",
            (_GuardedHttp,),
            {
                "header_timeout_s": header_timeout_s,
                "max_header_bytes": max_header_bytes,
                "body_timeout_s": body_timeout_s,
            },
        )
        self.server = _Server(
            uvicorn.Config(
                app,
                http=protocol,
                log_level="warning",
                lifespan="off",
                timeout_keep_alive=30,
                timeout_graceful_shutdown=2,
                proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* pass
            )
        )
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        for s in self.sockets:
            s.listen(2048)
        self._task = asyncio.get_running_loop().create_task(self.server.serve(self.sockets))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def wait(self) -> None:
        if self._task is not None:
            await self._task

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await self._task
        for s in self.sockets:
            s.close()
        if self.uds:
            with contextlib.suppress(OSError):
                Path(self.uds).unlink()
