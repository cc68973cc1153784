"""Request models of the gateway's HTTP surface, and its error type and shapes.

Requests are validated with pydantic; unknown fields are ignored (SDKs send many we do not use),
wrong ones are a 400 that names the field. `ApiError` is the one error type of the request
boundary: it carries the HTTP status and renders in OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) or Anthropic's for `/v1/messages`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """A request the gateway refuses, with its HTTP status."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
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
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
            503: "overloaded_error",
        }.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def validate(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------
# OpenAI chat completions


class FunctionDef(_Loose):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Loose):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class NamedToolChoiceFunction(_Loose):
    name: str


class NamedToolChoice(_Loose):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class StreamOptions(_Loose):
    include_usage: bool = False


class ChatCompletionRequest(_Loose):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None


class CompletionRequest(_Loose):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None


# ---------------------------------------------------------------------------------------------
# OpenAI Responses (the subset agent SDKs use)


class ResponsesTool(_Loose):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Loose):
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
    seed: int | None = None
    """Extension: a sampling seed, as in chat completions."""


# ---------------------------------------------------------------------------------------------
# Anthropic messages


class AnthropicTool(_Loose):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class AnthropicMessage(_Loose):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicRequest(_Loose):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stream: bool = False


# ---------------------------------------------------------------------------------------------
# Admin


class SessionSampling(_Strict):
    """Sampling fields forced on every call of a session, whatever the agent sends."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)


class CreateSessionRequest(_Strict):
    metadata: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    sampling: SessionSampling | None = None


class RewardRequest(_Strict):
    reward: float
    info: dict[str, Any] | None = None


class CloseRequest(_Strict):
    status: Literal["ok", "aborted", "error"] = "ok"
    reason: str = ""


class PauseRequest(_Strict):
    mode: Literal["abort", "retract", "in_place"] | None = None
