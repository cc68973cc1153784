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
  from a thread) by calling a `BackendActor`. Its `state_dict()` does not copy the weights into
  the controller: it returns a `RemoteState`, a Mapping that holds a reference to the weights
  the backend actor wrote once into Ray's object store (and only pulls them if someone indexes
  it).
- `RayObjectStoreRoute` is the `ray_object_store` weight route (trainer/weights.py), the one a
  `RayEngine` accepts first: given a `RemoteState` it hands the object reference to every engine
  actor, which read the weights straight from the object store (shared memory on one node;
  Ray's object transfer across nodes); given plain tensors it puts them into the store once
  first. The controller's `push.push(backend.state_dict(), version)` is therefore the same line
  for in-process and Ray engines.

Weights travel as numpy arrays (bf16 as int16 bit patterns), which Ray stores out-of-band and
receivers map without a copy: the state dict is serialized once per push, not once per engine,
and tied weights (embeddings / lm_head) travel once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from gateway.engines import EngineConfig, make_engine
from gateway.engines.base import Chunk, EngineError, Generation, PauseMode, SamplingParams
from trainer.weights import WeightPush

log = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join) Ray once per process; later calls do nothing.

    `address=None` starts a local Ray with `num_cpus` CPUs (default 2), no dashboard, no usage
    stats and warnings-only logs; otherwise joins the cluster at `address` (e.g. `"auto"` or
    `"head:6379"`), where `num_cpus` is ignored (the cluster owns its resources) and every node
    needs this package installed, since actors import `gateway` and `trainer`."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        ray.init(
            num_cpus=2 if num_cpus is None else num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=address, logging_level=logging.WARNING)


# ---------------------------------------------------------------------- weights in the store


