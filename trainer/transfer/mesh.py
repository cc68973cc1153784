"""TransferMesh: the planner, the push, and what a push reports. See `trainer/transfer/__init__`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gateway.registry import Registry
from trainer.transfer.buckets import Bucket, make_buckets
from trainer.transfer.endpoints import Placement, Receiver, Sender

log = logging.getLogger("loongsage.transfer")

PARTIAL_ROLLOUT_MODES = ("continue", "abort_resubmit")


@dataclass
class TransferConfig:
    bucket_mb: float = 512
    """Bucket size in MiB: the unit that is packed, sent and received while the next is packed."""
    pipeline: bool = True
    """Pack bucket k+1 while bucket k is in flight (off: one after the other, for comparison)."""
    timeout_s: float = 300.0
    """A receiver that has not applied a version after this long keeps its old one (reported,
    retried at the next push)."""
    route: str = ""
    """Force one route for every engine (in_process, shm, broadcast, disk, cuda_ipc); empty:
    the planner picks the fastest route that reaches each engine."""
    disk_dir: str = ""
    """Folder of the disk route, readable by every receiver (and SGLang server) it serves; empty:
    the system temporary folder (same host only)."""
    broadcast_backend: str = ""
    """Collective of the broadcast route: nccl or gloo; empty: NCCL between GPUs, gloo
    otherwise. gloo also moves GPU tensors (through host memory): for a trainer and a server on
    one GPU, which NCCL refuses (two ranks on one device)."""

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"transfer.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"transfer.timeout_s must be > 0, got {self.timeout_s}")
        if self.route:
            ROUTES.check(self.route)
        if self.broadcast_backend not in ("", "nccl", "gloo"):
            raise ValueError(
                f"transfer.broadcast_backend must be nccl, gloo or empty, got "
                f"{self.broadcast_backend!r}"
            )

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclass
class Push:
    """One version on its way: what every route needs."""

    sender: Sender
    version: int
    buckets: list[Bucket]
    mode: str
    cfg: TransferConfig

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def reads(self) -> list[list[str]]:
        """What a sending half that packs every bucket asks `hf_tensors` for (`Sender.run`)."""
        return [b.names for b in self.buckets]


@dataclass
class Delivery:
    ok: bool
    stall_s: float = 0.0
    """How long the engine stopped generating for the switch (apply, or pause to resume)."""
    error: str = ""


class WeightRoute(Protocol):
    """One way weights travel to receivers. Built from the `TransferConfig`."""

    def reaches(self, sender: Placement, receiver: Placement) -> str:
        """Why this route carries weights from `sender` to `receiver`; '' if it cannot."""
        ...

    async def push(self, push: Push, receivers: list[Receiver]) -> dict[str, Delivery]:
        """Deliver `push.version` to `receivers` (all of a version or none each); returns each
        receiver's outcome by name. Never raises for a receiver's failure."""
        ...

    async def close(self) -> None:
        """Free what the route holds between pushes (segments, groups, folders)."""
        ...


ROUTES: Registry[WeightRoute] = Registry("transfer.route")
"""Weight routes, registered in the planner's order of preference (fastest first)."""
ROUTES.register("in_process", "trainer.transfer.in_process:InProcessRoute", order=0)
ROUTES.register("cuda_ipc", "trainer.transfer.cuda_ipc:CudaIpcRoute", order=1)
ROUTES.register("shm", "trainer.transfer.shm:ShmRoute", order=2)
ROUTES.register("broadcast", "trainer.transfer.broadcast:BroadcastRoute", order=3)
ROUTES.register("disk", "trainer.transfer.disk:DiskRoute", order=4)


async def apply_weights(
    engine: Any, tensors: Mapping[str, torch.Tensor], version: int, mode: str
) -> float:
    """Next to the engine: make it serve `tensors` as `version` (all or none, the engine's
    promise), handling requests in flight as `mode` says; returns the stall in seconds."""
    start = time.perf_counter()
    if mode == "abort_resubmit":
        await engine.pause("retract")
        try:
            await engine.update_weights(tensors, version)
        finally:
            await engine.resume()
    else:
        await engine.update_weights(tensors, version)
    return time.perf_counter() - start


