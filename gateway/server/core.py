"""The generation core shared by every API surface: session -> render -> engine -> token log.

A surface translates its wire request into one `GenRequest`. `Core.start` checks it against the
limits (once, for every surface), renders its messages with the session's token-in-token-out
history (`gateway.render`; off the event loop when the input is large, so one big request never
stalls the others), resolves `max_tokens` (the configured default when absent) and builds a
`Job`: the prompt ids and one `SamplingParams` per choice. `Core.events(job, i)` runs choice i on
the engine and yields `Event`s (text, tool calls, tokens) for the surface to format; however a
choice ends, its `Turn` is logged. `collect` runs every choice to the end, each in one engine call
(`Engine.generate`: SGLang answers once instead of one event per token), and aborts them on the
engine when the client goes away (the engine ends them with what they made); `stream` starts
them (errors before the first token are still HTTP errors) and returns the SSE body.

A reply the client never received in full (it disconnected) is logged with `delivered=False`:
such turns stay in the trajectory's `turns` but not in its segments (see `gateway.trajectory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.engines.base import Chunk, Engine, EngineError, Generation
from gateway.metrics import GatewayMetrics
from gateway.render import (
    IncrementalDecoder,
    Message,
    Renderer,
    RenderError,
    StopTrimmer,
    ToolCallParser,
    _Call,
)
from gateway.server.aio import close_all, merge, shielded
from gateway.server.request import (
    ClientGone,
    Event,
    GenRequest,
    Job,
    check_limits,
    sampling_params,
    tool_prefill,
)
from gateway.server.validation import ApiError, RequestLimits
from gateway.sessions import Session
from gateway.trajectory import Turn

WATCH_AFTER_S = 0.05
"""A non-streaming request still running after this starts watching for its client leaving."""

ABORT_WAIT_S = 2.0
"""How long an aborted non-streaming request may take to end before it is cancelled."""

OFFLOAD_BYTES = 32 * 1024
"""Requests with a larger body are rendered and tokenized on a worker thread."""


class Core:
    def __init__(
        self,
        engine: Engine,
        renderer: Renderer,
        metrics: GatewayMetrics,
        limits: RequestLimits,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        retry_after_s: int,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.metrics = metrics
        self.limits = limits
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.retry_after_s = retry_after_s
        self._pool: ThreadPoolExecutor | None = None
        self.max_token_chars = renderer.max_token_chars  # once, here, not in a request

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -----------------------------------------------------------------------------------------
    # Checks and rendering

    async def start(self, session: Session, req: GenRequest) -> Job:
        """Check, render and plan `req` for `session`; 4xx ApiError for anything wrong in it."""
        check_limits(req, self.limits, self.max_tokens_limit)
        prefill = tool_prefill(req)
        self._check_size(req)
        if req.messages is not None:
            try:
                prompt, call = await self._maybe_offload(
                    req.body_bytes,
                    session.history.prompt,
                    self.renderer,
                    req.messages,
                    req.tools,
                    prefill,
                )
            except RenderError as e:
                raise ApiError(400, str(e), param=req.name("messages")) from None
            if prompt.forked:
                session.forks += 1
                self.metrics.forks.inc()
            self.metrics.reused_tokens.inc(prompt.reused)
            ids = prompt.ids
        else:
            ids = await self._maybe_offload(req.body_bytes, self._prompt_ids, req.prompt)
            call = _Call((), b"", "", ids)
        self.metrics.prompt_tokens.inc(len(ids))
        max_tokens = self._max_tokens(req, len(ids), session.max_tokens)
        return Job(
            session,
            req,
            call,
            ids,
            sampling_params(session, req, max_tokens),
            bool(req.tools) and req.tool_choice != "none",
            prefill,
        )

    def _check_size(self, req: GenRequest) -> None:
        """A 400 for input certainly over the context, before spending time tokenizing it."""
        if isinstance(req.prompt, list):
            size = len(req.prompt)
        else:
            texts = [req.prompt or ""]
            for m in req.messages or ():
                texts.append(m.get("content") or "")
                texts += [c["function"]["arguments"] for c in m.get("tool_calls") or ()]
            size = sum(map(len, texts)) // self.max_token_chars
        if size > self.engine.max_context:
            name = req.name("messages") if req.messages is not None else "prompt"
            raise ApiError(
                400,
                f"{name}: the input is over {size} tokens; the context is "
                f"{self.engine.max_context}",
                param=name,
                code="context_length_exceeded",
            )

    async def _maybe_offload(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        if size < OFFLOAD_BYTES:
            return fn(*args)
        if self._pool is None:  # one thread: big inputs queue behind each other, not the loop
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gateway-render")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _prompt_ids(self, prompt: str | list[int] | None) -> list[int]:
        vocab = len(self.renderer.tokenizer)
        if isinstance(prompt, str):
            ids = self.renderer.encode(prompt)
        else:
            ids = list(prompt or ())
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise ApiError(400, "prompt: empty", param="prompt")
        return ids

    def _max_tokens(self, req: GenRequest, prompt_len: int, cap: int | None) -> int:
        """The request's max_tokens; the configured default when absent; the session's `cap`
        when absent or larger (clipped to the room left in the context)."""
        context = self.engine.max_context
        room = context - prompt_len
        if room < 1:
            raise ApiError(
                400,
                f"the prompt is {prompt_len} tokens; the context is {context}",
                param=req.name("messages") if req.messages is not None else "prompt",
                code="context_length_exceeded",
            )
        if cap is not None and (req.max_tokens is None or req.max_tokens > cap):
            return min(cap, room)
        if req.max_tokens is None:
            return min(self.default_max_tokens, self.max_tokens_limit or room, room)
        if req.max_tokens > room:
            name = req.name("max_tokens")
            raise ApiError(
                400,
                f"prompt ({prompt_len} tokens) + {name} ({req.max_tokens}) is over the context "
                f"of {context} tokens; lower {name} or shorten the input",
                param=name,
                code="context_length_exceeded",
            )
        return req.max_tokens

    # -----------------------------------------------------------------------------------------
    # Running choices

    async def events(self, job: Job, index: int, whole: bool = False) -> AsyncIterator[Event]:
        """Run one choice on the engine; yields client events; logs the turn however it ends.
        `whole`: one engine call for the whole reply (`Engine.generate`), for a client that does
        not stream: SGLang then answers once instead of one event per token."""
        session = job.session
        rid = job.rid(index)
        session.request_ids.add(rid)
        decoder = IncrementalDecoder(self.renderer)
        stops = StopTrimmer(job.req.stop)
        parser = ToolCallParser(job.prefill, forced=bool(job.prefill)) if job.parse_tools else None
        gen = Generation()
        finished = False
        started = time.time()
        stream: AsyncIterator[Chunk] | None = None
        emitted: list[str] = []
        try:
            args = (job.prompt_ids, job.params[index], rid, session.id)
            stream = _whole(self.engine, *args) if whole else self.engine.stream(*args)
            async for chunk in stream:
                gen.add(chunk)
                event = Event(
                    tokens=list(zip(chunk.token_ids, chunk.logprobs, strict=False)),
                    top=chunk.top_logprobs,
                )
                _feed(event, stops.push(decoder.push(chunk.token_ids)), parser)
                if chunk.finish_reason is None:
                    emitted.append(event.text)
                    yield event
                    continue
                break
            else:
                event = Event()
            _feed(event, stops.push(decoder.finish()) + stops.finish(), parser)
            if parser is not None:
                for kind, value in parser.finish():
                    _add(event, kind, value)
            finished = True
            calls = parser.calls if parser is not None else []
            # a reply cut by max_tokens reports `length`, even when a call parsed before the cut
            event.finish = (
                "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
            )
            event.stop_sequence = stops.matched
            event.output_tokens = len(gen.output_ids)
            reply: Message = {
                "role": "assistant",
                "content": "".join(emitted) + event.text,
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
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        finally:
            session.request_ids.discard(rid)
            if not finished:
                gen.finish_reason = "abort"
                asyncio.get_running_loop().create_task(_quiet(self.engine.abort(rid)))
            if stream is not None:  # left at its last chunk: closed here, not by the GC's hook
                with contextlib.suppress(BaseException):
                    await stream.aclose()  # type: ignore[attr-defined]
            if gen.output_ids or finished:
                called = finished and parser is not None and parser.calls
                turn = Turn(
                    job.prompt_ids,
                    gen.output_ids,
                    gen.output_logprobs,
                    gen.output_versions,
                    "tool_calls" if called and gen.finish_reason == "stop" else gen.finish_reason,
                    job.req.endpoint,
                    started,
                    time.time() - started,
                    delivered=not job.client_gone,
                    max_tokens=job.params[index].max_tokens,
                    asked_max_tokens=job.req.max_tokens,
                )
                job.turns.append(turn)
                session.add_turn(turn)
                self.metrics.output_tokens.inc(len(gen.output_ids))

    def all_events(self, job: Job, whole: bool = False) -> list[AsyncIterator[Event]]:
        return [self.events(job, i, whole) for i in range(len(job.params))]

    async def collect(
        self, job: Job, disconnected: Callable[[], Awaitable[Any]] | None = None
    ) -> list[Event]:
        """Run every choice to the end; one merged event per choice. When `disconnected`
        returns first, the choices are aborted, logged as undelivered, and ClientGone raised."""

        async def one(events: AsyncIterator[Event]) -> Event:
            total = Event()
            async for ev in events:
                total.text += ev.text
                total.tool_calls += ev.tool_calls
                total.tokens += ev.tokens
                total.top += ev.top
                total.finish, total.stop_sequence = ev.finish, ev.stop_sequence
                total.output_tokens = ev.output_tokens
            return total

        events = self.all_events(job, whole=True)
        work = asyncio.ensure_future(asyncio.gather(*(one(e) for e in events)))
        if disconnected is None:
            return list(await work)
        watcher: asyncio.Future | None = None
        gone = False
        try:
            # a reply that is ready soon needs no watcher (a task per request, for nothing)
            await asyncio.wait({work}, timeout=WATCH_AFTER_S)
            if not work.done():
                watcher = asyncio.ensure_future(disconnected())
                await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watcher is not None:
                watcher.cancel()
            if not work.done():
                gone = True
                job.mark_undelivered()
                await shielded(self._abort(job, work))
        if gone:
            raise ClientGone
        return list(work.result())

    async def _abort(self, job: Job, work: asyncio.Future) -> None:
        """Abort every choice of `job` on the engine, which then ends them with what they
        generated so far (logged as undelivered turns); cancel them if it takes too long."""
        aborts = (_quiet(self.engine.abort(job.rid(i))) for i in range(len(job.params)))
        await asyncio.gather(*aborts)
        await asyncio.wait({work}, timeout=ABORT_WAIT_S)
        work.cancel()
        with contextlib.suppress(BaseException):
            await work

    async def stream(
        self,
        job: Job,
        fmt: Callable[[int, Event], list[bytes]],
        final: Callable[[], list[bytes]],
        error: Callable[[ApiError], bytes],
        on_close: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        """Start every choice (errors before the first token are raised here, for an HTTP
        error), then return the SSE body; `on_close` runs when the body ends, however it ends."""
        gens = self.all_events(job)
        starts: list[asyncio.Future] = []
        try:
            if len(gens) == 1:  # the common case, without a task
                firsts = [await gens[0].__anext__()]
            else:
                starts = [asyncio.ensure_future(g.__anext__()) for g in gens]
                firsts = await asyncio.gather(*starts)
        except BaseException:
            await shielded(close_all(starts, gens))
            raise

        async def body() -> AsyncIterator[bytes]:
            complete = False
            merged = merge(gens, firsts)
            try:
                for i, ev in enumerate(firsts):
                    for b in fmt(i, ev):
                        yield b
                async for i, ev in merged:
                    for b in fmt(i, ev):
                        yield b
                for b in final():
                    yield b
                complete = True
            except ApiError as e:
                complete = True
                yield error(e)
            finally:

                async def cleanup() -> None:
                    await merged.aclose()
                    await close_all([], gens)
                    on_close()

                if complete:
                    await cleanup()
                else:  # the client went away mid-stream: we may be being cancelled
                    job.mark_undelivered()
                    await shielded(cleanup())

        return body()


async def _whole(engine: Engine, *args: Any) -> AsyncIterator[Chunk]:
    g = await engine.generate(*args)
    yield Chunk(
        g.output_ids, g.output_logprobs, g.output_versions, g.finish_reason, g.output_top_logprobs
    )


def _feed(event: Event, text: str, parser: ToolCallParser | None) -> None:
    if not text:
        return
    if parser is None:
        event.text += text
        return
    for kind, value in parser.push(text):
        _add(event, kind, value)


def _add(event: Event, kind: str, value: Any) -> None:
    if kind == "text":
        event.text += value
    else:
        event.tool_calls.append(value)


async def _quiet(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(Exception):
        await aw
