"""The gateway: an OpenAI-compatible (and Anthropic-compatible) server in front of one engine.

Every request belongs to a session. The gateway renders the request's messages to token ids
(reusing a session's earlier ids where the history matches, see `gateway.render`), calls the
engine with those ids, logs each call as a `Turn`, and turns the sampled ids back into the text
and tool calls of the API the client speaks. Three APIs share one generation path
(`_start` -> `_choice_events`): chat completions, Responses and Anthropic messages are converted
to chat messages first, and their replies are built from the same events.

Use it in-process (the controller):

    gateway = Gateway(engine, model_path, GatewayConfig(auth="keys"))
    session_id, api_key = gateway.create_session({"task": 3})
    client = gateway.openai_client(api_key)          # AsyncOpenAI over an ASGI transport
    ...; gateway.attach_reward(session_id, 1.0); traj = await gateway.close_session(session_id)

or over HTTP (`python -m gateway.serve`, or `await gateway.start_http(port=..., uds=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway import models
from gateway.engines import EngineConfig, make_engine
from gateway.engines.base import Chunk, Engine, EngineError, Generation, SamplingParams
from gateway.metrics import GatewayMetrics
from gateway.protocol import (
    AnthropicRequest,
    ApiError,
    ChatCompletionRequest,
    CloseRequest,
    CompletionRequest,
    CreateSessionRequest,
    PauseRequest,
    ResponsesRequest,
    RewardRequest,
    SessionSampling,
    validate,
)
from gateway.render import (
    IncrementalDecoder,
    Message,
    Renderer,
    RenderError,
    StopTrimmer,
    ToolCall,
    ToolCallParser,
    _Call,
    content_text,
    load_renderer,
)
from gateway.sessions import Session, SessionStore
from gateway.trajectory import Status, Trajectory, Turn

log = logging.getLogger("loongsage.gateway")


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    """TCP address to listen on."""
    port: int = 8000
    """TCP port (0 picks a free one and prints it)."""
    uds: str | None = None
    """Also listen on this Unix socket path (sandboxes bind it in)."""
    model: str = models.EMBEDDED
    """Embedded model name (SmolLM2-135M-Instruct, tiny-random) or a Hugging Face folder."""
    served_model_name: str | None = None
    """Name in /v1/models and responses; default: the model's name."""
    accept_any_model: bool = False
    """Serve requests for any `model` name (for agents that hard-code one) instead of a 404."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The inference engine behind the gateway."""
    auth: Literal["open", "keys"] = "open"
    """`open`: the API key is the session id, created on first use; `keys`: the admin creates
    sessions, each with its own API key (training)."""
    admin_token: str | None = None
    """Bearer token of the admin routes; with auth=keys a random one is made when unset."""
    max_concurrent_per_session: int = 16
    """Requests one session may have in flight; more get 429."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body; larger ones get 413."""
    max_closed_sessions: int = 10_000
    """Closed sessions kept for export; the oldest beyond this are forgotten."""
    idle_session_s: float = 3600.0
    """auth=open: close a session with no request for this long (its key then starts a fresh
    session; the old one is exported as `<id>~1`); 0 keeps them open. With auth=keys whoever
    created a session closes it."""
    health_interval_s: float = 2.0
    """Seconds between engine health checks."""
    retry_after_s: int = 1
    """Retry-After of a 503 (paused, or no healthy engine)."""
    close_timeout_s: float = 30.0
    """How long close waits for a session's aborted requests to finish and be logged."""

    def __post_init__(self) -> None:
        if self.max_concurrent_per_session < 1:
            raise ValueError("max_concurrent_per_session must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.idle_session_s < 0:
            raise ValueError("idle_session_s must be >= 0 (0 keeps open-mode sessions open)")


@dataclass
class _Event:
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


@dataclass
class _Job:
    """One request on its way to the engine: prompt ids and how to read each choice's output."""

    session: Session
    call: _Call
    prompt_ids: list[int]
    params: list[SamplingParams]
    parse_tools: bool
    prefill: str
    stops: list[str]
    endpoint: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


ToolChoice = str | tuple[str, str]
"""`auto`, `none`, `required`, or ("named", function name)."""


class Gateway:
    """Sessions, token log and the HTTP app in front of `engine`. See the module docstring."""

    def __init__(
        self,
        engine: Engine,
        model_path: str | Path,
        config: GatewayConfig | None = None,
        *,
        model_name: str | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        self.cfg = config or GatewayConfig()
        self.engine = engine
        self.renderer = renderer or load_renderer(model_path)
        self.model_name = (
            model_name or self.cfg.served_model_name or models.model_name(str(model_path))
        )
        self._model_names = {self.model_name, str(model_path), Path(model_path).name}
        self.admin_token = self.cfg.admin_token
        if self.cfg.auth == "keys" and not self.admin_token:
            self.admin_token = "adm-" + secrets.token_urlsafe(24)
        self.sessions = SessionStore(self.cfg.max_closed_sessions)
        self.metrics = GatewayMetrics(
            active_sessions=lambda: self.sessions.num_open,
            engine_load=lambda: self.engine.load,
            engine_healthy=lambda: float(self._healthy),
        )
        self._paused = False
        self._healthy = True
        self._health_task: asyncio.Task | None = None
        self._closing = False
        self._owns_engine = False
        self.app = Starlette(routes=self._routes())

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> Gateway:
        """Resolve the model, build the engine `cfg.engine` describes and the gateway on it."""
        path = models.resolve_model(cfg.model)
        gateway = cls(
            make_engine(cfg.engine, path),
            path,
            cfg,
            model_name=cfg.served_model_name or models.model_name(cfg.model),
        )
        gateway._model_names.add(cfg.model)
        gateway._owns_engine = True
        return gateway

    # -----------------------------------------------------------------------------------------
    # In-process API (the controller / AgentFlow)

    def create_session(
        self,
        metadata: dict[str, Any] | None = None,
        session_id: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> tuple[str, str]:
        """A new session -> (session id, its API key). Raises ValueError for a taken id.

        `sampling` ({temperature, top_p, top_k}) is forced on every call of the session."""
        if sampling:
            SessionSampling.model_validate(sampling)
        session = self.sessions.create(metadata, session_id, sampling=sampling)
        return session.id, session.api_key

    def attach_reward(
        self, session_id: str, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        traj = self._get(session_id).trajectory
        traj.reward = float(reward)
        if info:
            traj.info.update(info)

    async def close_session(
        self, session_id: str, status: Status = "ok", reason: str = ""
    ) -> Trajectory:
        """Close a session: abort its running requests, wait for them to be logged, export."""
        session = self._get(session_id)
        if not session.closed:
            self.sessions.mark_closed(session, status, reason)
            for rid in list(session.request_ids):
                with contextlib.suppress(Exception):
                    await self.engine.abort(rid)
            if not await session.wait_idle(self.cfg.close_timeout_s):
                log.warning("session %s: requests still running after close", session_id)
        return session.export()

    def trajectory(self, session_id: str) -> Trajectory:
        """The session's trajectory so far (segments rebuilt); the session stays open."""
        return self._get(session_id).export()

    def list_sessions(self) -> list[dict[str, Any]]:
        return [s.summary() for s in self.sessions.all()]

    async def pause(self, mode: Literal["abort", "retract", "in_place"] | None = None) -> None:
        """New requests get 503 + Retry-After; with `mode`, the engine is paused too."""
        self._paused = True
        if mode is not None:
            await self.engine.pause(mode)
            self._engine_paused = True

    async def resume(self) -> None:
        if getattr(self, "_engine_paused", False):
            await self.engine.resume()
            self._engine_paused = False
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def update_weights(self, state: Any, version: int) -> None:
        await self.engine.update_weights(state, version)

    def openai_client(self, api_key: str, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` that reaches this gateway in-process (no socket)."""
        import httpx
        import openai

        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://gateway", timeout=None
        )
        return openai.AsyncOpenAI(
            base_url="http://gateway/v1", api_key=api_key, http_client=http, **kwargs
        )

    async def start_http(
        self, host: str = "127.0.0.1", port: int = 0, uds: str | None = None
    ) -> HttpServer:
        """Serve the app over TCP (and a Unix socket when `uds` is set) in this event loop."""
        server = HttpServer(self.app, host, port, uds)
        await server.start()
        return server

    async def aclose(self) -> None:
        self._closing = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(BaseException):
                await self._health_task
            self._health_task = None
        if self._owns_engine:
            await self.engine.close()

    # -----------------------------------------------------------------------------------------
    # Routing, auth, errors

    def _routes(self) -> list[Route]:
        api = [
            ("/v1/chat/completions", self._chat, "chat"),
            ("/v1/completions", self._completions, "completions"),
            ("/v1/responses", self._responses, "responses"),
            ("/v1/messages", self._messages, "messages"),
        ]
        routes = [
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/models", self._endpoint("models", self._models), methods=["GET"]),
            Route(
                "/v1/models/{model:path}", self._endpoint("models", self._model), methods=["GET"]
            ),
            Route("/sessions", self._endpoint("admin", self._create_session), methods=["POST"]),
            Route("/sessions", self._endpoint("admin", self._list_sessions), methods=["GET"]),
            Route("/sessions/{sid}", self._endpoint("admin", self._get_session), methods=["GET"]),
            Route(
                "/sessions/{sid}/reward", self._endpoint("admin", self._reward), methods=["POST"]
            ),
            Route("/sessions/{sid}/close", self._endpoint("admin", self._close), methods=["POST"]),
            Route(
                "/sessions/{sid}/trajectory",
                self._endpoint("admin", self._trajectory),
                methods=["GET"],
            ),
            Route("/pause", self._endpoint("admin", self._pause), methods=["POST"]),
            Route("/resume", self._endpoint("admin", self._resume), methods=["POST"]),
            Route(
                "/weight_version", self._endpoint("admin", self._weight_version), methods=["GET"]
            ),
        ]
        for path, handler, name in api:
            anthropic = name == "messages"
            routes.append(Route(path, self._endpoint(name, handler, anthropic), methods=["POST"]))
            routes.append(
                Route(
                    "/sessions/{sid}" + path,
                    self._endpoint(name, handler, anthropic),
                    methods=["POST"],
                )
            )
        routes.append(
            Route(
                "/sessions/{sid}/v1/models", self._endpoint("models", self._models), methods=["GET"]
            )
        )
        return routes

    def _endpoint(
        self,
        name: str,
        handler: Callable[[Request], Awaitable[Response]],
        anthropic: bool = False,
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            start = time.perf_counter()
            self._ensure_started()
            try:
                response = await handler(request)
            except ApiError as e:
                body = e.anthropic_body() if anthropic else e.openai_body()
                response = _json(body, e.status, e.headers)
            except Exception:
                log.exception("internal error in %s", request.url.path)
                err = ApiError(500, "internal gateway error; see the gateway log")
                response = _json(err.anthropic_body() if anthropic else err.openai_body(), 500)
            self.metrics.observe(name, response.status_code, time.perf_counter() - start)
            return response

        return wrapped

    def _ensure_started(self) -> None:
        if self._health_task is None and not self._closing:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
        while not self._closing:
            try:
                async with asyncio.timeout(10):
                    self._healthy = bool(await self.engine.health())
            except Exception:
                self._healthy = False
            await self._close_idle_sessions()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _close_idle_sessions(self) -> None:
        if self.cfg.auth != "open" or not self.cfg.idle_session_s:
            return
        cutoff = time.monotonic() - self.cfg.idle_session_s
        for session in self.sessions.all():
            if not session.closed and session.requests == 0 and session.last_used < cutoff:
                await self.close_session(
                    session.id, "ok", f"idle: no request for {self.cfg.idle_session_s:g} s"
                )
                self.sessions.archive(session)  # frees the id: the key's next call starts anew

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"session {session_id!r} not found", code="session_not_found")
        return session

    @staticmethod
    def _key(request: Request) -> str | None:
        auth = request.headers.get("authorization")
        if auth:
            scheme, _, token = auth.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else auth.strip()
        return request.headers.get("x-api-key")

    def _is_admin(self, request: Request) -> bool:
        key = self._key(request)
        return (
            key is not None
            and self.admin_token is not None
            and secrets.compare_digest(key, self.admin_token)
        )

    def _require_admin(self, request: Request) -> None:
        if self.admin_token is None:  # open mode without an admin token: admin routes are open
            return
        if not self._is_admin(request):
            raise ApiError(
                401, "admin routes need Authorization: Bearer <admin_token>", code="invalid_api_key"
            )

    def _session_for(self, request: Request) -> Session:
        """The session a model request belongs to, by its API key (and path session id)."""
        key = self._key(request)
        path_sid = request.path_params.get("sid")
        if self.cfg.auth == "open":
            sid = path_sid or key or "default"
            if len(sid) > 256:
                raise ApiError(400, "session id (the API key in open mode) is over 256 characters")
            session = self.sessions.get(sid)
            if session is None:
                session = self.sessions.create(session_id=sid, api_key=sid)
        else:
            if not key:
                raise ApiError(
                    401,
                    "missing API key: send Authorization: Bearer <session api_key>",
                    code="invalid_api_key",
                )
            session = self.sessions.by_key(key)
            if session is None:
                raise ApiError(401, "invalid API key", code="invalid_api_key")
            if path_sid is not None and path_sid != session.id:
                raise ApiError(403, "this API key belongs to another session", code="wrong_session")
        if session.closed:
            raise ApiError(409, f"session {session.id!r} is closed", code="session_closed")
        return session

    def _check_serving(self) -> None:
        headers = {"Retry-After": str(self.cfg.retry_after_s)}
        if self._paused:
            raise ApiError(
                503,
                "the gateway is paused (weight update); retry shortly",
                code="paused",
                headers=headers,
            )
        if not self._healthy:
            raise ApiError(
                503, "no healthy engine; retry shortly", code="engine_unhealthy", headers=headers
            )

    def _check_model(self, name: str) -> None:
        if name not in self._model_names and not self.cfg.accept_any_model:
            raise ApiError(
                404,
                f"model {name!r} not found; this gateway serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _body(self, request: Request) -> Any:
        limit = self.cfg.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            return orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as e:
            raise ApiError(
                400, f"the request body is not valid JSON: {e}", code="invalid_json"
            ) from None

    # -----------------------------------------------------------------------------------------
    # Simple routes

    async def _health(self, request: Request) -> Response:
        self._ensure_started()
        status = 200 if self._healthy else 503
        return _json(
            {
                "status": "ok" if self._healthy else "unhealthy",
                "paused": self._paused,
                "weight_version": self.engine.weight_version,
            },
            status,
        )

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "loongsage",
            "max_model_len": self.engine.max_context,
        }

    async def _models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return _json(self._model_card())

    async def _create_session(self, request: Request) -> Response:
        self._require_admin(request)
        body = await self._body(request) if await _has_body(request) else {}
        req = validate(CreateSessionRequest, body)
        try:
            sampling = req.sampling.model_dump(exclude_none=True) if req.sampling else None
            sid, key = self.create_session(req.metadata, req.id, sampling)
        except ValueError as e:
            raise ApiError(409, str(e), param="id", code="session_exists") from None
        base = str(request.base_url).rstrip("/")
        return _json(
            {
                "id": sid,
                "api_key": key,
                "base_url": f"{base}/v1",
                "session_base_url": f"{base}/sessions/{sid}/v1",
            },
            201,
        )

    async def _list_sessions(self, request: Request) -> Response:
        self._require_admin(request)
        return _json({"object": "list", "data": self.list_sessions()})

    def _admin_or_owner(self, request: Request) -> Session:
        session = self._get(request.path_params["sid"])
        key = self._key(request)
        if (
            self.admin_token is not None
            and not self._is_admin(request)
            and (key is None or not secrets.compare_digest(key, session.api_key))
        ):
            raise ApiError(
                401, "needs the admin token or this session's API key", code="invalid_api_key"
            )
        return session

    async def _get_session(self, request: Request) -> Response:
        return _json(self._admin_or_owner(request).summary())

    async def _reward(self, request: Request) -> Response:
        self._require_admin(request)
        sid = request.path_params["sid"]
        self._get(sid)
        req = validate(RewardRequest, await self._body(request))
        self.attach_reward(sid, req.reward, req.info)
        return _json({"id": sid, "reward": req.reward})

    async def _close(self, request: Request) -> Response:
        self._require_admin(request)
        sid = request.path_params["sid"]
        self._get(sid)
        body = await self._body(request) if await _has_body(request) else {}
        req = validate(CloseRequest, body)
        traj = await self.close_session(sid, req.status, req.reason)
        return _json(traj.to_dict())

    async def _trajectory(self, request: Request) -> Response:
        return _json(self._admin_or_owner(request).export().to_dict())

    async def _pause(self, request: Request) -> Response:
        self._require_admin(request)
        body = await self._body(request) if await _has_body(request) else {}
        await self.pause(validate(PauseRequest, body).mode)
        return _json({"paused": True})

    async def _resume(self, request: Request) -> Response:
        self._require_admin(request)
        await self.resume()
        return _json({"paused": False})

    async def _weight_version(self, request: Request) -> Response:
        return _json({"weight_version": self.engine.weight_version})

    # -----------------------------------------------------------------------------------------
    # The generation path shared by every API

    def _start(
        self,
        session: Session,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        tool_choice: ToolChoice,
        *,
        n: int,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stops: list[str],
        endpoint: str,
        top_logprobs: int = 0,
    ) -> _Job:
        prefill = ""
        if tools and tool_choice == "required":
            prefill = '<tool_call>\n{"name": "'
        elif isinstance(tool_choice, tuple):
            name = tool_choice[1]
            tool = next((t for t in tools or () if t["function"]["name"] == name), None)
            if tool is None:
                raise ApiError(
                    400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
                )
            # The call is forced by writing its start into the prompt (any engine can do that;
            # no constrained decoding): up to the first argument's opening quote when it has
            # parameters, which keeps small models on the JSON-object track.
            has_params = bool((tool["function"].get("parameters") or {}).get("properties"))
            prefill = (
                '<tool_call>\n{"name": '
                + json.dumps(name)
                + ', "arguments": {'
                + ('"' if has_params else "")
            )
        elif tool_choice == "required" and not tools:
            raise ApiError(400, "tool_choice=required needs tools", param="tool_choice")
        try:
            prompt, call = session.history.prompt(self.renderer, messages, tools, prefill)
        except RenderError as e:
            raise ApiError(400, str(e), param="messages") from None
        if prompt.forked:
            session.forks += 1
            self.metrics.forks.inc()
        self.metrics.prompt_tokens.inc(len(prompt.ids))
        self.metrics.reused_tokens.inc(prompt.reused)
        room = self.engine.max_context - len(prompt.ids)
        if max_tokens is None:
            if room < 1:
                raise ApiError(
                    400,
                    f"the prompt is {len(prompt.ids)} tokens; the context is "
                    f"{self.engine.max_context}",
                    param="messages",
                    code="context_length_exceeded",
                )
            max_tokens = room
        elif max_tokens > room:
            raise ApiError(
                400,
                f"prompt ({len(prompt.ids)} tokens) + max_tokens ({max_tokens}) is "
                f"over the context of {self.engine.max_context} tokens; lower max_tokens "
                "or shorten the messages",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = _sampling(
            session, n, max_tokens, temperature, top_p, top_k, stops, seed, top_logprobs
        )
        return _Job(
            session,
            call,
            prompt.ids,
            params,
            bool(tools) and tool_choice != "none",
            prefill,
            stops,
            endpoint,
        )

    async def _choice_events(self, job: _Job, index: int) -> AsyncIterator[_Event]:
        """Run one choice on the engine; yields client events; logs the turn however it ends."""
        session = job.session
        rid = f"{job.request_id}-{index}"
        session.request_ids.add(rid)
        decoder = IncrementalDecoder(self.renderer)
        stops = StopTrimmer(job.stops)
        parser = ToolCallParser(job.prefill) if job.parse_tools else None
        gen = Generation()
        finished = False
        started = time.time()
        stream: AsyncIterator[Chunk] | None = None
        emitted: list[str] = []
        try:
            stream = self.engine.stream(job.prompt_ids, job.params[index], rid, session.id)
            async for chunk in stream:
                gen.add(chunk)
                event = _Event(
                    tokens=list(zip(chunk.token_ids, chunk.logprobs, strict=False)),
                    top=chunk.top_logprobs,
                )
                self._feed(event, stops.push(decoder.push(chunk.token_ids)), parser)
                if chunk.finish_reason is None:
                    emitted.append(event.text)
                    yield event
                    continue
                break
            else:
                event = _Event()
            self._feed(event, stops.push(decoder.finish()) + stops.finish(), parser)
            if parser is not None:
                for kind, value in parser.finish():
                    _add(event, kind, value)
            finished = True
            calls = parser.calls if parser is not None else []
            event.finish = "tool_calls" if calls else gen.finish_reason
            event.stop_sequence = stops.matched
            event.output_tokens = len(gen.output_ids)
            content = "".join(emitted) + event.text
            reply: Message = {
                "role": "assistant",
                "content": content,
                "tool_calls": [c.to_openai() for c in calls],
            }
            if gen.finish_reason != "abort":
                session.history.record(self.renderer, job.call, reply, gen.output_ids)
            yield event
        except ValueError as e:
            raise ApiError(400, f"the engine refused the request: {e}") from None
        except EngineError as e:
            raise ApiError(
                503,
                f"engine error: {e}",
                code="engine_error",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            ) from None
        finally:
            session.request_ids.discard(rid)
            if not finished:
                gen.finish_reason = "abort"
                asyncio.get_running_loop().create_task(_quiet(self.engine.abort(rid)))
                if stream is not None:
                    with contextlib.suppress(BaseException):
                        await stream.aclose()  # type: ignore[attr-defined]
            if gen.output_ids or finished:
                finish = (
                    "tool_calls"
                    if finished and parser is not None and parser.calls
                    else (gen.finish_reason)
                )
                session.add_turn(
                    Turn(
                        job.prompt_ids,
                        gen.output_ids,
                        gen.output_logprobs,
                        gen.output_versions,
                        finish,
                        job.endpoint,
                        started,
                        time.time() - started,
                    )
                )
                self.metrics.output_tokens.inc(len(gen.output_ids))

    @staticmethod
    def _feed(event: _Event, text: str, parser: ToolCallParser | None) -> None:
        if not text:
            return
        if parser is None:
            event.text += text
            return
        for kind, value in parser.push(text):
            _add(event, kind, value)

    def _events(self, job: _Job) -> list[AsyncIterator[_Event]]:
        return [self._choice_events(job, i) for i in range(len(job.params))]

    async def _collect(self, job: _Job) -> list[_Event]:
        """Run every choice to the end; one merged event per choice."""

        async def one(events: AsyncIterator[_Event]) -> _Event:
            total = _Event()
            async for ev in events:
                total.text += ev.text
                total.tool_calls += ev.tool_calls
                total.tokens += ev.tokens
                total.top += ev.top
                total.finish, total.stop_sequence = ev.finish, ev.stop_sequence
                total.output_tokens = ev.output_tokens
            return total

        job.session.begin()
        try:
            return list(await asyncio.gather(*(one(e) for e in self._events(job))))
        finally:
            job.session.end()

    async def _stream(
        self,
        job: _Job,
        fmt: Callable[[int, _Event], list[bytes]],
        final: Callable[[], list[bytes]],
        error: Callable[[ApiError], bytes],
    ) -> StreamingResponse:
        """Start every choice (errors before the first token become HTTP errors), then SSE."""
        job.session.begin()
        gens = self._events(job)
        try:
            firsts = await asyncio.gather(*(g.__anext__() for g in gens))
        except BaseException:
            for g in gens:
                with contextlib.suppress(BaseException):
                    await g.aclose()
            job.session.end()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                for i, ev in enumerate(firsts):
                    for b in fmt(i, ev):
                        yield b
                async for i, ev in _merge(gens, firsts):
                    for b in fmt(i, ev):
                        yield b
                for b in final():
                    yield b
            except ApiError as e:
                yield error(e)
            finally:
                for g in gens:
                    with contextlib.suppress(BaseException):
                        await g.aclose()
                job.session.end()

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def _admit(self, request: Request) -> Session:
        session = self._session_for(request)
        self._check_serving()
        if session.requests >= self.cfg.max_concurrent_per_session:
            raise ApiError(
                429,
                f"session {session.id!r} already has "
                f"{session.requests} requests in flight (limit "
                f"{self.cfg.max_concurrent_per_session})",
                code="too_many_requests",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        return session

    def _token_logprobs(self, ev: _Event) -> list[dict[str, Any]]:
        """Chat `logprobs.content`: each token with its `top_logprobs` alternatives."""

        def entry(tid: int, lp: float) -> dict[str, Any]:
            text = self.renderer.token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        tops = ev.top or [[] for _ in ev.tokens]
        return [
            {**entry(tid, lp), "top_logprobs": [entry(t, x) for t, x in top]}
            for (tid, lp), top in zip(ev.tokens, tops, strict=True)
        ]

    # -----------------------------------------------------------------------------------------
    # /v1/chat/completions

    async def _chat(self, request: Request) -> Response:
        session = self._admit(request)
        req: ChatCompletionRequest = validate(ChatCompletionRequest, await self._body(request))
        self._check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = [_chat_message(m, i) for i, m in enumerate(req.messages)]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice: ToolChoice = (
            req.tool_choice or "auto"
            if isinstance(req.tool_choice, str | None)
            else ("named", req.tool_choice.function.name)
        )
        job = self._start(
            session,
            messages,
            tools,
            choice,
            n=req.n,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stops=_stops(req.stop),
            endpoint="chat",
            top_logprobs=req.top_logprobs or 0,
        )
        cid, created = "chatcmpl-" + job.request_id, int(time.time())
        logprobs = req.logprobs
        if not req.stream:
            results = await self._collect(job)
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
                        "finish_reason": _client_finish(ev),
                        "logprobs": {"content": self._token_logprobs(ev)} if logprobs else None,
                    }
                )
            return _json(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": choices,
                    "usage": _usage(len(job.prompt_ids), results),
                }
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }
        started: set[int] = set()
        num_calls: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}

        def fmt(i: int, ev: _Event) -> list[bytes]:
            out = []
            if i not in started:
                started.add(i)
                out.append(
                    _sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                )
            delta: dict[str, Any] = {}
            if ev.text:
                delta["content"] = ev.text
            if ev.tool_calls:
                k = num_calls.get(i, 0)
                delta["tool_calls"] = [
                    {"index": k + j, **c.to_openai()} for j, c in enumerate(ev.tool_calls)
                ]
                num_calls[i] = k + len(ev.tool_calls)
            lp = {"content": self._token_logprobs(ev)} if logprobs and ev.tokens else None
            if delta or lp:
                out.append(
                    _sse(
                        {
                            **head,
                            "choices": [
                                {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}
                            ],
                        }
                    )
                )
            if ev.finish is not None:
                completion_tokens[i] = ev.output_tokens
                out.append(
                    _sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {},
                                    "logprobs": None,
                                    "finish_reason": _client_finish(ev),
                                }
                            ],
                        }
                    )
                )
            return out

        def final() -> list[bytes]:
            out = []
            if include_usage:
                c = sum(completion_tokens.values())
                p = len(job.prompt_ids)
                out.append(
                    _sse(
                        {
                            **head,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": p,
                                "completion_tokens": c,
                                "total_tokens": p + c,
                            },
                        }
                    )
                )
            out.append(b"data: [DONE]\n\n")
            return out

        return await self._stream(job, fmt, final, lambda e: _sse(e.openai_body()))

    # -----------------------------------------------------------------------------------------
    # /v1/completions

    async def _completions(self, request: Request) -> Response:
        session = self._admit(request)
        req: CompletionRequest = validate(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        prompts = _prompt_list(req.prompt)
        if len(prompts) != 1:
            raise ApiError(
                400,
                "prompt: send one prompt per request (a string or a list of token ids)",
                param="prompt",
            )
        prompt = prompts[0]
        vocab = len(self.renderer.tokenizer)
        if isinstance(prompt, str):
            ids = self.renderer.encode(prompt)
        else:
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "prompt: empty", param="prompt")
        max_tokens = req.max_tokens or 16
        if len(ids) + max_tokens > self.engine.max_context:
            raise ApiError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) is over "
                f"the context of {self.engine.max_context}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = _sampling(
            session,
            req.n,
            max_tokens,
            req.temperature,
            req.top_p,
            req.top_k,
            _stops(req.stop),
            req.seed,
            req.logprobs or 0,
        )
        call = _Call((), b"", "", ids)
        job = _Job(session, call, ids, params, False, "", _stops(req.stop), "completions")
        self.metrics.prompt_tokens.inc(len(ids))
        echo = self.renderer.decode(ids) if req.echo else ""
        cid, created = "cmpl-" + job.request_id, int(time.time())

        def lp_block(ev: _Event) -> dict[str, Any] | None:
            if req.logprobs is None:
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

        if not req.stream:
            results = await self._collect(job)
            choices = [
                {
                    "index": i,
                    "text": echo + ev.text,
                    "logprobs": lp_block(ev),
                    "finish_reason": _client_finish(ev),
                }
                for i, ev in enumerate(results)
            ]
            return _json(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": choices,
                    "usage": _usage(len(ids), results),
                }
            )
        head = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        echoed: set[int] = set()
        completion_tokens: dict[int, int] = {}

        def fmt(i: int, ev: _Event) -> list[bytes]:
            text = ev.text
            if echo and i not in echoed:
                echoed.add(i)
                text = echo + text
            if ev.finish is not None:
                completion_tokens[i] = ev.output_tokens
            if not text and ev.finish is None:
                return []
            return [
                _sse(
                    {
                        **head,
                        "choices": [
                            {
                                "index": i,
                                "text": text,
                                "logprobs": lp_block(ev),
                                "finish_reason": _client_finish(ev) if ev.finish else None,
                            }
                        ],
                    }
                )
            ]

        def final() -> list[bytes]:
            out = []
            if req.stream_options and req.stream_options.include_usage:
                c = sum(completion_tokens.values())
                out.append(
                    _sse(
                        {
                            **head,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": len(ids),
                                "completion_tokens": c,
                                "total_tokens": len(ids) + c,
                            },
                        }
                    )
                )
            out.append(b"data: [DONE]\n\n")
            return out

        return await self._stream(job, fmt, final, lambda e: _sse(e.openai_body()))

    # -----------------------------------------------------------------------------------------
    # /v1/responses

    async def _responses(self, request: Request) -> Response:
        session = self._admit(request)
        req: ResponsesRequest = validate(ResponsesRequest, await self._body(request))
        self._check_model(req.model)
        if req.previous_response_id:
            raise ApiError(
                400,
                "previous_response_id is not supported: send the whole input (store=false)",
                param="previous_response_id",
            )
        messages = _responses_messages(req)
        tools = None
        if req.tools:
            tools = []
            for i, t in enumerate(req.tools):
                if t.type != "function" or not t.name:
                    raise ApiError(
                        400,
                        f"tools[{i}]: only function tools (with a name) are "
                        f"supported, got type {t.type!r}",
                        param=f"tools.{i}",
                    )
                fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
                tools.append(
                    {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}
                )
        choice: ToolChoice = "auto"
        if isinstance(req.tool_choice, str):
            if req.tool_choice not in ("auto", "none", "required"):
                raise ApiError(
                    400, "tool_choice: auto, none, required or a function", param="tool_choice"
                )
            choice = req.tool_choice
        elif isinstance(req.tool_choice, dict):
            name = req.tool_choice.get("name")
            if req.tool_choice.get("type") != "function" or not isinstance(name, str):
                raise ApiError(
                    400,
                    "tool_choice: only {type: function, name} is supported",
                    param="tool_choice",
                )
            choice = ("named", name)
        job = self._start(
            session,
            messages,
            tools,
            choice,
            n=1,
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=None,
            seed=req.seed,
            stops=_stops(req.stop),
            endpoint="responses",
        )
        rid, created = "resp_" + job.request_id, int(time.time())

        def response_obj(status: str, output: list[dict[str, Any]], ev: _Event | None) -> dict:
            obj: dict[str, Any] = {
                "id": rid,
                "object": "response",
                "created_at": created,
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
                if ev.finish == "length":
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

        def message_item(text: str, status: str) -> dict[str, Any]:
            return {
                "type": "message",
                "id": "msg_" + job.request_id,
                "status": status,
                "role": "assistant",
                "content": []
                if status == "in_progress"
                else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }

        def call_item(c: ToolCall, status: str) -> dict[str, Any]:
            return {
                "type": "function_call",
                "id": "fc_" + c.id.removeprefix("call_"),
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments if status == "completed" else "",
                "status": status,
            }

        if not req.stream:
            (ev,) = await self._collect(job)
            output = []
            if ev.text and not (ev.tool_calls and not ev.text.strip()):
                output.append(message_item(ev.text, "completed"))
            output += [call_item(c, "completed") for c in ev.tool_calls]
            return _json(response_obj("completed", output, ev))

        seq = 0
        text_parts: list[str] = []
        output: list[dict[str, Any]] = []
        msg_open = False

        def event(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

        def close_message() -> list[bytes]:
            nonlocal msg_open
            if not msg_open:
                return []
            msg_open = False
            text = "".join(text_parts)
            idx = len(output)
            item = message_item(text, "completed")
            output.append(item)
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": idx, "content_index": 0}
            return [
                event("response.output_text.done", **common, text=text, logprobs=[]),
                event("response.content_part.done", **common, part=part),
                event("response.output_item.done", output_index=idx, item=item),
            ]

        def fmt(_i: int, ev: _Event) -> list[bytes]:
            nonlocal msg_open
            out: list[bytes] = []
            if seq == 0:
                start = response_obj("in_progress", [], None)
                out += [
                    event("response.created", response=start),
                    event("response.in_progress", response=start),
                ]
            if ev.text:
                idx = len(output)
                if not msg_open:
                    msg_open = True
                    item = message_item("", "in_progress")
                    out += [
                        event("response.output_item.added", output_index=idx, item=item),
                        event(
                            "response.content_part.added",
                            item_id=item["id"],
                            output_index=idx,
                            content_index=0,
                            part={
                                "type": "output_text",
                                "text": "",
                                "annotations": [],
                                "logprobs": [],
                            },
                        ),
                    ]
                text_parts.append(ev.text)
                out.append(
                    event(
                        "response.output_text.delta",
                        item_id="msg_" + job.request_id,
                        output_index=idx,
                        content_index=0,
                        delta=ev.text,
                        logprobs=[],
                    )
                )
            for c in ev.tool_calls:
                out += close_message()
                idx = len(output)
                item = call_item(c, "in_progress")
                done = call_item(c, "completed")
                output.append(done)
                out += [
                    event("response.output_item.added", output_index=idx, item=item),
                    event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=idx,
                        delta=c.arguments,
                    ),
                    event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=idx,
                        name=c.name,
                        arguments=c.arguments,
                    ),
                    event("response.output_item.done", output_index=idx, item=done),
                ]
            if ev.finish is not None:
                out += close_message()
                final = response_obj("completed", output, ev)
                kind = (
                    "response.completed"
                    if final["status"] == "completed"
                    else ("response.incomplete")
                )
                out.append(event(kind, response=final))
            return out

        def err(e: ApiError) -> bytes:
            return event("error", code=e.code, message=e.message, param=e.param)

        return await self._stream(job, fmt, list, err)

    # -----------------------------------------------------------------------------------------
    # Anthropic /v1/messages

    async def _messages(self, request: Request) -> Response:
        session = self._admit(request)
        req: AnthropicRequest = validate(AnthropicRequest, await self._body(request))
        self._check_model(req.model)
        messages = _anthropic_messages(req)
        tools = (
            [
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
            if req.tools
            else None
        )
        choice: ToolChoice = "auto"
        if req.tool_choice:
            kind = req.tool_choice.get("type")
            if kind == "any":
                choice = "required"
            elif kind == "tool" and isinstance(req.tool_choice.get("name"), str):
                choice = ("named", req.tool_choice["name"])
            elif kind in ("auto", "none"):
                choice = kind
            else:
                raise ApiError(
                    400,
                    "tool_choice.type: auto, any, tool (with name) or none",
                    param="tool_choice",
                )
        job = self._start(
            session,
            messages,
            tools,
            choice,
            n=1,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=None,
            stops=list(req.stop_sequences or ()),
            endpoint="messages",
        )
        mid = "msg_" + job.request_id

        def stop_reason(ev: _Event) -> str:
            if ev.finish == "tool_calls":  # (a streamed call came in an earlier event)
                return "tool_use"
            if ev.finish == "length":
                return "max_tokens"
            return "stop_sequence" if ev.stop_sequence else "end_turn"

        def tool_block(c: ToolCall) -> dict[str, Any]:
            args = orjson.loads(c.arguments) if c.arguments else {}
            return {
                "type": "tool_use",
                "id": c.id,
                "name": c.name,
                "input": args if isinstance(args, dict) else {"value": args},
            }

        if not req.stream:
            (ev,) = await self._collect(job)
            content: list[dict[str, Any]] = []
            if ev.text and not (ev.tool_calls and not ev.text.strip()):
                content.append({"type": "text", "text": ev.text})
            content += [tool_block(c) for c in ev.tool_calls]
            return _json(
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": self.model_name,
                    "content": content,
                    "stop_reason": stop_reason(ev),
                    "stop_sequence": ev.stop_sequence,
                    "usage": {
                        "input_tokens": len(job.prompt_ids),
                        "output_tokens": ev.output_tokens,
                    },
                }
            )

        state = {"started": False, "block": -1, "text_open": False}

        def event(kind: str, **data: Any) -> bytes:
            return (
                b"event: "
                + kind.encode()
                + b"\ndata: "
                + orjson.dumps({"type": kind, **data})
                + b"\n\n"
            )

        def fmt(_i: int, ev: _Event) -> list[bytes]:
            out = []
            if not state["started"]:
                state["started"] = True
                out.append(
                    event(
                        "message_start",
                        message={
                            "id": mid,
                            "type": "message",
                            "role": "assistant",
                            "model": self.model_name,
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": {"input_tokens": len(job.prompt_ids), "output_tokens": 0},
                        },
                    )
                )
            if ev.text:
                if not state["text_open"]:
                    state["text_open"] = True
                    state["block"] += 1
                    out.append(
                        event(
                            "content_block_start",
                            index=state["block"],
                            content_block={"type": "text", "text": ""},
                        )
                    )
                out.append(
                    event(
                        "content_block_delta",
                        index=state["block"],
                        delta={"type": "text_delta", "text": ev.text},
                    )
                )
            for c in ev.tool_calls:
                if state["text_open"]:
                    state["text_open"] = False
                    out.append(event("content_block_stop", index=state["block"]))
                state["block"] += 1
                b = state["block"]
                out += [
                    event(
                        "content_block_start",
                        index=b,
                        content_block={"type": "tool_use", "id": c.id, "name": c.name, "input": {}},
                    ),
                    event(
                        "content_block_delta",
                        index=b,
                        delta={"type": "input_json_delta", "partial_json": c.arguments},
                    ),
                    event("content_block_stop", index=b),
                ]
            if ev.finish is not None:
                if state["text_open"]:
                    out.append(event("content_block_stop", index=state["block"]))
                out += [
                    event(
                        "message_delta",
                        delta={"stop_reason": stop_reason(ev), "stop_sequence": ev.stop_sequence},
                        usage={"output_tokens": ev.output_tokens},
                    ),
                    event("message_stop"),
                ]
            return out

        return await self._stream(job, fmt, list, lambda e: event("error", **e.anthropic_body()))


# ---------------------------------------------------------------------------------------------
# Conversions


def _chat_message(m: Any, i: int) -> Message:
    where = f"messages.{i}.content"
    try:
        content = content_text(m.content, where)
    except RenderError as e:
        raise ApiError(400, str(e), param=where) from None
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


def _responses_messages(req: ResponsesRequest) -> list[Message]:
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
            try:
                text = content_text(item.get("content"), f"{where}.content")
            except RenderError as e:
                raise ApiError(400, str(e), param=f"{where}.content") from None
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
            if (
                not isinstance(name, str)
                or not isinstance(call_id, str)
                or not isinstance(args, str)
            ):
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
            try:
                text = (
                    output if isinstance(output, str) else content_text(output, f"{where}.output")
                )
            except RenderError as e:
                raise ApiError(400, str(e), param=f"{where}.output") from None
            messages.append(
                {"role": "tool", "content": text, "tool_call_id": str(item.get("call_id") or "")}
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


def _anthropic_messages(req: AnthropicRequest) -> list[Message]:
    messages: list[Message] = []
    if req.system:
        try:
            messages.append({"role": "system", "content": content_text(req.system, "system")})
        except RenderError as e:
            raise ApiError(400, str(e), param="system") from None
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
                try:
                    out = b.get("content") or ""
                    out = out if isinstance(out, str) else content_text(out, f"{where}.{j}.content")
                except RenderError as e:
                    raise ApiError(400, str(e), param=f"{where}.{j}.content") from None
                messages.append(
                    {
                        "role": "tool",
                        "content": out,
                        "tool_call_id": str(b.get("tool_use_id") or ""),
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ApiError(
                    400,
                    f"{where}.{j}.type: {kind!r} is not supported in a {m.role} "
                    "message (text, tool_use, tool_result)",
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


def _sampling(
    session: Session,
    n: int,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stops: list[str],
    seed: int | None,
    top_logprobs: int = 0,
) -> list[SamplingParams]:
    """One SamplingParams per choice (seed + i each); the session's forced fields win."""
    try:
        return [
            SamplingParams(
                **{
                    "max_tokens": max_tokens,
                    "temperature": 1.0 if temperature is None else temperature,
                    "top_p": 1.0 if top_p is None else top_p,
                    "top_k": top_k or 0,
                    "stop": tuple(stops),
                    "seed": None if seed is None else seed + i,
                    "top_logprobs": top_logprobs,
                    **session.sampling,
                }
            )
            for i in range(n)
        ]
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 16 or any(not s for s in stops):
        raise ApiError(400, "stop: up to 16 non-empty strings", param="stop")
    return stops


def _client_finish(ev: _Event) -> str:
    # "abort" (stopped by close or pause) is not an OpenAI finish reason; the output is cut short
    return "length" if ev.finish == "abort" else ev.finish or "stop"


def _usage(prompt_tokens: int, results: list[_Event]) -> dict[str, int]:
    c = sum(ev.output_tokens for ev in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": c,
        "total_tokens": prompt_tokens + c,
    }


def _add(event: _Event, kind: str, value: Any) -> None:
    if kind == "text":
        event.text += value
    else:
        event.tool_calls.append(value)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers, media_type="application/json")


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return length not in (None, "0")


async def _quiet(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(Exception):
        await aw


async def _merge(
    gens: list[AsyncIterator[_Event]], firsts: list[_Event]
) -> AsyncIterator[tuple[int, _Event]]:
    """Events of several choices as they come, tagged with the choice index."""
    live = [i for i, ev in enumerate(firsts) if ev.finish is None]
    if len(live) == 1:
        i = live[0]
        async for ev in gens[i]:
            yield i, ev
        return
    queue: asyncio.Queue[tuple[int, _Event | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for ev in gens[i]:
                await queue.put((i, ev))
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class HttpServer:
    """uvicorn serving one app on TCP and optionally a Unix socket, inside the current loop."""

    def __init__(self, app: Any, host: str, port: int, uds: str | None) -> None:
        import uvicorn

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
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
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
