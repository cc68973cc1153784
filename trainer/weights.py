"""Weight push: new trainer weights to every engine after each train step.

`WeightPush.push(state_dict, version)` is what the controller calls. How the bytes travel to an
engine is a *route* (`WeightRoute`, registered by name in `PUSH_ROUTES`); each engine is a
receiver that lists the routes it accepts, best first, in a `weight_routes` attribute (default
`("in_process",)`: every Engine has `update_weights`), and the push plans the first one that is
registered (`WeightPush.plan`). A route stages the weights once per push for all its receivers,
then applies them to each. Routes today:

- `in_process`: the tensors handed to the engine's `update_weights` (an engine in this process:
  the local engine copies them into its model; the SGLang router writes them for its servers);
- `ray_object_store` (trainer/actors.py): the weights put once into Ray's object store, from
  which each engine actor reads them.

TransferMesh's routes (shared memory, gloo/NCCL broadcast, HTTP/disk) are further modules, each
added with one `PUSH_ROUTES.register` line and listed by the receivers that accept them.

What happens to requests in flight is `rollout.partial_rollout`, the same on every route:
- `continue`: the engine swaps weights between two decoding steps; requests go on with the new
  weights and their later tokens carry the new version (partial rollouts);
- `abort_resubmit`: the engine is paused with `retract` (running requests go back to its queue
  with prompt + partial output), updated, and resumed, so they are recomputed on the new weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gateway.engines.base import Engine
from gateway.registry import Registry

PARTIAL_ROLLOUT_MODES = ("continue", "abort_resubmit")


@dataclass
class PushReport:
    version: int
    bytes: int
    """Bytes of weights delivered to each receiver."""
    seconds: float
    receivers: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes * self.receivers / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "weights/bytes": float(self.bytes),
            "weights/seconds": self.seconds,
            "weights/gb_per_s": self.gb_per_s,
        }


class Staged(Protocol):
    """Weights a route has staged for its receivers."""

    created: float
    """When the weights were asked for or staged (`time.perf_counter`; push timings start here)."""

    async def ready(self) -> int:
        """Wait until the weights are staged; their bytes (shared storage counted once)."""
        ...


class WeightRoute(Protocol):
    """One way weights travel from the trainer to receivers. Built with no arguments."""

    async def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged:
        """Prepare `state_dict` once per push, for every receiver on this route."""
        ...

    async def apply(self, engine: Any, staged: Any, version: int) -> None:
        """Make one receiver serve the staged weights as `version`: all of them or none."""
        ...


PUSH_ROUTES: Registry[WeightRoute] = Registry("weight route")
PUSH_ROUTES.register("in_process", "trainer.weights:InProcessRoute")
PUSH_ROUTES.register("ray_object_store", "trainer.actors:RayObjectStoreRoute")


def state_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    # Tied weights appear under two names but are one tensor: count storage once.
    seen: set[int] = set()
    total = 0
    for t in state_dict.values():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@dataclass
class LocalState:
    """Tensors in this process, staged as they are (receivers copy them)."""

    tensors: Mapping[str, torch.Tensor]
    created: float = field(default_factory=time.perf_counter)

    async def ready(self) -> int:
        return state_bytes(self.tensors)


class InProcessRoute:
    """Hands the tensors to the engine's own `update_weights`."""

    async def stage(self, state_dict: Mapping[str, torch.Tensor]) -> LocalState:
        return LocalState(state_dict)

    async def apply(self, engine: Engine, staged: LocalState, version: int) -> None:
        await engine.update_weights(staged.tensors, version)


class WeightPush:
    """Pushes each new version to `engines`, each over its planned route (or over `route` for
    all of them), handling requests in flight as `mode` (`rollout.partial_rollout`) says."""

    def __init__(
        self, engines: Sequence[Engine], mode: str = "continue", route: str | None = None
    ) -> None:
        if mode not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(
                f"rollout.partial_rollout: {mode!r} is not one of 'continue', 'abort_resubmit'"
            )
        self.mode = mode
        self.plan: list[tuple[Engine, str]] = [(e, route or self._route_for(e)) for e in engines]
        """(receiver, route name) for every engine."""
        self.routes = {name: PUSH_ROUTES.build(name) for name in {r for _, r in self.plan}}

    @staticmethod
    def _route_for(engine: Engine) -> str:
        accepted = getattr(engine, "weight_routes", ("in_process",))
        for name in accepted:
            if name in PUSH_ROUTES.kinds():
                return name
        raise ValueError(f"no registered weight route reaches {engine!r} (it accepts {accepted})")

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Deliver `state_dict` as weight version `version` to every receiver; all or nothing
        per receiver; returns when every receiver serves the new version."""
        staged = {name: await route.stage(state_dict) for name, route in self.routes.items()}
        sizes, *_ = await asyncio.gather(
            asyncio.gather(*(s.ready() for s in staged.values())),
            *(self._one(engine, name, staged[name], version) for engine, name in self.plan),
        )
        start = min((s.created for s in staged.values()), default=time.perf_counter())
        return PushReport(
            version=version,
            bytes=max(sizes, default=0),
            seconds=time.perf_counter() - start,
            receivers=len(self.plan),
        )

    async def _one(self, engine: Engine, route: str, staged: Staged, version: int) -> None:
        apply = self.routes[route].apply
        if self.mode == "continue":
            await apply(engine, staged, version)
            return
        await engine.pause("retract")
        try:
            await apply(engine, staged, version)
        finally:
            await engine.resume()


class InProcessPush(WeightPush):
    """Every engine over the `in_process` route (engines living in this process)."""

    def __init__(self, engines: Sequence[Engine], mode: str = "continue") -> None:
        super().__init__(engines, mode, route="in_process")