def pack_state(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Tensors -> numpy arrays Ray stores zero-copy; aliases (tied weights) travel once."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    nbytes = 0
    for name, tensor in state.items():
        t = tensor.detach().cpu()
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        t = t.contiguous()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bit pattern
            t = t.view(torch.int16)
        arrays[name] = t.numpy()
        nbytes += t.numel() * t.element_size()
    return {"arrays": arrays, "dtypes": dtypes, "aliases": aliases, "nbytes": nbytes}


def unpack_state(packed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of `pack_state`: tensors viewing the (read-only) arrays, no copy."""
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # Arrays from the object store are read-only; receivers only ever copy from them.
        warnings.simplefilter("ignore", UserWarning)
        for name, array in packed["arrays"].items():
            t = torch.from_numpy(array)
            dtype = getattr(torch, packed["dtypes"][name])
            out[name] = t.view(dtype) if dtype != t.dtype else t
    for name, source in packed["aliases"].items():
        out[name] = out[source]
    return out


def _cause(exc: RayTaskError) -> BaseException:
    """The exception the remote code raised (Ray's wrapper adds a traceback to the message)."""
    return exc.cause if isinstance(exc.cause, Exception) else exc


def _unwrap(get: Any, ref: ray.ObjectRef) -> Any:
    try:
        return get(ref)
    except RayTaskError as exc:
        raise _cause(exc) from None


class RemoteState(Mapping[str, torch.Tensor]):
    """A state dict living in Ray's object store (written by `pack_state`).

    Weight pushes pass `ref` to engine actors without touching the data; indexing or iterating
    pulls it into this process once (the fallback for receivers that are not Ray actors)."""

    def __init__(
        self, ref: ray.ObjectRef, nbytes: int | ray.ObjectRef, created: float | None = None
    ) -> None:
        self.ref = ref
        self._nbytes = nbytes  # an ObjectRef while the producer is still writing the weights
        self.created = time.perf_counter() if created is None else created
        """When the producer was asked for it (push timings start here)."""
        self._local: dict[str, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of weights (tied weights once); blocks until the producer has written them."""
        if isinstance(self._nbytes, ray.ObjectRef):
            self._nbytes = _unwrap(ray.get, self._nbytes)
        return self._nbytes

    async def ready(self) -> int:
        """Wait, without pulling the weights here, until they are in the store; the bytes."""
        if isinstance(self._nbytes, ray.ObjectRef):
            try:
                self._nbytes = await self._nbytes
            except RayTaskError as exc:
                raise _cause(exc) from None
        return self._nbytes

    @classmethod
    def put(cls, state: Mapping[str, torch.Tensor]) -> RemoteState:
        """Copy local tensors into the object store once."""
        start = time.perf_counter()
        packed = pack_state(state)
        return cls(ray.put(packed), packed["nbytes"], start)

    def _pull(self) -> dict[str, torch.Tensor]:
        if self._local is None:
            self._local = unpack_state(_unwrap(ray.get, self.ref))
        return self._local

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._pull()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pull())

    def __len__(self) -> int:
        return len(self._pull())


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

    async def info(self) -> dict[str, int]:
        if self.error is not None:
            raise self.error
        return {"max_context": self.engine.max_context, "weight_version": self._version()}

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

    async def update_weights(self, packed: dict[str, Any], version: int) -> float:
        """`packed` arrives resolved from the object store (a top-level ObjectRef argument)."""
        start = time.perf_counter()
        await self.engine.update_weights(unpack_state(packed), version)
        return time.perf_counter() - start

    async def health(self) -> tuple[bool, int]:
        return await self.engine.health(), self._version()

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

    weight_routes = ("ray_object_store", "in_process")
    """Weight routes this receiver accepts, best first (trainer/weights.py)."""

    def __init__(self, handle: ray.actor.ActorHandle, info: Mapping[str, int] | None = None):
        self.handle = handle
        if info is None:
            try:
                info = ray.get(handle.info.remote())
            except (RayTaskError, RayActorError) as exc:
                _raise_from(exc, "info")
        self._max_context = int(info["max_context"])
        self._version = int(info["weight_version"])
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
        """Plain tensors are put into the object store once; a `RemoteState` is passed on as
        its reference, so the weights never go through this process."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an integer, got {version!r}")
        if not isinstance(state, RemoteState):
            state = await asyncio.to_thread(RemoteState.put, state)  # a memcpy: off the loop
        await self.update_from(state, version)

    async def update_from(self, state: RemoteState, version: int) -> float:
        """Apply weights already in the object store; returns the actor's apply seconds."""
        seconds = await self._call(
            "update_weights", self.handle.update_weights.remote(state.ref, version)
        )
        self._version = version  # exactly: a resumed run may push an older version
        return seconds

    async def health(self) -> bool:
        try:
            ok, version = await self.handle.health.remote()
        except (RayTaskError, RayActorError):
            return False
        self._seen(version)
        return ok

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

    @ray.method(num_returns=2)
    def state_dict(self) -> tuple[dict[str, Any], int]:
        """The packed weights (stored once by Ray as this task's return) and their byte count."""
        packed = pack_state(self.backend.state_dict())
        return packed, packed["nbytes"]

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self.backend.save_checkpoint(path, extra)

    def load_checkpoint(self, path: Path) -> tuple[dict[str, Any], int]:
        return self.backend.load_checkpoint(path), self.backend.step

    def save_hf(self, path: Path) -> None:
        self.backend.save_hf(path)


class RayBackend:
    """The TrainBackend protocol over a `BackendActor` handle. Blocking calls (the controller
    runs them in a thread); errors raised by the backend come back as themselves."""

    def __init__(self, handle: ray.actor.ActorHandle, step: int | None = None) -> None:
        self.handle = handle
        self._step = self._get(handle.step.remote()) if step is None else step

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

    def state_dict(self) -> RemoteState:  # type: ignore[override]
        """The weights as a `RemoteState` (in the object store, not in this process). Returns
        at once (safe on an event loop); the backend actor writes them in the background and
        calls made after this one see them taken before the next train step."""
        packed_ref, nbytes_ref = self.handle.state_dict.remote()
        return RemoteState(packed_ref, nbytes_ref)

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self._get(self.handle.save_checkpoint.remote(Path(path), extra))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        extra, self._step = self._get(self.handle.load_checkpoint.remote(Path(path)))
        return extra

    def save_hf(self, path: Path) -> None:
        self._get(self.handle.save_hf.remote(Path(path)))

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


# ------------------------------------------------------------------------------ weight push


class RayObjectStoreRoute:
    """The `ray_object_store` weight route (see the module docstring)."""

    async def stage(self, state_dict: Mapping[str, torch.Tensor]) -> RemoteState:
        """Timing starts when the weights were asked for (RayBackend.state_dict) or put."""
        if isinstance(state_dict, RemoteState):
            return state_dict
        return await asyncio.to_thread(RemoteState.put, state_dict)

    async def apply(self, engine: RayEngine, staged: RemoteState, version: int) -> None:
        await engine.update_from(staged, version)


class RayObjectStorePush(WeightPush):
    """Every engine over the `ray_object_store` route; they must all be `RayEngine`s."""

    def __init__(self, engines: Sequence[RayEngine], mode: str = "continue") -> None:
        for engine in engines:
            if not isinstance(engine, RayEngine):
                raise ValueError(
                    f"RayObjectStorePush needs RayEngines (spawn_engine), got {type(engine)}; "
                    "use InProcessPush for engines in this process"
                )
        super().__init__(engines, mode, route="ray_object_store")


__all__ = [
    "BackendActor",
    "EngineActor",
    "RayBackend",
    "RayEngine",
    "RayObjectStorePush",
    "RayObjectStoreRoute",
    "RemoteState",
    "init_ray",
    "pack_state",
    "spawn_backend",
    "spawn_engine",
    "unpack_state",
]
