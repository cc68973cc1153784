"""Where the trainer's ranks and the engines run on a Ray cluster: placement groups.

`ray.address=HOST:6379` joins a running cluster (`ray start --head` on one machine,
`ray start --address=HOST:6379` on the others; every node needs this package, its Python
environment and the model folder at the same path); without it a local Ray starts. What each
actor needs is in `RayConfig`: CPUs, GPUs and custom resources (`ray start --resources=...`
gives a node resources that only some actors ask for, which is how a recipe pins its trainer
to one node and its engines to another).

- **Trainer ranks.** A backend runs as `train.world_size` ranks (tensor x pipeline x data
  parallel; 1 for the torch backend). `placed_trainer` reserves one placement-group bundle per
  rank (`ray.trainer_strategy`: PACK fills a node before the next, so tensor-parallel peers,
  which are adjacent ranks, share one), starts a `BackendActor` (trainer/actors.py) in each
  with the torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK=0 since Ray gives each
  actor its own CUDA_VISIBLE_DEVICES, MASTER_ADDR/MASTER_PORT on rank 0's node), and waits until
  all are built (they meet in `init_process_group`, so they must start together). `RankGroup`
  is the TrainBackend over them.
- **Engines.** `placed_engine` puts each engine actor in a bundle of its own
  (`ray.engine_cpus`, `ray.engine_gpus`, `ray.engine_resources`).
- `node_of(handle)` asks an actor which Ray node it runs on (runs, not was planned on);
  `describe` is the run's placement, printed by `trainer.run` at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gateway.engines import EngineConfig
from trainer.actors import BackendActor, RayBackend, RayEngine, _cause, init_ray, spawn_engine
from trainer.config import RayConfig, TrainerConfig


def init(cfg: RayConfig) -> bool:
    """Join `cfg.address`, or start a local Ray of `cfg.num_cpus` CPUs (once per process);
    True when this call did (the caller shuts it down)."""
    return init_ray(cfg.address, cfg.num_cpus)


def _bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": cpus, **resources}
    if gpus:
        bundle["GPU"] = gpus
    return bundle


def _reserve(bundles: list[dict[str, float]], strategy: str, what: str) -> PlacementGroup:
    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        remove_placement_group(pg)
        raise ValueError(
            f"ray: the cluster cannot place {what} ({bundles}, strategy {strategy}) within "
            f"120 s; it has {ray.cluster_resources()}: lower ray.* resources or add nodes"
        )
    return pg


def _in(pg: PlacementGroup, bundle: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """Rank 0's node address and a port free there (for MASTER_ADDR / MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def node_of(handle: ray.actor.ActorHandle) -> str:
    """The Ray node id the actor runs on."""
    return ray.get(handle.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def describe(engines: Sequence[Any], backend: Any) -> str:
    """Where each actor of a run is (asked of the actors themselves): one line per actor, with
    its Ray node id and address. Engines and backends in this process are `(this process)`."""
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

    def where(handle: ray.actor.ActorHandle) -> str:
        node = node_of(handle)
        return f"node {node} ({address.get(node, '?')})"

    lines = ["placement:"]
    ranks = getattr(backend, "ranks", None)
    for i, rank in enumerate(ranks or []):
        lines.append(f"  trainer rank {i}: {where(rank)}")
    if ranks is None:
        lines.append("  trainer: (this process)")
    for i, engine in enumerate(engines):
        handle = getattr(engine, "handle", None)
        lines.append(f"  engine{i}: {where(handle) if handle is not None else '(this process)'}")
    return "\n".join(lines)


def _get_all(refs: Sequence[ray.ObjectRef]) -> list[Any]:
    """Every result, raising the first error as soon as any rank fails (the others would wait
    for it in a collective)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises a failed rank's error now
    return ray.get(list(refs))


class RankGroup(RayBackend):
    """The TrainBackend over several `BackendActor` ranks of one SPMD backend: every call goes
    to every rank; rank 0's answer is returned (the backend makes it the whole answer: merged
    metrics, gathered log-probs and weights). Ranks' errors are raised as themselves."""

    def __init__(self, ranks: Sequence[ray.actor.ActorHandle]) -> None:
        self.ranks = list(ranks)
        steps = _get_all([r.step.remote() for r in self.ranks])
        super().__init__(self.ranks[0], steps[0])

    def _call(self, method: str, *args: Any) -> Any:
        """`method(*args)` on every rank; rank 0's result. Arguments travel once."""
        args = tuple(ray.put(a) for a in args)
        return _get_all([getattr(r, method).remote(*args) for r in self.ranks])[0]

    def train_step(self, samples: list) -> dict[str, float]:
        metrics, self._step = self._call("train_step", samples)
        return metrics

    def logprobs(self, samples: list) -> list[list[float]]:
        return self._call("logprobs", samples)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank takes part in gathering the weights; rank 0's, copied here."""
        return self._call("state_dict")

    async def run(
        self, fn: Callable[..., Any], *args: Any, reads: Sequence[Sequence[str]] | None = None
    ) -> Any:
        """`fn(weight_source, *args)` on rank 0 (a TransferMesh route's sending half); the other
        ranks make the `hf_tensors` calls `reads` announces alongside, since gathering a
        sharded parameter is collective (see `BackendActor.run`)."""
        if reads is None or len(self.ranks) == 1:
            return await super().run(fn, *args, reads=reads)
        refs = [r.run.remote(fn, *args, reads=reads, lead=i == 0) for i, r in enumerate(self.ranks)]
        try:
            return (await asyncio.gather(*refs))[0]
        except RayTaskError as exc:
            raise _cause(exc) from None

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self._call("save_checkpoint", Path(path), extra)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        extra, self._step = self._call("load_checkpoint", Path(path))
        return extra

    def save_hf(self, path: Path) -> None:
        self._call("save_hf", Path(path))

    def close(self) -> None:
        for r in self.ranks:
            ray.kill(r)


