"""The `Gateway`: its config, in-process API, and the app that routes every API surface.

Every model request goes the same way, whatever its surface (`_serve`): read the body within the
limits, let the surface validate and translate it into the one `GenRequest`, check the model and
that the gateway is serving, find (or, in open mode, open) the session, admit it under the
per-session concurrency limit, then the generation core renders, runs and logs it, and the
surface formats the reply. A request that fails before reaching the engine leaves nothing behind
(a session it opened is discarded). See `gateway.server` for the package layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway import models
from gateway.engines import make_engine
from gateway.engines.base import Engine
from gateway.metrics import GatewayMetrics
from gateway.render import Renderer, load_renderer
from gateway.server.admin import admin_routes, check_reward, check_session_id
from gateway.server.aio import shielded
from gateway.server.auth import Auth
from gateway.server.config import GatewayConfig
from gateway.server.core import Core
from gateway.server.http import (
    HttpServer,
    disconnected,
    http_error,
    internal_error,
    json_response,
    read_json,
)
from gateway.server.request import ClientGone
from gateway.server.surfaces import Surface, all_surfaces
from gateway.server.ui import ui_routes
from gateway.server.validation import ApiError
from gateway.sessions import Session, SessionStore
from gateway.trajectory import Status, Trajectory, TrajectoryLog

log = logging.getLogger("loongsage.gateway")


class ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body however the response ends. Starlette leaves
    the body's generator suspended when the response is cancelled inside `send` (a client that
    stopped reading, a server ending its graceful shutdown), so the generator's cleanup (abort,
    log the turns, end the session's request) would wait for garbage collection: a SIGTERM
    drain then hung for `close_timeout_s` in `close_session`."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await shielded(self.body_iterator.aclose())  # type: ignore[attr-defined]


class Gateway:
    """Sessions, token log and the HTTP app in front of `engine`.

    In-process (the controller):

        gateway = Gateway(engine, model_path, GatewayConfig(auth="keys"))
        session_id, api_key = gateway.create_session({"task": 3})
        client = gateway.openai_client(api_key)       # AsyncOpenAI over an ASGI transport
        ...; gateway.attach_reward(session_id, 1.0); traj = await gateway.close_session(session_id)

    or over HTTP (`python -m gateway.serve`, or `await gateway.start_http(port=..., uds=...)`).
    """

    def __init__(
        self,
        engine: Engine,
        model_path: str | Path,
        config: GatewayConfig | None = None,
        *,
        model_name: str | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        self.cfg = cfg = config or GatewayConfig()
        self.engine = engine
        self.renderer = renderer or load_renderer(model_path)
        self.model_name = model_name or cfg.served_model_name or models.model_name(str(model_path))
        self._model_names = {self.model_name, str(model_path), Path(model_path).name}
        self.admin_token = cfg.admin_token or "adm-" + secrets.token_urlsafe(24)
        self.sessions = SessionStore(cfg.max_closed_sessions)
        self.auth = Auth(cfg.auth, self.admin_token, self.sessions)
        self.metrics = GatewayMetrics(
            active_sessions=lambda: self.sessions.num_open,
            engine_load=lambda: self.engine.load,
            engine_healthy=lambda: float(self._healthy),
        )
        self.core = Core(
            engine,
            self.renderer,
            self.metrics,
            cfg.limits,
            cfg.default_max_tokens,
            cfg.max_tokens_limit,
            cfg.retry_after_s,
        )
        self.log = TrajectoryLog(Path(cfg.log_dir) / "trajectories.jsonl") if cfg.log_dir else None
        self._paused = self._engine_paused = self._draining = self._closing = False
        self._healthy = True
        self._health_task: asyncio.Task | None = None
        self._owns_engine = False
        self.app = Starlette(
            routes=self._routes(),
            exception_handlers={HTTPException: http_error, Exception: internal_error},
        )

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> Gateway:
        """Resolve the model, build the engine `cfg.engine` describes and the gateway on it."""
        path = models.resolve_model(cfg.model)
        name = cfg.served_model_name or models.model_name(cfg.model)
        gateway = cls(make_engine(cfg.engine, path), path, cfg, model_name=name)
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
        """A new session -> (session id, its API key). ValueError for a bad or taken id.

        `sampling` ({temperature, top_p, top_k}) is forced on every call of the session;
        `sampling["max_tokens"]` caps every call's output (when the agent asks for more or for
        nothing); each turn logs the cap used and what the agent asked for."""
        from gateway.server.admin import SessionSampling

        if session_id is not None:
            check_session_id(session_id)
        sampling = dict(sampling or {})
        if sampling:
            try:
                SessionSampling.model_validate(sampling)
            except ValueError as e:
                raise ValueError(f"sampling: {e}") from None
        cap = sampling.pop("max_tokens", None)
        session = self.sessions.create(metadata, session_id, sampling=sampling)
        session.max_tokens = cap
        return session.id, session.api_key

    def attach_reward(
        self, session_id: str, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        traj = self._get(session_id).trajectory
        traj.reward = check_reward(reward)
        if info:
            traj.info.update(info)

    async def close_session(
        self, session_id: str, status: Status = "ok", reason: str = ""
    ) -> Trajectory:
        """Close a session: abort its running requests, wait for them to be logged, export (and
        append to the log). A closed open-mode session frees its key for a fresh session."""
        session = self._get(session_id)
        if session.closed:
            return session.export()
        self.sessions.mark_closed(session, status, reason)
        for rid in list(session.request_ids):
            with contextlib.suppress(Exception):
                await self.engine.abort(rid)
        if not await session.wait_idle(self.cfg.close_timeout_s):
            log.warning("session %s: requests still running after close", session_id)
        if session.open_mode:
            self.sessions.archive(session)
        traj = session.export()
        if self.log is not None:
            await asyncio.to_thread(self.log.append, traj)
        return traj

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
        if self._engine_paused:
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
        cfg = self.cfg
        server = HttpServer(
            self.app,
            host,
            port,
            uds,
            cfg.header_timeout_s,
            cfg.max_header_bytes,
            cfg.body_timeout_s,
        )
        await server.start()
        return server

    async def shutdown(
        self,
        grace_s: float | None = None,
        then: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """Stop admitting requests (503), let running ones finish for up to `grace_s`
        (default `shutdown_grace_s`), then close every open session as `aborted: shutdown`
        (aborting what still runs; each is logged when `log_dir` is set) while `then` runs
        (`gateway.serve` stops the HTTP server there, which ends responses stuck on clients
        that stopped reading, so their turns are logged too)."""
        self._draining = True
        deadline = time.monotonic() + (self.cfg.shutdown_grace_s if grace_s is None else grace_s)
        while time.monotonic() < deadline and any(s.requests for s in self.sessions.all()):
            await asyncio.sleep(0.05)
        open_ids = [s.id for s in self.sessions.all() if not s.closed]
        closing = [self.close_session(i, "aborted", "shutdown") for i in open_ids]
        await asyncio.gather(*closing, *([then()] if then else []))

    async def aclose(self) -> None:
        self._closing = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(BaseException):
                await self._health_task
            self._health_task = None
        self.core.close()
        if self._owns_engine:
            await self.engine.close()

    # -----------------------------------------------------------------------------------------
    # Routing

    def _routes(self) -> list[Route]:
        routes = []  # the API surfaces first: Starlette tries routes in order
        for cls in all_surfaces():
            surface = cls(self.model_name, self.renderer)
            handler = self.endpoint(surface.name, self._surface_handler(surface), surface)
            routes.append(Route(surface.path, handler, methods=["POST"]))
            routes.append(Route("/sessions/{sid}" + surface.path, handler, methods=["POST"]))
        return [
            *routes,
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/models", self.endpoint("models", self._models), methods=["GET"]),
            Route("/v1/models/{model:path}", self.endpoint("models", self._model), methods=["GET"]),
            Route(
                "/sessions/{sid}/v1/models", self.endpoint("models", self._models), methods=["GET"]
            ),
            *admin_routes(self),
            *ui_routes(self),
        ]

    def endpoint(
        self,
        name: str,
        handler: Callable[[Request], Awaitable[Response]],
        surface: Surface | None = None,
    ) -> Callable[[Request], Awaitable[Response]]:
        """`handler` with errors rendered in the surface's shape, and metrics."""

        async def wrapped(request: Request) -> Response:
            start = time.perf_counter()
            self._ensure_started()
            try:
                response = await handler(request)
            except ApiError as e:
                response = json_response(
                    surface.error_body(e) if surface else e.openai_body(), e.status, e.headers
                )
            except Exception:
                log.exception("internal error in %s", request.url.path)
                err = ApiError(500, "internal gateway error; see the gateway log")
                response = json_response(
                    surface.error_body(err) if surface else err.openai_body(), 500
                )
            self.metrics.observe(name, response.status_code, time.perf_counter() - start)
            return response

        return wrapped

    def _surface_handler(self, surface: Surface) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            return await self._serve(surface, request)

        return handler

    async def _serve(self, surface: Surface, request: Request) -> Response:
        cfg = self.cfg
        body, size = await read_json(request, cfg.limits)
        req = surface.parse(body)
        req.body_bytes = size
        self._check_model(req.model)
        self._check_serving()
        session, _ = self.auth.session_for(request)
        if session.requests >= cfg.max_concurrent_per_session:
            raise ApiError(
                429,
                f"session {session.id!r} already has {session.requests} requests in flight "
                f"(limit {cfg.max_concurrent_per_session})",
                code="too_many_requests",
                headers={"Retry-After": str(cfg.retry_after_s)},
            )
        session.begin()
        streaming = False
        try:
            job = await self.core.start(session, req)
            if req.stream:
                out = surface.streamer(job)
                body_iter = await self.core.stream(
                    job, out.events, out.end, out.error, lambda: self._end(session)
                )
                streaming = True
                return ClosingStream(
                    body_iter, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            try:
                results = await self.core.collect(job, lambda: disconnected(request))
            except ClientGone:
                return Response(status_code=499)  # nobody is there to read it
            return json_response(surface.reply(job, results))
        finally:
            if not streaming:
                self._end(session)

    def _end(self, session: Session) -> None:
        session.end()
        # an open-mode session that a failed first request opened: forget it
        if session.open_mode and session.requests == 0 and not session.trajectory.turns:
            self.sessions.discard(session)

    # -----------------------------------------------------------------------------------------
    # Checks, health, simple routes

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"session {session_id!r} not found", code="session_not_found")
        return session

    def _check_serving(self) -> None:
        headers = {"Retry-After": str(self.cfg.retry_after_s)}
        if self._draining:
            raise ApiError(503, "the gateway is shutting down", code="shutting_down")
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
                f"model {name[:200]!r} not found; this gateway serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

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
        if not self.cfg.idle_session_s:
            return
        cutoff = time.monotonic() - self.cfg.idle_session_s
        for session in self.sessions.all():
            idle = session.requests == 0 and session.last_used < cutoff
            if session.open_mode and not session.closed and idle:
                reason = f"idle: no request for {self.cfg.idle_session_s:g} s"
                await self.close_session(session.id, "ok", reason)

    async def _health(self, request: Request) -> Response:
        self._ensure_started()
        body = {
            "status": "ok" if self._healthy else "unhealthy",
            "paused": self._paused,
            "weight_version": self.engine.weight_version,
        }
        return json_response(body, 200 if self._healthy else 503)

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
        return json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return json_response(self._model_card())
