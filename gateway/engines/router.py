"""`Router`: several engines behind one Engine, for a gateway in front of many engines.

Any Engine works: local engines in this process, engines in Ray actors (`RayEngine`), SGLang
servers (`SGLangEngine`), or a mix; `make_engine` builds one for `engine.replicas` or several
SGLang URLs.

Routing:
- session-sticky: a session's requests go to the engine that served it before, while that
  engine is in rotation, so its prefix (radix) cache stays warm across the session's turns;
- least-loaded (`Engine.load`, ties rotate) for new sessions, requests without a session and
  prefill-only scoring;
- health: a background task calls every engine's `health()` each `health_interval_s`; an engine
  that fails it, or fails a request before its first token, leaves the rotation and comes back
  when a later check passes. A request that fails before any token is retried on another engine
  (failover; the session moves with it). Once tokens have been handed out a failure is raised,
  since replaying would duplicate or alter logged tokens.

Control fans out: `pause`, `resume` and `update_weights` go to every engine at once, and health
probes stop while paused (a paused SGLang server fails its probe). Weights usually reach the
engines without the router (TransferMesh pushes to each engine over its own route), so the
rotation follows the engines' versions: an engine behind the newest version among the healthy
engines (it missed a push: down, failed, or not reached yet) is out of the rotation until a
later push reaches it, so new requests are never sampled with older weights than another engine
already serves. `weight_version` is the minimum over the engines in rotation: tokens carry the
exact version of the engine that produced them, but a single number for "what new tokens are
sampled with" can only promise the oldest of them, which is the safe side for a staleness gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import torch

from gateway.engines.base import Chunk, Engine, EngineError, Generation, PauseMode, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class Router:
    """An Engine made of engines; see the module docstring."""

    def __init__(
        self,
        engines: list[Engine],
        *,
        health_interval_s: float = 5.0,
        max_sessions: int = 100_000,
    ) -> None:
        if not engines:
            raise ValueError("Router needs at least one engine")
        if health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {health_interval_s}")
        self.engines = list(engines)
        self.health_interval_s = health_interval_s
        self.max_sessions = max_sessions
        self._healthy = [True] * len(engines)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._requests: dict[str, int] = {}
        self._next = 0
        self._health_task: asyncio.Task[None] | None = None
        self._connected = False
        self._connect_lock: asyncio.Lock | None = None
        self._paused = False

    def __repr__(self) -> str:
        return f"Router({self.engines!r})"

    # -- lifecycle -----------------------------------------------------------------------------

    async def connect(self) -> Router:
        """Connect engines that need it (SGLang: context length, weight version), run a first
        health check and start the periodic ones. Engines that cannot connect start out of the
        rotation; raises EngineError only if none connects."""
        results = await asyncio.gather(
            *(_call(e, "connect") for e in self.engines), return_exceptions=True
        )
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                log.warning("engine %r failed to connect: %s", self.engines[i], result)
                self._healthy[i] = False
        if not any(self._healthy):
            raise EngineError(f"no engine could connect: {results}")
        self._connected = True
        self.start_health_checks()
        return self

    async def _ensure_connected(self) -> None:
        """`connect()` once, on first use, for callers that only construct the Router."""
        if self._connected:
            return
        self._connect_lock = self._connect_lock or asyncio.Lock()
        async with self._connect_lock:
            if not self._connected:
                await self.connect()

    def start_health_checks(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # a health round must never kill the loop
                log.exception("health check round failed")

    async def check_health(self) -> list[bool]:
        """Ask every engine now; returns and records who is healthy (unchanged while paused)."""
        if self._paused:
            return list(self._healthy)
        results = await asyncio.gather(*(e.health() for e in self.engines), return_exceptions=True)
        for i, ok in enumerate(results):
            healthy = ok is True
            if healthy != self._healthy[i]:
                log.warning("engine %r is %s", self.engines[i], "back" if healthy else "down")
            self._healthy[i] = healthy
        return list(self._healthy)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)

    # -- properties ----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        live = self._in_rotation() or range(len(self.engines))
        return min(self.engines[i].weight_version for i in live)

    @property
    def max_context(self) -> int:
        known: list[int] = []
        for e in self.engines:
            try:
                known.append(e.max_context)
            except EngineError:
                continue  # a down engine does not get to veto the others
        if not known:
            raise EngineError("no engine could report its context length")
        return min(known)

    @property
    def load(self) -> int:
        return sum(e.load for e in self.engines)

    @property
    def healthy(self) -> list[bool]:
        return list(self._healthy)

    async def health(self) -> bool:
        try:
            await self._ensure_connected()
        except EngineError:
            return False
        return bool(self._in_rotation())

    def engine_for(self, session_id: str) -> int | None:
        """Index of the engine a session is pinned to, if any."""
        return self._sessions.get(session_id)

    # -- routing -------------------------------------------------------------------------------

    def _in_rotation(self) -> list[int]:
        healthy = [i for i in range(len(self.engines)) if self._healthy[i]]
        newest = max((self.engines[i].weight_version for i in healthy), default=0)
        return [i for i in healthy if self.engines[i].weight_version >= newest]

    def _pick(self, session_id: str | None, exclude: set[int]) -> int:
        live = [i for i in self._in_rotation() if i not in exclude]
        if not live:
            raise EngineError(
                f"no healthy engine ({len(self.engines)} configured, {len(exclude)} failed "
                "this request)"
            )
        if session_id is not None:
            pinned = self._sessions.get(session_id)
            if pinned in live:
                self._sessions.move_to_end(session_id)
                return pinned
        n = len(self.engines)
        # Least loaded; ties go round-robin so an idle fleet still spreads new sessions.
        index = min(live, key=lambda i: (self.engines[i].load, (i - self._next) % n))
        self._next = (index + 1) % n
        if session_id is not None:
            self._sessions[session_id] = index
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return index

    def _failed(self, index: int, exc: BaseException) -> None:
        log.warning("engine %r failed, taking it out of rotation: %s", self.engines[index], exc)
        self._healthy[index] = False

    async def _with_failover(
        self, session_id: str | None, call: Callable[[Engine], Awaitable[T]]
    ) -> T:
        await self._ensure_connected()
        tried: set[int] = set()
        while True:
            index = self._pick(session_id, tried)
            try:
                return await call(self.engines[index])
            except EngineError as exc:
                self._failed(index, exc)
                tried.add(index)

    # -- generation ----------------------------------------------------------------------------

    async def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        await self._ensure_connected()
        request_id = request_id or uuid.uuid4().hex
        tried: set[int] = set()
        try:
            while True:
                index = self._pick(session_id, tried)
                self._requests[request_id] = index
                started = False
                try:
                    async for chunk in self.engines[index].stream(
                        input_ids, params, request_id, session_id
                    ):
                        started = True
                        yield chunk
                    return
                except (GeneratorExit, asyncio.CancelledError):
                    self._abort_soon(index, request_id)
                    raise
                except EngineError as exc:
                    if started:
                        raise
                    self._failed(index, exc)
                    tried.add(index)
        finally:
            self._requests.pop(request_id, None)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        request_id = request_id or uuid.uuid4().hex

        async def call(engine: Engine) -> Generation:
            index = self._requests[request_id] = self.engines.index(engine)
            try:
                return await engine.generate(input_ids, params, request_id, session_id)
            except asyncio.CancelledError:
                self._abort_soon(index, request_id)
                raise

        try:
            return await self._with_failover(session_id, call)
        finally:
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        index = self._requests.get(request_id)
        if index is not None:
            await self.engines[index].abort(request_id)

    def _abort_soon(self, index: int, request_id: str) -> None:
        """A request its caller left (closed or cancelled): the engine must stop it too, and
        `abort(request_id)` can no longer find it once the request has left `_requests`."""

        async def abort() -> None:
            with contextlib.suppress(Exception):
                await self.engines[index].abort(request_id)

        asyncio.get_running_loop().create_task(abort())

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        return await self._with_failover(None, lambda e: e.score(sequences, start))

    # -- control (fan-out) ---------------------------------------------------------------------

    async def _fan_out(self, what: str, call: Callable[[Engine], Awaitable[Any]]) -> list[int]:
        """Run `call` on every engine, healthy or not (a paused SGLang server fails its health
        probe, yet must hear `resume` and take the weight push that comes while it is paused).
        An engine that fails leaves the rotation; returns the indices that succeeded and raises
        EngineError if none did."""
        await self._ensure_connected()
        results = await asyncio.gather(*(call(e) for e in self.engines), return_exceptions=True)
        ok: list[int] = []
        errors: list[str] = []
        for i, result in enumerate(results):
            if isinstance(result, ValueError):
                raise result  # the caller's mistake, the same on every engine
            if isinstance(result, BaseException):
                if self._healthy[i]:
                    self._failed(i, result)
                errors.append(f"{self.engines[i]!r}: {result}")
            else:
                ok.append(i)
        if not ok:
            raise EngineError(f"{what} failed on every engine: {'; '.join(errors)}")
        return ok

    async def pause(self, mode: PauseMode = "in_place") -> None:
        # Health probes are skipped while paused: SGLang's /health runs a one-token generation,
        # which waits for `continue_generation`, so every paused engine would look dead.
        self._paused = True
        try:
            await self._fan_out("pause", lambda e: e.pause(mode))
        except BaseException:
            self._paused = False
            raise

    async def resume(self) -> None:
        try:
            await self._fan_out("resume", lambda e: e.resume())
        finally:
            self._paused = False

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        # Engines that miss this push (down, or failed) stay behind: out of the rotation.
        await self._fan_out("update_weights", lambda e: e.update_weights(state, version))


async def _call(engine: Engine, method: str) -> Any:
    fn = getattr(engine, method, None)
    return await fn() if fn is not None else None
