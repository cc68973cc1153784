"""Admin routes: sessions (create, list, read, reward, close, trajectory), pause/resume, weights.

All need the admin token, except reading a session (`GET /sessions/{sid}` and its trajectory),
which its own key may do too. Listings carry session ids and summaries, never keys.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.server.http import json_response, read_json
from gateway.server.validation import SESSION_ID, AdminModel, ApiError, validate

if TYPE_CHECKING:
    from gateway.server.app import Gateway


class SessionSampling(AdminModel):
    """Sampling fields forced on every call of a session, whatever the agent sends."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    """A cap: applied when the agent asks for more, or for nothing."""


class CreateSessionRequest(AdminModel):
    metadata: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(None, pattern=f"^{SESSION_ID.pattern}$")
    sampling: SessionSampling | None = None


class RewardRequest(AdminModel):
    reward: float
    info: dict[str, Any] | None = None


class CloseRequest(AdminModel):
    status: Literal["ok", "aborted", "error"] = "ok"
    reason: str = Field("", max_length=4096)


class PauseRequest(AdminModel):
    mode: Literal["abort", "retract", "in_place"] | None = None


def check_session_id(sid: str) -> None:
    """ValueError unless `sid` may name a new session."""
    if not SESSION_ID.fullmatch(sid) or sid.startswith("o-"):
        raise ValueError(
            f"session id {sid[:64]!r}: 1-200 characters of A-Z a-z 0-9 . _ : = + -, starting "
            "with a letter or digit, and not starting with 'o-' (auth=open ids)"
        )


def check_reward(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"reward must be a finite number, got {reward!r}")
    return float(reward)


def admin_routes(gw: Gateway) -> list[Route]:
    limits = gw.cfg.limits
    auth = gw.auth

    async def body(request: Request) -> Any:
        return (await read_json(request, limits, empty={}))[0]

    async def create(request: Request) -> Response:
        auth.require_admin(request)
        req = validate(CreateSessionRequest, await body(request))
        sampling = req.sampling.model_dump(exclude_none=True) if req.sampling else None
        if req.id is not None:
            try:
                check_session_id(req.id)
            except ValueError as e:
                raise ApiError(400, str(e), param="id") from None
        try:
            sid, key = gw.create_session(req.metadata, req.id, sampling)
        except ValueError as e:
            raise ApiError(409, str(e), param="id", code="session_exists") from None
        base = str(request.base_url).rstrip("/")
        return json_response(
            {
                "id": sid,
                "api_key": key,
                "base_url": f"{base}/v1",
                "session_base_url": f"{base}/sessions/{sid}/v1",
            },
            201,
        )

    async def listing(request: Request) -> Response:
        auth.require_admin(request)
        return json_response({"object": "list", "data": gw.list_sessions()})

    async def summary(request: Request) -> Response:
        return json_response(auth.readable(request, request.path_params["sid"]).summary())

    async def trajectory(request: Request) -> Response:
        session = auth.readable(request, request.path_params["sid"])
        return json_response(session.export().to_dict())

    async def reward(request: Request) -> Response:
        auth.require_admin(request)
        session = auth.readable(request, request.path_params["sid"])
        req = validate(RewardRequest, await body(request))
        gw.attach_reward(session.id, req.reward, req.info)
        return json_response({"id": session.id, "reward": req.reward})

    async def close(request: Request) -> Response:
        auth.require_admin(request)
        session = auth.readable(request, request.path_params["sid"])
        req = validate(CloseRequest, await body(request))
        traj = await gw.close_session(session.id, req.status, req.reason)
        return json_response(traj.to_dict())

    async def pause(request: Request) -> Response:
        auth.require_admin(request)
        await gw.pause(validate(PauseRequest, await body(request)).mode)
        return json_response({"paused": True})

    async def resume(request: Request) -> Response:
        auth.require_admin(request)
        await gw.resume()
        return json_response({"paused": False})

    async def weight_version(request: Request) -> Response:
        auth.require_admin(request)
        return json_response({"weight_version": gw.engine.weight_version})

    wrap = gw.endpoint
    return [
        Route("/sessions", wrap("admin", create), methods=["POST"]),
        Route("/sessions", wrap("admin", listing), methods=["GET"]),
        Route("/sessions/{sid}", wrap("admin", summary), methods=["GET"]),
        Route("/sessions/{sid}/reward", wrap("admin", reward), methods=["POST"]),
        Route("/sessions/{sid}/close", wrap("admin", close), methods=["POST"]),
        Route("/sessions/{sid}/trajectory", wrap("admin", trajectory), methods=["GET"]),
        Route("/pause", wrap("admin", pause), methods=["POST"]),
        Route("/resume", wrap("admin", resume), methods=["POST"]),
        Route("/weight_version", wrap("admin", weight_version), methods=["GET"]),
    ]