@contextlib.contextmanager
def placed_trainer(cfg: TrainerConfig) -> Iterator[RayBackend]:
    """The backend's ranks, started in a placement group and built (errors building it, such as
    a model the backend cannot split, are raised here); stopped and unplaced on exit."""
    world = cfg.train.world_size
    bundle = _bundle(cfg.ray.trainer_cpus, cfg.ray.trainer_gpus, cfg.ray.trainer_resources)
    pg = _reserve([bundle] * world, cfg.ray.trainer_strategy, f"{world} trainer rank(s)")
    ranks: list[ray.actor.ActorHandle] = []
    try:
        address, port = ray.get(_rendezvous.options(scheduling_strategy=_in(pg, 0)).remote())
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
            env |= {"MASTER_ADDR": address, "MASTER_PORT": str(port)}
            options = {
                "num_cpus": cfg.ray.trainer_cpus,
                "num_gpus": cfg.ray.trainer_gpus,
                "resources": dict(cfg.ray.trainer_resources),
                "scheduling_strategy": _in(pg, rank),
                "runtime_env": {"env_vars": env},
            }
            ranks.append(BackendActor.options(**options).remote(cfg))
        yield RankGroup(ranks)
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(pg)


@contextlib.asynccontextmanager
async def placed_engine(
    cfg: TrainerConfig, engine: EngineConfig, model_path: str | Path
) -> AsyncIterator[RayEngine]:
    """One engine (`engine`: one of `cfg.engine`'s replicas) as a Ray actor in a
    placement-group bundle of its own; closed on exit."""
    ray_cfg = cfg.ray
    bundle = _bundle(ray_cfg.engine_cpus, ray_cfg.engine_gpus, ray_cfg.engine_resources)
    pg = _reserve([bundle], "PACK", "the engine")
    try:
        actor = spawn_engine(
            engine,
            model_path,
            num_cpus=ray_cfg.engine_cpus,
            options={
                "num_gpus": ray_cfg.engine_gpus,
                "resources": dict(ray_cfg.engine_resources),
                "scheduling_strategy": _in(pg, 0),
            },
        )
        try:
            yield actor
        finally:
            await actor.close()
    finally:
        remove_placement_group(pg)
