"""TeacherManager: named teachers scoring the student's tokens, within a memory budget.

    score(traj) ──route──► queue of its teacher ──worker──► resident? ──► engine.score(batch)
                                                  (one per      │ no: wait in the swap line,
                                                   teacher)     │ evict idle teachers LRU until
                                                                │ it fits, load, verify
                                                                ▼
                                               logprobs into the trajectory's segments

`score(traj)` routes a finished trajectory to its teacher (`route`: env tag, then env id) and
returns once every sampled token has the teacher's logprob (`Segment.teacher_logprobs`); the
controller awaits it before the sample joins its group, so a group is complete only when scored,
while other rollouts keep generating. Each teacher has a queue and a worker task: the worker
takes up to `max_batch_sequences` queued sequences and scores them in one prefill-only call
(`Engine.score`, T = 1), so requests are batched per teacher. A teacher that is not resident
lets its requests linger (`linger_s`, or until a full batch is queued) before it asks for memory,
so that each swap serves many requests.

Memory: a teacher counts its bytes (`memory_bytes`, or its weights at the engine's dtype) while
loading, resident or unloading, and the total never exceeds `memory_budget`: a swap first
unloads idle teachers, least recently used first, and loads only when they are gone. One swap
runs at a time, in order of request (the swap line); a resident teacher starts no new batch while
the head of the line needs its memory, so no teacher is starved by a busier one. Residency itself
is the engine kind's business (`residency.py`: rebuild from disk for `local`, release/resume for
`sglang`).

Verification: the first load of a teacher scores a fixed probe sequence and keeps its logprobs;
every later load must reproduce them (an SGLang server resumed without a weight backup comes
back with garbage), and every batch is checked for uniform logprobs (a broken teacher). Either
failure, a load that raises or a scoring call that fails is a `TeacherError` naming the teacher:
the manager stops (every waiting and later request fails with it) and the controller stops the
run with a checkpoint.

Metrics (`metrics()`, per train step): `teachers/resident_bytes_max` (the most held at once
since the last call), `teachers/swaps` (swap-ins after each teacher's first load, cumulative)
and per teacher `teachers/<name>/latency_s` (request to scores, mean), `.../tokens_per_s`
(scored tokens per second of scoring calls) and `.../swap_in_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from gateway.engines.base import Engine
from gateway.trajectory import Trajectory
from trainer.controller import StopRun
from trainer.teachers.config import DistillConfig, TeacherConfig, parse_bytes
from trainer.teachers.residency import RESIDENCY, Residency, weight_bytes

log = logging.getLogger("loongsage.teachers")

PROBE = [(7919 * i + 13) % 997 + 3 for i in range(48)]
"""Token ids of the fixed sequence every load is checked with (ids < 1000: any vocabulary)."""
PROBE_TOLERANCE = 1e-2
"""Largest |logprob difference| on the probe between a teacher's first load and a later one
(allows for kernels that differ between runs; broken weights are off by whole nats)."""
UNIFORM_SPREAD = 1e-3
"""Logprobs of at least `UNIFORM_MIN_TOKENS` different positions within this of each other, and
each below log(1/100): a uniform distribution, i.e. a broken teacher."""
UNIFORM_MIN_TOKENS = 8


class TeacherError(StopRun):
    """A teacher failed (load, weights, scoring); the message names it."""


@dataclass(eq=False)
class _Job:
    sequences: list[list[int]]
    starts: list[int]
    future: asyncio.Future[list[list[float]]]
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class _Stats:
    latency_s: float = 0.0
    jobs: int = 0
    tokens: int = 0
    score_s: float = 0.0
    swap_in_s: float = 0.0


@dataclass(eq=False)
class _Teacher:
    name: str
    cfg: TeacherConfig
    residency: Residency
    bytes: int
    path: Path | None
    state: str = "out"
    """out, loading, resident or unloading."""
    engine: Engine | None = None
    busy: bool = False
    last_used: float = 0.0
    loads: int = 0
    queue: deque[_Job] = field(default_factory=deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    probe: list[float] | None = None
    stats: _Stats = field(default_factory=_Stats)

    @property
    def queued_sequences(self) -> int:
        return sum(len(job.sequences) for job in self.queue)


class TeacherManager:
    """See the module docstring. `model_paths` maps each teacher to its folder (trainer.run
    resolves embedded names and makes recipe teachers first)."""

    def __init__(self, cfg: DistillConfig, model_paths: dict[str, Path]) -> None:
        self.cfg = cfg
        self.budget = cfg.budget_bytes
        self.teachers: dict[str, _Teacher] = {}
        for name, tcfg in cfg.teachers.items():
            path = model_paths.get(name)
            self.teachers[name] = _Teacher(
                name,
                tcfg,
                RESIDENCY.build(tcfg.engine.kind, tcfg.engine, path),
                teacher_bytes(name, tcfg, path),
                path,
            )
        for t in self.teachers.values():
            if self.budget is not None and t.bytes > self.budget:
                raise TeacherError(
                    f"teacher {t.name!r} needs {t.bytes} bytes, more than the whole "
                    f"memory_budget ({cfg.memory_budget}): raise algorithm.distill.memory_budget"
                )
        self._cond = asyncio.Condition()
        self._swap_line: deque[_Teacher] = deque()
        self._swapping = False
        self._workers: list[asyncio.Task] = []
        self._ready: asyncio.Task | None = None
        self._error: TeacherError | None = None
        self._swaps = 0
        self._resident_max = 0

    # -- what the controller calls -------------------------------------------------------------

    def teacher_for(self, traj: Trajectory) -> str | None:
        """The teacher of a trajectory: by its env tag, else its env id; None if not routed."""
        for key in (traj.metadata.get("env_tag"), traj.metadata.get("env")):
            if key is not None and key in self.cfg.route:
                return self.cfg.route[key]
        return None

    async def score(self, traj: Trajectory) -> None:
        """Attach the routed teacher's logprob of every sampled token to `traj`'s segments
        (`teacher_logprobs`, 0.0 on other tokens) and its name to `metadata["teacher"]`.
        Raises TeacherError when the teacher (or another one) failed."""
        name = self.teacher_for(traj)
        segments = [s for s in traj.segments if any(s.loss_mask)]
        if name is None or not segments:
            return
        starts = [s.loss_mask.index(1) for s in segments]
        scores = await self.score_tokens(name, [s.token_ids for s in segments], starts)
        for seg, start, lps in zip(segments, starts, scores, strict=True):
            padded = [0.0] * start + lps
            seg.teacher_logprobs = [
                lp if m else 0.0 for lp, m in zip(padded, seg.loss_mask, strict=True)
            ]
        traj.metadata["teacher"] = name

    async def score_tokens(
        self, name: str, sequences: list[list[int]], starts: list[int]
    ) -> list[list[float]]:
        """Teacher `name`'s log p(token i | tokens < i) for i in [start, len), per sequence."""
        if self._error is not None:
            raise self._error
        self._start()
        teacher = self.teachers[name]
        job = _Job(sequences, starts, asyncio.get_running_loop().create_future())
        teacher.queue.append(job)
        teacher.arrived.set()
        return await job.future

    def metrics(self) -> dict[str, float]:
        """Since the last call (resident max, per-teacher means); swaps are cumulative."""
        out = {
            "teachers/resident_bytes_max": float(self._resident_max),
            "teachers/swaps": float(self._swaps),
        }
        self._resident_max = self.resident_bytes()
        for t in self.teachers.values():
            s, t.stats = t.stats, _Stats()
            out[f"teachers/{t.name}/latency_s"] = s.latency_s / s.jobs if s.jobs else 0.0
            out[f"teachers/{t.name}/tokens_per_s"] = s.tokens / s.score_s if s.score_s else 0.0
            out[f"teachers/{t.name}/swap_in_s"] = s.swap_in_s
        return out

    def resident_bytes(self) -> int:
        """Bytes of the teachers loading, resident or unloading."""
        return sum(t.bytes for t in self.teachers.values() if t.state != "out")

    def resident(self) -> list[str]:
        return [t.name for t in self.teachers.values() if t.state == "resident"]

    async def close(self) -> None:
        """Stop the workers and let go of every teacher (local engines are closed; SGLang
        servers are left running with their memory)."""
        tasks = [*self._workers, *([self._ready] if self._ready else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in self.teachers.values():
            try:
                await t.residency.close()
            except Exception as e:  # closing: report, go on with the others
                log.warning("teacher %r did not close cleanly: %s", t.name, e)
            t.state, t.engine = "out", None

    async def __aenter__(self) -> TeacherManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- workers -------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._ready is not None:
            return
        self._ready = asyncio.create_task(self._release_at_start())
        self._workers = [asyncio.create_task(self._work(t)) for t in self.teachers.values()]

    async def _release_at_start(self) -> None:
        """Under a budget, servers that start loaded (SGLang) give their memory back first, and
        are swapped in like any teacher."""
        if self.budget is not None:
            starting = [t for t in self.teachers.values() if t.residency.resident_at_start]
            await asyncio.gather(*(t.residency.unload() for t in starting))

    async def _work(self, t: _Teacher) -> None:
        try:
            try:
                await asyncio.shield(self._ready)
            except Exception as e:
                raise _error(t, "could not release its memory at start", e) from e
            while True:
                await self._gather(t)
                await self._acquire(t)
                try:
                    await self._run_batch(t)
                finally:
                    async with self._cond:
                        t.busy = False
                        self._cond.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._fail(e if isinstance(e, TeacherError) else _error(t, "failed", e))

    async def _gather(self, t: _Teacher) -> None:
        """Wait for requests; a teacher that is not resident lingers for a fuller batch."""
        while not t.queue:
            t.arrived.clear()
            await t.arrived.wait()
        if t.state == "resident" or self.budget is None:
            return
        deadline = t.queue[0].queued_at + self.cfg.linger_s
        while t.queued_sequences < self.cfg.max_batch_sequences:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            t.arrived.clear()
            try:
                await asyncio.wait_for(t.arrived.wait(), left)
            except TimeoutError:
                return

    async def _acquire(self, t: _Teacher) -> None:
        """Return with `t` resident and busy (not evictable), swapping it in if needed."""
        async with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if t.state == "resident" and not self._wanted(t):
                    t.busy, t.last_used = True, time.monotonic()
                    return
                if t.state == "out" and t not in self._swap_line:
                    self._swap_line.append(t)
                if self._swap_line and self._swap_line[0] is t and not self._swapping:
                    victims = self._victims(t)
                    if victims is not None:
                        break
                await self._cond.wait()
            self._swapping = True
            for v in victims:
                v.state = "unloading"
        try:
            for v in victims:
                await self._unload(v)
            async with self._cond:
                t.state = "loading"
                self._note_resident()
            await self._load(t)
        finally:
            async with self._cond:
                self._swapping = False
                self._swap_line.popleft()
                if t.state == "resident":
                    t.busy, t.last_used = True, time.monotonic()
                self._cond.notify_all()

    def _victims(self, t: _Teacher) -> list[_Teacher] | None:
        """Idle resident teachers to unload, LRU first, so that `t` fits; None if it cannot fit
        yet (busy teachers hold the memory)."""
        if self.budget is None:
            return []
        free = self.budget - self.resident_bytes()
        victims = []
        for v in sorted(self.teachers.values(), key=lambda x: x.last_used):
            if free >= t.bytes:
                break
            if v.state == "resident" and not v.busy and v is not t:
                victims.append(v)
                free += v.bytes
        return victims if free >= t.bytes else None

    def _wanted(self, t: _Teacher) -> bool:
        """The head of the swap line waits for `t`'s memory."""
        if not self._swap_line or self._swapping:
            return False
        victims = self._victims(self._swap_line[0])
        return victims is None or t in victims

    async def _load(self, t: _Teacher) -> None:
        started = time.monotonic()
        try:
            engine = await t.residency.load()
        except Exception as e:
            async with self._cond:
                t.state = "out"
            raise _error(t, f"failed to load ({_where(t)})", e) from e
        t.engine = engine
        await self._verify(t)
        async with self._cond:
            t.state = "resident"
            t.loads += 1
            self._swaps += t.loads > 1
            t.stats.swap_in_s += time.monotonic() - started
        log.info("teacher %r resident (%.1f s); resident: %s", t.name,
                 time.monotonic() - started, self.resident())  # fmt: skip

    async def _unload(self, t: _Teacher) -> None:
        t.engine = None  # the residency's reference must be the last one, to free its memory
        await t.residency.unload()
        async with self._cond:
            t.state = "out"
            self._cond.notify_all()

    def _note_resident(self) -> None:
        held = self.resident_bytes()
        assert self.budget is None or held <= self.budget, "teacher memory over budget"
        self._resident_max = max(self._resident_max, held)

    async def _verify(self, t: _Teacher) -> None:
        """The probe's logprobs: not uniform on the first load, unchanged on the later ones."""
        (probe,) = await t.engine.score([PROBE], [1])
        check_not_uniform(t.name, probe)
        if t.probe is None:
            t.probe = probe
            return
        drift = max(abs(a - b) for a, b in zip(probe, t.probe, strict=True))
        if drift > PROBE_TOLERANCE:
            raise TeacherError(
                f"teacher {t.name!r} came back from a swap with different weights (probe "
                f"logprobs moved by up to {drift:.3g}); an SGLang teacher needs "
                "--enable-memory-saver --enable-weights-cpu-backup to keep its weights"
            )

    async def _run_batch(self, t: _Teacher) -> None:
        jobs: list[_Job] = []
        while t.queue and (
            not jobs
            or sum(len(j.sequences) for j in jobs) + len(t.queue[0].sequences)
            <= self.cfg.max_batch_sequences
        ):
            jobs.append(t.queue.popleft())
        sequences = [s for job in jobs for s in job.sequences]
        starts = [s for job in jobs for s in job.starts]
        started = time.monotonic()
        try:
            scores = await t.engine.score(sequences, starts)
        except Exception as e:
            for job in jobs:
                t.queue.appendleft(job)  # failed with the manager below
            raise _error(t, "failed to score", e) from e
        now = time.monotonic()
        check_not_uniform(t.name, [lp for row in scores for lp in row])
        t.stats.score_s += now - started
        t.stats.tokens += sum(len(row) for row in scores)
        for job in jobs:
            n = len(job.sequences)
            if not job.future.done():
                job.future.set_result(scores[:n])
            scores = scores[n:]
            t.stats.latency_s += now - job.queued_at
            t.stats.jobs += 1

    async def _fail(self, error: TeacherError) -> None:
        async with self._cond:
            if self._error is None:
                self._error = error
                log.error("%s", error)
            self._cond.notify_all()
        for t in self.teachers.values():
            while t.queue:
                job = t.queue.popleft()
                if not job.future.done():
                    job.future.set_exception(self._error)


def check_not_uniform(name: str, logprobs: list[float]) -> None:
    """TeacherError if `logprobs` (of different positions) look like a uniform distribution."""
    if len(logprobs) < UNIFORM_MIN_TOKENS:
        return
    low, high = min(logprobs), max(logprobs)
    if high - low < UNIFORM_SPREAD and high < -math.log(100):
        raise TeacherError(
            f"teacher {name!r} returns uniform logprobs ({high:.4f} = log(1/{math.exp(-high):.0f})"
            f" on all {len(logprobs)} tokens): its weights are broken"
        )


def teacher_bytes(name: str, cfg: TeacherConfig, model_path: Path | None) -> int:
    """`memory_bytes`, else the weights' bytes read from the model folder."""
    if cfg.memory_bytes:
        return parse_bytes(f"teachers.{name}.memory_bytes", cfg.memory_bytes)
    if model_path is None or not Path(model_path).is_dir():
        raise TeacherError(
            f"teacher {name!r}: set teachers.{name}.memory_bytes (its model folder is not "
            "readable here, so its size cannot be read from it)"
        )
    try:
        return weight_bytes(Path(model_path), cfg.engine.dtype)
    except (OSError, ValueError) as e:
        raise TeacherError(f"teacher {name!r}: cannot size its weights: {e}") from e


def _where(t: _Teacher) -> str:
    return str(t.path or t.cfg.model)


def _error(t: _Teacher, what: str, cause: BaseException) -> TeacherError:
    return TeacherError(f"teacher {t.name!r} {what}: {type(cause).__name__}: {cause}")