async def guarded(work: Awaitable[float], timeout_s: float) -> Delivery:
    """A receiver's half of a route (returning its stall) as a Delivery: a failure or a timeout
    is an outcome, not an exception."""
    try:
        stall = await asyncio.wait_for(work, timeout_s)
    except TimeoutError:
        return Delivery(False, error=f"timed out after {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 - one receiver's failure is data for the report
        return Delivery(False, error=f"{type(exc).__name__}: {exc}")
    return Delivery(True, float(stall or 0.0))


# ------------------------------------------------------------------------------------ planner


@dataclass
class Plan:
    sender: Placement
    entries: list[tuple[Receiver, str, str]]
    """(receiver, route, why) per receiver."""

    def by_route(self) -> dict[str, list[Receiver]]:
        out: dict[str, list[Receiver]] = {}
        for receiver, route, _ in self.entries:
            out.setdefault(route, []).append(receiver)
        return dict(sorted(out.items(), key=lambda kv: ROUTES.attrs(kv[0])["order"]))

    def route_of(self, name: str) -> str:
        return next(route for r, route, _ in self.entries if r.name == name)

    def describe(self) -> str:
        lines = [f"TransferMesh: weights from {self.sender.short()} ({self.sender.host})"]
        for receiver, route, why in self.entries:
            lines.append(f"  {receiver.name:<10} {route:<10} {why}  [{receiver.placement.short()}]")
        return "\n".join(lines)


def make_plan(
    sender: Placement, receivers: Sequence[Receiver], routes: Mapping[str, WeightRoute], force: str
) -> Plan:
    """The first route, in order of preference, that each receiver accepts and that reaches it
    from `sender` (or `force` for all of them)."""
    entries = []
    order = sorted(routes, key=lambda name: ROUTES.attrs(name)["order"])
    for receiver in receivers:
        accepted = receiver.placement.transports
        candidates = [force] if force else [name for name in order if name in accepted]
        for name in candidates:
            why = routes[name].reaches(sender, receiver.placement) if name in accepted else ""
            if why:
                entries.append((receiver, name, why))
                break
        else:
            what = f"transfer.route={force}" if force else "no registered route"
            raise ValueError(
                f"{what} reaches {receiver.name} ({receiver.placement.short()}, accepts "
                f"{', '.join(accepted) or 'nothing'}) from the trainer ({sender.short()})"
            )
    return Plan(sender, entries)


# --------------------------------------------------------------------------------- the mesh


@dataclass
class RouteStats:
    route: str
    receivers: int
    delivered: int
    bytes: int
    """Bytes of one version (each delivered receiver got all of them)."""
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes * self.delivered / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class PushReport:
    version: int
    bytes: int
    """Bytes of one version of the weights."""
    seconds: float
    routes: list[RouteStats] = field(default_factory=list)
    stalls: dict[str, float] = field(default_factory=dict)
    """Engine name -> seconds it stopped generating to switch (delivered engines)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Engine name -> why it keeps its old version."""
    versions: dict[str, int] = field(default_factory=dict)
    """Engine name -> the version it serves after the push (its last acknowledged one)."""

    @property
    def receivers(self) -> int:
        return sum(r.receivers for r in self.routes)

    @property
    def delivered(self) -> int:
        return sum(r.delivered for r in self.routes)

    @property
    def gb_per_s(self) -> float:
        return self.bytes * self.delivered / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        out = {
            "weights/bytes": float(self.bytes),
            "weights/seconds": self.seconds,
            "weights/gb_per_s": self.gb_per_s,
            "weights/failed": float(len(self.failed)),
            "weights/stall_s_max": max(self.stalls.values(), default=0.0),
        }
        for r in self.routes:
            out |= {
                f"weights/{r.route}/bytes": float(r.bytes * r.delivered),
                f"weights/{r.route}/seconds": r.seconds,
                f"weights/{r.route}/gb_per_s": r.gb_per_s,
            }
        out |= {f"weights/stall_s/{name}": s for name, s in self.stalls.items()}
        out |= {f"weights/version/{name}": float(v) for name, v in self.versions.items()}
        return out


class TransferMesh:
    """Pushes each new version from `source` (a train backend, in this process or a Ray actor,
    a `WeightSource`, or a state dict) to `engines`, each over its planned route."""

    def __init__(
        self,
        source: Any,
        engines: Sequence[Any],
        cfg: TransferConfig | None = None,
        mode: str = "continue",
    ) -> None:
        if mode not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(
                f"rollout.partial_rollout: {mode!r} is not one of 'continue', 'abort_resubmit'"
            )
        self.cfg = cfg or TransferConfig()
        self.mode = mode
        self.sender = Sender(source)
        self.receivers = [Receiver.of(e, f"engine{i}") for i, e in enumerate(engines)]
        wanted = {self.cfg.route} if self.cfg.route else set(ROUTES.kinds())
        accepted = {t for r in self.receivers for t in r.placement.transports}
        self.routes: dict[str, WeightRoute] = {
            name: ROUTES.build(name, self.cfg) for name in sorted(wanted & accepted)
        }
        self.plan = make_plan(self.sender.placement, self.receivers, self.routes, self.cfg.route)
        self._buckets: list[Bucket] | None = None

    def status(self) -> list[dict[str, Any]]:
        """Per engine: its route, the version it acknowledged, and its last error."""
        return [
            {
                "engine": r.name,
                "route": self.plan.route_of(r.name),
                "version": r.version,
                "error": r.error,
            }
            for r in self.receivers
        ]

    async def _layout(self) -> list[Bucket]:
        if self._buckets is None:
            specs = await self.sender.run(_specs)
            self._buckets = make_buckets(specs, self.cfg.bucket_bytes)
        return self._buckets

    async def push(self, version: int) -> PushReport:
        """Deliver the source's current weights as `version` to every engine; returns when each
        one serves it or has failed (and keeps its old version)."""
        start = time.perf_counter()
        push = Push(self.sender, version, await self._layout(), self.mode, self.cfg)
        report = PushReport(version, push.nbytes, 0.0)
        # A receiver that failed last time gets this version if it is healthy again; one that
        # is still down is skipped, so it cannot hold up (or break) a group it would join.
        down = {r.name for r in self.receivers if r.error and not await _healthy(r)}
        for name, receivers in self.plan.by_route().items():
            t0 = time.perf_counter()
            outcome = await self._push_route(name, push, receivers, down)
            seconds = time.perf_counter() - t0
            delivered = sum(d.ok for d in outcome.values())
            report.routes.append(RouteStats(name, len(receivers), delivered, push.nbytes, seconds))
            for r in receivers:
                d = outcome[r.name]
                if d.ok:
                    r.version, r.error = version, ""
                    report.stalls[r.name] = d.stall_s
                else:
                    r.error = report.failed[r.name] = d.error
                    log.warning("%s keeps weight version %d: %s", r.name, r.version, d.error)
                report.versions[r.name] = r.version
        report.seconds = time.perf_counter() - start
        return report

    async def _push_route(
        self, route: str, push: Push, receivers: list[Receiver], down: set[str]
    ) -> dict[str, Delivery]:
        """One route's receivers, those that are up, with one more try for those that failed
        and are healthy (e.g. a broadcast group broken by another receiver's death)."""
        out = {r.name: Delivery(False, error="down: its health check fails") for r in receivers}
        up = [r for r in receivers if r.name not in down]
        if up:
            out |= await self._deliver(route, push, up)
        retry = [r for r in up if not out[r.name].ok and await _healthy(r)]
        if retry:
            log.warning("retrying %s over %s", ", ".join(r.name for r in retry), route)
            out |= await self._deliver(route, push, retry)
        return out

    async def _deliver(
        self, route: str, push: Push, receivers: list[Receiver]
    ) -> dict[str, Delivery]:
        """The route's outcome per receiver; a route that fails as a whole (its sender died)
        fails each of them."""
        try:
            return await self.routes[route].push(push, receivers)
        except Exception as exc:  # noqa: BLE001 - reported per receiver, never raised
            failed = Delivery(False, error=f"{route} failed: {type(exc).__name__}: {exc}")
            return {r.name: failed for r in receivers}

    async def close(self) -> None:
        await asyncio.gather(*(route.close() for route in self.routes.values()))


def _specs(source: Any) -> list:
    return source.hf_specs()


async def _healthy(receiver: Receiver) -> bool:
    """Whether a receiver can take a version: alive (an SGLang server answers at all; its
    /health fails while it is paused, as one left paused after a failed update is)."""
    engine = receiver.engine
    try:
        if receiver.placement.api == "sglang":
            await asyncio.wait_for(engine.get_model_info(), 10)
            return True
        return bool(await asyncio.wait_for(engine.health(), 10))
    except Exception:  # noqa: BLE001 - a dead engine is simply not healthy
        return False
