"""The Engine protocol: what the gateway, the trainer and TransferMesh need from an inference engine.

Two implementations: `local` (the embedded torch engine, `gateway/engines/local.py`) and
`sglang` (an HTTP client of real SGLang servers, `gateway/engines/sglang.py`). Engines speak
token ids only; rendering chat messages is the gateway's job.

Every method is async: the gateway awaits them on its event loop, and Ray actors run async
methods natively. Generation is a stream of `Chunk`s (one or more new tokens each, with their
behaviour log-probs and the weight version that produced each); the last chunk carries the
`finish_reason`. `generate` collects a stream into one `Generation`. `DelegatingEngine` is the
base of an engine that wraps another and changes some of its calls (tests record or break them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (temperature 0), as vLLM and SGLang do: dividing
logits by 1e-40 (0 in float32) or a denormal gives inf/NaN."""


class EngineError(RuntimeError):
    """An engine failed (crashed, unreachable, unhealthy): not the caller's fault."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; `SamplingParams.from_dict` rejects unknown fields."""

    max_tokens: int = 256
    """Maximum number of tokens to generate (>= 1)."""
    temperature: float = 1.0
    """0 means greedy; anything below `MIN_TEMPERATURE` becomes 0."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (the model's EOS ids are always included by the engine)."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the tokens up to and including the match are kept."""
    seed: int | None = None
    """Makes sampling reproducible for this request, independently of its batch neighbours."""
    ignore_eos: bool = False
    """Keep generating past EOS (for benchmarks)."""
    top_logprobs: int = 0
    """Also return the this many most likely tokens and their logprobs at every position."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not -(2**63) <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling field(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
            )
        data = dict(data)
        for key in ("stop_token_ids", "stop"):
            if key in data and data[key] is not None:
                value = data[key]
                data[key] = tuple([value] if isinstance(value, int | str) else value)
        return cls(**data)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Chunk:
    """New tokens of one request since the previous chunk."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None
    """Set on the last chunk only."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """With `SamplingParams.top_logprobs`: per new token, (token id, logprob) of the most likely
    tokens at its position, most likely first; else empty."""


@dataclass
class Generation:
    """A whole generation: what `Engine.generate` returns."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason = "length"

    def add(self, chunk: Chunk) -> None:
        self.output_ids += chunk.token_ids
        self.output_logprobs += chunk.logprobs
        self.output_versions += chunk.versions
        self.output_top_logprobs += chunk.top_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


@runtime_checkable
class Engine(Protocol):
    """An inference engine behind the gateway. See the module docstring."""

    @property
    def weight_version(self) -> int:
        """Version of the weights new tokens are sampled with."""
        ...

    @property
    def max_context(self) -> int:
        """Longest prompt + output the engine accepts."""
        ...

    def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Generate from `input_ids`; raises ValueError for bad input before any chunk.

        `session_id` keeps a session on one engine behind a router (warm prefix cache); a single
        engine ignores it."""
        ...

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        """The whole of `stream`; this default (`collect`) is inherited by a class that
        subclasses Engine, others write their own."""
        return await collect(self.stream(input_ids, params, request_id, session_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason `abort`. Unknown ids are ignored."""
        ...

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """Prefill-only: logprob of token i given tokens < i, for i in [start, len) per sequence."""
        ...

    async def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop scheduling: `abort` ends running requests, `retract` re-queues them, `in_place`
        keeps them and their cache until `resume`."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in new weights atomically between steps; tokens after it carry `version`."""
        ...

    async def health(self) -> bool: ...

    @property
    def load(self) -> int:
        """Requests queued or running (for least-loaded routing)."""
        ...

    async def close(self) -> None: ...


class DelegatingEngine(Engine):
    """An Engine that hands every call to `inner`; a subclass overrides what it changes.

    `generate` is Engine's: it collects this engine's own `stream`, so overriding `stream` is
    enough to see (or alter) every generation. What lies beyond the protocol (`connect`,
    `placement`, `run`, ...) is the inner engine's too."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: the inner engine's own extras.
        return getattr(self.inner, name)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    @property
    def load(self) -> int:
        return self.inner.load

    def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        return self.inner.stream(input_ids, params, request_id, session_id)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        return await self.inner.score(sequences, start)

    async def pause(self, mode: PauseMode = "in_place") -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await self.inner.update_weights(state, version)

    async def health(self) -> bool:
        return await self.inner.health()

    async def close(self) -> None:
        await self.inner.close()


async def collect(chunks: AsyncIterator[Chunk]) -> Generation:
    out = Generation()
    async for chunk in chunks:
        out.add(chunk)
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
