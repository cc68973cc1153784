"""Ray actors for the engines and the train backend, with clients that keep their protocols.

The controller stays one process; engines and the train backend live in Ray actors so that the
same code runs on this machine (`init_ray()`: local Ray, dashboard off, 2 CPUs) and on a
cluster (`init_ray(address=...)`). Callers never see Ray:

- `RayEngine` implements the `Engine` protocol by calling an `EngineActor`, which hosts any
  engine `make_engine` builds. `stream` is a Ray streaming generator, so chunks arrive as the
  engine produces them. A ValueError raised in the actor (bad input) is re-raised as that same
  ValueError; a dead actor or any other failure is an `EngineError`. The hot-path properties
  are client-side: `max_context` is read once at spawn, `weight_version` is refreshed from every
  chunk and every reply, and `load` counts this client's requests in flight (a second client of
  the same actor is not counted).
- `RayBackend` implements the `TrainBackend` protocol (sync methods: the controller calls them
  from a thread) by calling a `BackendActor`.
- Both are TransferMesh endpoints (trainer/transfer): each knows its `placement` (Ray node,
  process, device) and `run(fn, *args)` runs a route's half in its actor, next to the engine
  (`fn(engine, *args)`) or next to the weights (`fn(weight_source, *args)`), so weights go from
  the backend actor to the engine actors without passing through the controller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from gateway.engines import EngineConfig, make_engine
from gateway.engines.base import Chunk, EngineError, Generation, PauseMode, SamplingParams
from gateway.engines.placement import Placement
from gateway.machine import CoreBoard
from trainer.transfer.endpoints import ScriptedReads, follow_reads, source_device, weight_source

log = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Start (or join) Ray once per process; later calls do nothing. True when this call
    started (or joined) it: the caller then owns it and shuts it down (`ray.shutdown()`).

    `address=None` starts a local Ray with `num_cpus` CPUs (default 2), no dashboard, no usage
    stats and warnings-only logs; otherwise joins the cluster at `address` (e.g. `"auto"` or
    `"head:6379"`), where `num_cpus` is ignored (the cluster owns its resources) and every node
    needs this package installed, since actors import `gateway` and `trainer`."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        ray.init(
            num_cpus=2 if num_cpus is None else num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    return True


def _cause(exc: RayTaskError) -> BaseException:
    """The exception the remote code raised (Ray's wrapper adds a traceback to the message)."""
    return exc.cause if isinstance(exc.cause, Exception) else exc


def _unwrap(get: Any, ref: ray.ObjectRef) -> Any:
    try:
        return get(ref)
    except RayTaskError as exc:
        raise _cause(exc) from None


# ---------------------------------------------------------------------------------- engines


@ray.remote
class EngineActor:
    """Hosts one engine (`make_engine(cfg, model_path)`) in its own process.

    Replies carry the engine's weight version so clients keep a fresh copy for free."""

    def __init__(self, cfg: EngineConfig, model_path: str) -> None:
        # A constructor error would only reach callers as an opaque ActorDiedError: keep it
        # and raise it from `info` (what spawn_engine calls first) as itself.
        self.error: Exception | None = None
        try:
            self.engine = make_engine(cfg, model_path)
        except Exception as exc:  # noqa: BLE001 - re-raised by info()
            self.error = exc

    async def info(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {
            "max_context": self.engine.max_context,
            "weight_version": self._version(),
            "placement": Placement.here(),
        }

    def _version(self) -> int:
        return self.engine.weight_version

    async def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str,
        session_id: str | None,
    ) -> AsyncIterator[Chunk]:
        async for chunk in self.engine.stream(input_ids, params, request_id, session_id):
            yield chunk

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        session_id: str | None,
    ) -> tuple[Generation, int]:
        out = await self.engine.generate(input_ids, params, request_id, session_id)
        return out, self._version()

    async def abort(self, request_id: str) -> int:
        await self.engine.abort(request_id)
        return self._version()

    async def score(
        self, sequences: list[list[int]], start: list[int]
    ) -> tuple[list[list[float]], int]:
        return await self.engine.score(sequences, start), self._version()

    async def pause(self, mode: PauseMode) -> int:
        await self.engine.pause(mode)
        return self._version()

    async def resume(self) -> int:
        await self.engine.resume()
        return self._version()

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        await self.engine.update_weights(state, version)
        return self._version()

    async def run(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
        """`await fn(engine, *args)` here (a TransferMesh route's receiving half)."""
        return await fn(self.engine, *args), self._version()

    async def health(self) -> tuple[bool, int]:
        return await self.engine.health(), self._version()

    async def share_cores(self, path: str, slot: int, borrow: bool) -> None:
        """The local engine shares cores at `slot` of the CoreBoard at `path`."""
        self.engine.share_cores(CoreBoard(path, slot), borrow)

    async def close(self) -> None:
        await self.engine.close()


def _raise_from(exc: Exception, what: str) -> None:
    """Ray's wrapper -> the error the Engine protocol promises."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, ValueError | EngineError):
            raise cause from None
        raise EngineError(f"{what} failed in the engine actor: {cause!r}") from None
    if isinstance(exc, RayActorError):
        raise EngineError(f"{what}: the engine actor is gone ({exc})") from None
    raise exc


class RayEngine:
    """The Engine protocol over an `EngineActor` handle; see the module docstring."""

    def __init__(self, handle: ray.actor.ActorHandle, info: Mapping[str, Any] | None = None):
        self.handle = handle
        if info is None:
            try:
                info = ray.get(handle.info.remote())
            except (RayTaskError, RayActorError) as exc:
                _raise_from(exc, "info")
        self._max_context = int(info["max_context"])
        self._version = int(info["weight_version"])
        self.placement: Placement = info["placement"]
        """Where the engine runs (a TransferMesh receiver)."""
        self._in_flight = 0

    def __repr__(self) -> str:
        return f"RayEngine({self.handle})"

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def load(self) -> int:
        return self._in_flight

    async def _call(self, what: str, ref: ray.ObjectRef) -> Any:
        try:
            return await ref
        except (RayTaskError, RayActorError) as exc:
            _raise_from(exc, what)

    def _seen(self, version: int) -> None:
        # Versions only move forward; replies can arrive out of order.
        self._version = max(self._version, version)

    def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Checks what it can here; the engine's own checks raise at the first chunk."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                "params must be a SamplingParams (use SamplingParams.from_dict for a dict)"
            )
        # Our own id, so that a caller who stops reading can abort the request in the actor.
        rid = f"ray-{uuid.uuid4().hex}" if request_id is None else request_id
        return self._stream(input_ids, params, rid, session_id)

    async def _stream(
        self, input_ids: list[int], params: SamplingParams, rid: str, session_id: str | None
    ) -> AsyncIterator[Chunk]:
        self._in_flight += 1
        finished = refused = False
        try:
            gen = self.handle.stream.options(num_returns="streaming").remote(
                input_ids, params, rid, session_id
            )
            try:
                async for ref in gen:
                    chunk = await ref
                    if chunk.versions:
                        self._seen(chunk.versions[-1])
                    finished = chunk.finish_reason is not None
                    yield chunk
            except (RayTaskError, RayActorError) as exc:
                refused = isinstance(exc, RayTaskError) and isinstance(exc.cause, ValueError)
                finished = True
                _raise_from(exc, "stream")
        finally:
            self._in_flight -= 1
            if not finished and not refused:
                # The caller stopped reading (cancelled, broke out): free the engine's slot.
                try:
                    await asyncio.shield(self.handle.abort.remote(rid))
                except Exception as exc:  # noqa: BLE001 - best effort on the way out
                    log.debug("abort of %s after an early exit failed: %r", rid, exc)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        if not isinstance(params, SamplingParams):
            raise ValueError(
                "params must be a SamplingParams (use SamplingParams.from_dict for a dict)"
            )
        self._in_flight += 1
        try:
            ref = self.handle.generate.remote(input_ids, params, request_id, session_id)
            out, version = await self._call("generate", ref)
        finally:
            self._in_flight -= 1
        self._seen(version)
        return out

    async def abort(self, request_id: str) -> None:
        self._seen(await self._call("abort", self.handle.abort.remote(request_id)))

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        out, version = await self._call("score", self.handle.score.remote(sequences, start))
        self._seen(version)
        return out

    async def pause(self, mode: PauseMode = "in_place") -> None:
        self._seen(await self._call("pause", self.handle.pause.remote(mode)))

    async def resume(self) -> None:
        self._seen(await self._call("resume", self.handle.resume.remote()))

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """The tensors travel through Ray to the actor (TransferMesh's routes are faster)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an integer, got {version!r}")
        ref = self.handle.update_weights.remote(dict(state), version)
        self._version = await self._call("update_weights", ref)  # exactly: may go back

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`await fn(engine, *args)` in the actor; the engine's version is taken exactly from
        the reply (a resumed run may push an older version)."""
        result, self._version = await self._call("run", self.handle.run.remote(fn, *args))
        return result

    async def health(self) -> bool:
        try:
            ok, version = await self.handle.health.remote()
        except (RayTaskError, RayActorError):
            return False
        self._seen(version)
        return ok

    async def share_cores(self, path: str, slot: int, borrow: bool = False) -> None:
        """The engine shares cores on a CoreBoard (`LocalEngine.share_cores`)."""
        await self.handle.share_cores.remote(path, slot, borrow)

    async def close(self) -> None:
        """Close the engine and end its actor process."""
        try:
            await self.handle.close.remote()
        except (RayTaskError, RayActorError):
            pass
        ray.kill(self.handle)

    async def __aenter__(self) -> RayEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def spawn_engine(
    cfg: EngineConfig,
    model_path: str | Path,
    *,
    num_cpus: float = 1,
    name: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> RayEngine:
    """Start an `EngineActor` (Ray must be initialized: `init_ray`) and wait until it serves.

    `num_cpus` is the Ray resource it holds (and its torch threads); `name` makes the actor
    findable with `ray.get_actor(name)`; `options` are further Ray actor options (GPUs,
    resources, a placement group: trainer/cluster.py). Errors building the engine (bad config
    or model) are raised here as ValueError / EngineError."""
    options = {"num_cpus": num_cpus, **(options or {})}
    if name is not None:
        options["name"] = name
    handle = EngineActor.options(**options).remote(cfg, str(model_path))
    try:
        info = ray.get(handle.info.remote())
    except (RayTaskError, RayActorError) as exc:
        ray.kill(handle)
        _raise_from(exc, "spawn_engine")
    return RayEngine(handle, info)


# ---------------------------------------------------------------------------- train backend


@ray.remote
class BackendActor:
    """Hosts one train backend (`make_backend(cfg)`) in its own process."""

    def __init__(self, cfg: Any) -> None:
        from trainer.backends import make_backend

        self.error: Exception | None = None  # raised by step(), as in EngineActor
        try:
            self.backend = make_backend(cfg)
        except Exception as exc:  # noqa: BLE001 - re-raised by step()
            self.error = exc

    def step(self) -> int:
        if self.error is not None:
            raise self.error
        return self.backend.step

    def train_step(self, samples: list) -> tuple[dict[str, float], int]:
        return self.backend.train_step(samples), self.backend.step

    def logprobs(self, samples: list) -> list[list[float]]:
        return self.backend.logprobs(samples)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.backend.state_dict()

    def placement(self) -> Placement:
        return Placement.here(source_device(weight_source(self.backend)), ())

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        reads: Sequence[Sequence[str]] | None = None,
        lead: bool = True,
    ) -> Any:
        """`fn(weight_source, *args)` here (a TransferMesh route's sending half).

        `reads`: the names `fn` asks `hf_tensors` for, call by call, when the backend's ranks
        gather together (trainer/cluster.py's RankGroup). The lead rank runs `fn` and makes
        exactly those calls even if `fn` fails half way; the others (`lead=False`) only make
        the calls, so no rank waits in a collective that another skipped."""
        source = weight_source(self.backend)
        if reads is None:
            return fn(source, *args)
        if not lead:
            return follow_reads(source, reads)
        scripted = ScriptedReads(source, reads)
        try:
            return fn(scripted, *args)
        finally:
            scripted.finish()

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self.backend.save_checkpoint(path, extra)

    def load_checkpoint(self, path: Path) -> tuple[dict[str, Any], int]:
        return self.backend.load_checkpoint(path), self.backend.step

    def save_hf(self, path: Path) -> None:
        self.backend.save_hf(path)

    def share_cores(self, path: str) -> None:
        """The backend shares cores at slot 0 of the CoreBoard at `path`."""
        self.backend.share_cores(CoreBoard(path, 0))


class RayBackend:
    """The TrainBackend protocol over a `BackendActor` handle. Blocking calls (the controller
    runs them in a thread); errors raised by the backend come back as themselves."""

    def __init__(self, handle: ray.actor.ActorHandle, step: int | None = None) -> None:
        self.handle = handle
        self._step = self._get(handle.step.remote()) if step is None else step
        self.placement: Placement = self._get(handle.placement.remote())
        """Where the weights are (the TransferMesh sender)."""

    def _get(self, ref: ray.ObjectRef) -> Any:
        return _unwrap(ray.get, ref)

    @property
    def step(self) -> int:
        return self._step

    def train_step(self, samples: list) -> dict[str, float]:
        metrics, self._step = self._get(self.handle.train_step.remote(samples))
        return metrics

    def logprobs(self, samples: list) -> list[list[float]]:
        return self._get(self.handle.logprobs.remote(samples))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights in this process (weight pushes use `run` instead)."""
        return self._get(self.handle.state_dict.remote())

    async def run(
        self, fn: Callable[..., Any], *args: Any, reads: Sequence[Sequence[str]] | None = None
    ) -> Any:
        """`fn(weight_source, *args)` in the backend actor (`reads`: see `BackendActor.run`)."""
        try:
            return await self.handle.run.remote(fn, *args, reads=reads)
        except RayTaskError as exc:
            raise _cause(exc) from None

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self._get(self.handle.save_checkpoint.remote(Path(path), extra))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        extra, self._step = self._get(self.handle.load_checkpoint.remote(Path(path)))
        return extra

    def save_hf(self, path: Path) -> None:
        self._get(self.handle.save_hf.remote(Path(path)))

    def share_cores(self, path: str) -> None:
        """The backend shares cores on a CoreBoard (`TorchBackend.share_cores`)."""
        self._get(self.handle.share_cores.remote(path))

    def close(self) -> None:
        ray.kill(self.handle)


def spawn_backend(cfg: Any, *, num_cpus: float = 1) -> RayBackend:
    """Start a `BackendActor` for `cfg` (a TrainerConfig) and wait until it is built; errors
    building the backend (bad config) are raised here as themselves."""
    handle = BackendActor.options(num_cpus=num_cpus).remote(cfg)
    try:
        return RayBackend(handle)
    except BaseException:
        ray.kill(handle)
        raise


__all__ = [
    "BackendActor",
    "EngineActor",
    "RayBackend",
    "RayEngine",
    "init_ray",
    "spawn_backend",
    "spawn_engine",
]
