"""`GatewayConfig`: every setting of a gateway, with its help text (`gateway.serve --help`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway import models
from gateway.engines import EngineConfig
from gateway.server.validation import RequestLimits


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
    """`open`: any API key opens a session of its own on first use; `keys`: the admin creates
    sessions, each with its own API key (training). Admin routes need the admin token in both."""
    admin_token: str | None = None
    """Bearer token of the admin routes; a random one is made when unset (gateway.serve prints
    it and writes it to a file only you can read)."""
    default_max_tokens: int = 1024
    """max_tokens of a request that sends none (capped by the room left in the context)."""
    max_tokens_limit: int | None = None
    """Largest max_tokens a request may ask for (400 above); None: the engine's context."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Size, depth and count limits of one request, the same on every API surface."""
    body_timeout_s: float = 60.0
    """A request body must arrive within this (408 otherwise)."""
    header_timeout_s: float = 10.0
    """Request headers must arrive within this, or the connection is closed."""
    max_header_bytes: int = 64 * 1024
    """Largest request head (request line and headers); 431 above."""
    max_concurrent_per_session: int = 16
    """Requests one session may have in flight; more get 429."""
    max_closed_sessions: int = 10_000
    """Closed sessions kept for export; the oldest beyond this are forgotten."""
    idle_session_s: float = 3600.0
    """auth=open: close a session with no request for this long (its key then starts a fresh
    session; the old one stays readable as `<key>~1`); 0 keeps them open."""
    log_dir: str | None = None
    """Append every closed session's trajectory to `log_dir/trajectories.jsonl` (fsync'd), and
    close the open ones as `aborted: shutdown` when the gateway stops. Read back with
    `gateway.trajectory.read_trajectories`."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM/SIGINT: how long running requests may finish before they are aborted."""
    health_interval_s: float = 2.0
    """Seconds between engine health checks."""
    retry_after_s: int = 1
    """Retry-After of a 503 (paused, or no healthy engine)."""
    close_timeout_s: float = 30.0
    """How long close waits for a session's aborted requests to finish and be logged."""

    def __post_init__(self) -> None:
        if self.max_concurrent_per_session < 1:
            raise ValueError("max_concurrent_per_session must be >= 1")
        if self.idle_session_s < 0:
            raise ValueError("idle_session_s must be >= 0 (0 keeps open-mode sessions open)")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1 (or None: the engine's context)")
        if min(self.body_timeout_s, self.header_timeout_s, self.shutdown_grace_s) < 0:
            raise ValueError("timeouts must be >= 0")
