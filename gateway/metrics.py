"""Prometheus metrics of one gateway (its own registry, so several gateways can share a process).

Requests and latency by endpoint and status, tokens in and out, active sessions, segment forks,
and the engine's queue depth and health (read when scraped).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        active_sessions: Callable[[], float],
        engine_load: Callable[[], float],
        engine_healthy: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "gateway_request_seconds",
            "Request latency (to the last byte) by endpoint and status",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens sent to engines", registry=r
        )
        self.reused_tokens = Counter(
            "gateway_reused_prompt_tokens",
            "Prompt tokens reused verbatim from a session's earlier calls (token in, token out)",
            registry=r,
        )
        self.output_tokens = Counter(
            "gateway_output_tokens", "Tokens sampled by engines", registry=r
        )
        self.forks = Counter(
            "gateway_segment_forks",
            "Requests whose history matched none of their session's earlier calls",
            registry=r,
        )
        Gauge("gateway_active_sessions", "Open sessions", registry=r).set_function(active_sessions)
        Gauge(
            "gateway_engine_queue_depth", "Requests queued or running in the engine", registry=r
        ).set_function(engine_load)
        Gauge(
            "gateway_engine_healthy", "1 when the engine passed its last health check", registry=r
        ).set_function(engine_healthy)

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        code = str(status)
        self.requests.labels(endpoint, code).inc()
        self.latency.labels(endpoint, code).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
