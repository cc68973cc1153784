"""The one validation layer of the gateway's HTTP boundary: error type, strict models, limits.

Every request, whatever its API surface, passes the same checks in the same order:
1. `read_json` (in `gateway.server.http`): body size (413) while the body streams in, a
   slow-body timeout (408), JSON syntax (orjson: no NaN/Infinity literals, no 1e400), nesting
   depth (`RequestLimits.max_json_depth`, 400).
2. A surface's request model (`StrictModel`): pydantic strict mode, so a string is not an int, a
   bool is not an int or a float, `"NaN"` is not a number; every float is finite; unknown fields
   are ignored, as OpenAI does (SDKs send many we do not use). The error names the field.
3. `check_limits` on the surface's translation, the one internal `GenRequest`: message count,
   stop strings (count and length), tools (count and schema size), `n`, `max_tokens` — so a
   limit exists once and holds on every surface.

`ApiError` is the one error type of the boundary: it carries the HTTP status and renders in
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) or Anthropic's for
`/v1/messages`. Nothing a client sends may produce a 5xx.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=+-]{0,199}")
"""Session ids chosen by the admin: a URL path segment, no `~` (archived ids end in `~N`)."""


class ApiError(Exception):
    """A request the gateway refuses, with its HTTP status."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "invalid_request_error",
        409: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }
    ANTHROPIC_TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        other = "api_error" if self.status >= 500 else "invalid_request_error"
        kind = self.ANTHROPIC_TYPES.get(self.status, other)
        return {"type": "error", "error": {"type": kind, "message": self.message}}


class StrictModel(BaseModel):
    """A request model: strict types, finite floats, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class AdminModel(BaseModel):
    """An admin request model: as `StrictModel`, but unknown fields are an error (our own API)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def validate(model: type[BaseModel], data: Any) -> Any:
    """Validate a parsed JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"])
        where = f"{param}: " if param else ""
        raise ApiError(400, f"{where}{err['msg']}", param=param, code="invalid_value") from None


def _param(loc: tuple) -> str | None:
    # pydantic puts union members into the location (`stop.list[str]`, `tool_choice.Named`);
    # the client only knows its own field names and list indices
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int)
        or (p and p[0].islower() and p.isidentifier() and p not in _TYPE_NAMES)
    ]
    return ".".join(parts) or None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


@dataclass
class RequestLimits:
    """Limits of one request, the same on every API surface."""

    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body; larger ones get 413 (checked while it streams in)."""
    max_json_depth: int = 64
    """Deepest nesting of arrays and objects in a body (tool schemas need a few levels)."""
    max_messages: int = 4096
    """Most messages (or input items) in one request."""
    max_stop: int = 16
    """Most stop strings (`stop`, Anthropic `stop_sequences`)."""
    max_stop_chars: int = 256
    """Longest stop string, in characters."""
    max_tools: int = 128
    """Most tools in one request."""
    max_tool_schema_bytes: int = 64 * 1024
    """Largest tool definition (name, description, JSON schema), serialized."""
    max_n: int = 16
    """Most choices (`n`) in one request."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("limits.max_body_bytes must be >= 1024")
        if self.max_json_depth < 8:
            raise ValueError("limits.max_json_depth must be >= 8 (tool schemas nest)")
        for name in ("max_messages", "max_stop", "max_stop_chars", "max_tools", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1")


def check_depth(value: Any, limit: int) -> None:
    """400 when arrays/objects nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise ApiError(
                400,
                f"the request body nests arrays/objects deeper than {limit} levels",
                code="too_deep",
            )
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
