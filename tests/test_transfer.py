"""TransferMesh with real processes (local Ray, engine actors, gloo, /dev/shm, safetensors):
every route moves the weights bit-exactly and flips the version atomically while the engine
generates; a receiver (or the sender) killed mid-push never leaves anyone with mixed weights;
the planner's choices; a lagging engine's tokens count as stale by their real version; an SGLang
server (the fake) through the mesh."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time

import pytest
import ray
import torch
from fake_sglang import serve_fake

from gateway.engines import EngineConfig
from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from gateway.engines.placement import Placement
from gateway.engines.router import Router
from gateway.engines.sglang import SGLangEngine
from gateway.trajectory import Trajectory, Turn
from trainer.actors import init_ray, spawn_engine
from trainer.buffer import GroupBatcher, token_staleness
from trainer.transfer import ROUTES, Receiver, StateDictSource, TransferConfig, TransferMesh
from trainer.transfer.buckets import views
from trainer.transfer.mesh import make_plan

PROMPT = [1, 15, 27, 300, 301]
LONG = SamplingParams(max_tokens=2000, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def ray_local():
    init_ray(num_cpus=8)  # logical CPUs: room for the actors of this module
    # Actors run this module's helpers (weights_of, SlowSender): ship them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def actors(ray_local, tiny_model_path):
    """Engine actors shared by this module's tests (versions only ever go up)."""
    engines = [spawn_engine(EngineConfig(), tiny_model_path, num_cpus=1) for _ in range(2)]
    yield engines
    for engine in engines:
        asyncio.run(engine.close())


@pytest.fixture(scope="module")
def base(tiny_model_path) -> dict[str, torch.Tensor]:
    """The tiny model's weights as the HF folder names them (the tied head once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    return StateDictSource(model.state_dict()).tensors


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}


async def weights_of(engine) -> dict[str, torch.Tensor]:
    """Next to the engine: its weights, by HF name."""
    return {k: v.detach().clone() for k, v in engine.weights().items()}


async def remote_weights(engine) -> dict[str, torch.Tensor]:
    run = getattr(engine, "run", None)
    return await (run(weights_of) if run else weights_of(engine))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs"


async def generate_across_push(engine, mesh: TransferMesh, version: int) -> list[int]:
    """The versions of a generation that runs while `version` is pushed."""
    stream = engine.stream(PROMPT, LONG)
    versions = list((await anext(stream)).versions)
    report = await mesh.push(version)
    assert report.delivered == 1, report.failed
    async for chunk in stream:
        versions += chunk.versions
        if versions[-1] == version and versions.count(version) >= 5:
            break
    await stream.aclose()
    return versions


@pytest.mark.parametrize("route", ["in_process", "shm", "broadcast", "disk"])
async def test_each_route_moves_the_weights_bit_exactly_while_generating(
    actors, base, tiny_model_path, route
):
    engine = LocalEngine(tiny_model_path) if route == "in_process" else actors[0]
    old = engine.weight_version
    new = perturbed(base, seed=old + 1)
    mesh = TransferMesh(new, [engine], TransferConfig(route=route, bucket_mb=1, timeout_s=60))
    try:
        assert [r for _, r, _ in mesh.plan.entries] == [route]
        versions = await generate_across_push(engine, mesh, old + 1)
        # The flip is atomic: every token before it carries the old version, every one after
        # it the new one.
        switch = versions.index(old + 1)
        assert switch >= 1 and versions == [old] * switch + [old + 1] * (len(versions) - switch)
        assert_same(await remote_weights(engine), new)
        assert engine.weight_version == old + 1 and mesh.status()[0]["version"] == old + 1
    finally:
        await mesh.close()
        if route == "in_process":
            await engine.close()


async def test_a_lora_trainers_merged_weights_arrive_over_shm(actors, tiny_model_path):
    """LoRA: the push reads W + s B A tensor by tensor, a source the shm route cannot move into
    its segment, so each push merges and copies anew."""
    from trainer.backends.torch_backend import TorchBackend
    from trainer.config import AlgorithmConfig, TrainBackendConfig

    cfg = TrainBackendConfig(device="cpu", dtype="fp32", lora_rank=4)
    backend = TorchBackend(tiny_model_path, cfg, AlgorithmConfig())
    engine = actors[1]
    mesh = TransferMesh(backend, [engine], TransferConfig(route="shm", bucket_mb=1))
    try:
        for scale in (0.05, 0.1):  # the adapters move between pushes: merged anew each time
            with torch.no_grad():
                for b in backend.lora.b:
                    b.normal_(0, scale)
            report = await mesh.push(engine.weight_version + 1)
            assert report.delivered == 1, report.failed
            want = StateDictSource(backend.state_dict()).tensors
            assert_same(await remote_weights(engine), want)
            name = "model.layers.0.mlp.up_proj.weight"
            assert not torch.equal(want[name], backend.model.state_dict()[name])
    finally:
        await mesh.close()


def test_the_planner_picks_the_route_for_each_placement():
    here = Placement.here()
    other_node = Placement("other", "another-ray-node", 1, "cpu", here.transports)
    sglang_local = Placement(
        here.host, here.node, 0, "cuda", ("cuda_ipc", "broadcast", "disk"), "sglang"
    )
    sglang_far = Placement(
        "far", "host:far", 0, "cuda", ("cuda_ipc", "broadcast", "disk"), "sglang"
    )
    same_host = Placement(here.host, here.node, here.pid + 1, "cpu", here.transports)

    class At:
        weight_version = 0

        def __init__(self, placement):
            self.placement = placement

    def plan(sender: Placement, *placements, **cfg):
        receivers = [Receiver.of(At(p), f"e{i}") for i, p in enumerate(placements)]
        routes = {k: ROUTES.build(k, TransferConfig(**cfg)) for k in ROUTES.kinds()}
        return [route for _, route, _ in make_plan(sender, receivers, routes, "").entries]

    cpu_trainer = Placement.here(transports=())
    gpu_trainer = Placement(here.host, here.node, here.pid, "cuda")
    assert plan(cpu_trainer, here, same_host, other_node) == ["in_process", "shm", "broadcast"]
    # SGLang on CPU-trained weights: only a checkpoint folder reaches it (same host, or shared).
    assert plan(cpu_trainer, sglang_local) == ["disk"]
    with pytest.raises(ValueError, match="no registered route reaches e0"):
        plan(cpu_trainer, sglang_far)
    assert plan(cpu_trainer, sglang_far, disk_dir="/shared") == ["disk"]
    # A GPU trainer: NCCL to SGLang anywhere (CUDA IPC on its own node needs sglang here).
    expected_local = "cuda_ipc" if _has_sglang() else "broadcast"
    assert plan(gpu_trainer, sglang_local, sglang_far) == [expected_local, "broadcast"]


def _has_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


async def test_one_engine_here_and_two_on_this_host(actors, base, tiny_model_path):
    """Same process -> in_process; two Ray actors on this host -> one shm write, two reads."""
    local = LocalEngine(tiny_model_path)
    new = perturbed(base, seed=100)
    version = 1 + max(e.weight_version for e in actors)
    mesh = TransferMesh(new, [local, *actors])
    try:
        assert [r for _, r, _ in mesh.plan.entries] == ["in_process", "shm", "shm"]
        report = await mesh.push(version)
        assert report.delivered == 3 and [r.route for r in report.routes] == ["in_process", "shm"]
        for engine in (local, *actors):
            assert_same(await remote_weights(engine), new)
            assert engine.weight_version == version
        metrics = report.metrics()
        assert metrics["weights/shm/bytes"] == 2 * report.bytes
        assert set(report.stalls) == {"engine0", "engine1", "engine2"}
    finally:
        await mesh.close()
        await local.close()


class CountingSource(StateDictSource):
    """The trainer's own tensors, counting what the push gathers from them."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.gathered = 0

    def hf_tensors(self, names):
        self.gathered += len(names)
        yield from super().hf_tensors(names)


class LateReader:
    """An engine beside which another reader of the same version is still busy when the push
    ends (a receiver that timed out): it takes a shared lock on the segment, on its own open
    file, while this engine applies, and keeps it."""

    def __init__(self, engine, path: str) -> None:
        self.engine, self.path, self.fd = engine, path, None

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def update_weights(self, state, version: int) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        await self.engine.update_weights(state, version)

    async def health(self) -> bool:
        return True


async def test_shm_keeps_the_trainer_weights_in_its_segment(tiny_model_path, base):
    """One copy per push: after the first push the sender's tensors live in the segment (the
    optimizer updates them there) and later pushes gather nothing; a reader still holding a
    version keeps that file unchanged while the sender moves on to a new one."""
    from trainer.transfer import shm

    engine = LocalEngine(tiny_model_path)
    weights = perturbed(base, seed=300)
    source = CountingSource(weights)
    mesh = TransferMesh(source, [engine], TransferConfig(route="shm", bucket_mb=0.05))
    path = mesh.routes["shm"].path
    late = None
    try:
        version = engine.weight_version + 1
        assert (await mesh.push(version)).delivered == 1
        segment = shm._MAPPED[(path, True)]
        first, size = segment.data.data_ptr(), len(segment.mm)

        def in_first(t: torch.Tensor) -> bool:
            return first <= t.data_ptr() < first + size

        assert all(in_first(t) for t in weights.values())
        gathered = source.gathered
        with torch.no_grad():  # a train step: in place, into the segment
            for t in weights.values():
                t.mul_(1.5)
        assert (await mesh.push(version + 1)).delivered == 1
        assert source.gathered == gathered  # nothing gathered, nothing written: one copy
        assert_same(await weights_of(engine), weights)

        # A reader still on version+2 when the push ends keeps its file as it was.
        late = LateReader(engine, path)
        mesh.receivers[0].engine = late
        assert (await mesh.push(version + 2)).delivered == 1
        pushed = {k: t.clone() for k, t in weights.items()}
        assert not any(in_first(t) for t in weights.values())
        with torch.no_grad():
            for t in weights.values():
                t.add_(1.0)
        old = torch.frombuffer(bytearray(os.pread(late.fd, 1 << 30, 0)), dtype=torch.uint8)
        assert old[8:16].view(torch.int64).item() == version + 2
        buckets = mesh._buckets
        for b in buckets:
            body = old[shm.HEADER + b.start : shm.HEADER + b.start + b.nbytes]
            for name, tensor in views(body, b).items():
                assert torch.equal(tensor, pushed[name]), f"{name} changed under its reader"
        fcntl.flock(late.fd, fcntl.LOCK_UN)
        mesh.receivers[0].engine = engine
        assert (await mesh.push(version + 3)).delivered == 1
        assert_same(await weights_of(engine), weights)
        assert all(shm._MAPPED[(path, True)].holds(t) for t in weights.values())
    finally:
        await mesh.close()
        await engine.close()
        if late is not None and late.fd is not None:
            os.close(late.fd)
    # Closed: the tensors are back in private memory, with their values.
    assert (path, True) not in shm._MAPPED
    assert all(torch.isfinite(t).all() for t in weights.values())


# ------------------------------------------------------------------------ failures mid-push


class SlowSource(StateDictSource):
    """A trainer whose gathering takes `delay` seconds per bucket (so a push can be hit)."""

    def __init__(self, state, delay: float) -> None:
        super().__init__(state)
        self.delay = delay

    def hf_tensors(self, names):
        time.sleep(self.delay)
        yield from super().hf_tensors(names)


@ray.remote(num_cpus=0.5)
class SlowSenderActor:
    def __init__(self, state, delay: float) -> None:
        self.source = SlowSource(state, delay)

    def placement(self) -> Placement:
        return Placement.here()

    def run(self, fn, *args):
        return fn(self.source, *args)


class SlowSender:
    """A trainer in its own process, as `RayBackend` is to the mesh."""

    def __init__(self, state, delay: float) -> None:
        self.handle = SlowSenderActor.remote(state, delay)
        self.placement = ray.get(self.handle.placement.remote())

    async def run(self, fn, *args, reads=None):  # one rank: nobody gathers alongside
        return await self.handle.run.remote(fn, *args)


@pytest.mark.parametrize("route", ["broadcast", "shm"])
async def test_a_receiver_killed_mid_push_leaves_the_others_served(
    actors, base, tiny_model_path, route
):
    victim = spawn_engine(EngineConfig(), tiny_model_path, num_cpus=1)
    engines = [actors[0], victim, actors[1]]
    new = perturbed(base, seed=200)
    version = 1 + max(e.weight_version for e in engines)
    sender = SlowSender(new, delay=0.4)
    cfg = TransferConfig(route=route, bucket_mb=0.05, timeout_s=8)  # 9 buckets of the tiny model
    mesh = TransferMesh(sender, engines, cfg)
    router = Router(engines)
    try:
        push = asyncio.ensure_future(mesh.push(version))
        await asyncio.sleep(1.0)  # a few buckets in
        assert not push.done()
        ray.kill(victim.handle)
        report = await push
        assert set(report.failed) == {"engine1"} and report.delivered == 2
        for engine in actors:
            assert engine.weight_version == version
            assert_same(await remote_weights(engine), new)
        assert [s["version"] for s in mesh.status()] == [version, 0, version]
        assert mesh.status()[1]["error"]
        # The dead engine leaves the rotation; the next push reports it again.
        await router.check_health()
        assert router.healthy == [True, False, True] and router.weight_version == version
        again = await mesh.push(version + 1)
        assert set(again.failed) == {"engine1"} and again.delivered == 2
    finally:
        await mesh.close()
        ray.kill(sender.handle)


async def test_a_sender_killed_mid_broadcast_leaves_every_receiver_as_it_was(actors, base):
    before = [(e.weight_version, await remote_weights(e)) for e in actors]
    sender = SlowSender(perturbed(base, seed=300), delay=0.4)
    cfg = TransferConfig(route="broadcast", bucket_mb=0.05, timeout_s=6)
    mesh = TransferMesh(sender, actors, cfg)
    try:
        push = asyncio.ensure_future(mesh.push(1 + max(v for v, _ in before)))
        await asyncio.sleep(1.0)
        ray.kill(sender.handle)
        report = await push  # a report, not an exception
        assert set(report.failed) == {"engine0", "engine1"} and report.delivered == 0
        for engine, (version, weights) in zip(actors, before, strict=True):
            assert engine.weight_version == version
            assert_same(await remote_weights(engine), weights)  # no tensor of the new version
            out = await engine.generate(PROMPT, SamplingParams(max_tokens=3))
            assert out.output_versions == [version] * 3
    finally:
        await mesh.close()


# ------------------------------------------------------------------------- lagging engines


def wider_model(tiny_model_path, folder) -> str:
    """A model of another shape: the push cannot apply to it (a receiver that fails)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_path)
    config.intermediate_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return str(folder)


async def test_a_lagging_engine_serves_its_old_version_and_its_tokens_count_as_stale(
    base, tiny_model_path, tmp_path
):
    fresh = LocalEngine(tiny_model_path)
    lagging = LocalEngine(wider_model(tiny_model_path, tmp_path / "wider"))
    mesh = TransferMesh(perturbed(base, seed=5), [fresh, lagging])
    try:
        report = await mesh.push(1)
        assert report.delivered == 1 and "shape" in report.failed["engine1"]
        metrics = report.metrics()
        assert metrics["weights/failed"] == 1.0
        assert metrics["weights/version/engine0"] == 1 and metrics["weights/version/engine1"] == 0
        assert [(s["engine"], s["version"]) for s in mesh.status()] == [
            ("engine0", 1),
            ("engine1", 0),
        ]

        async def traj(engine, sid: str) -> Trajectory:
            gen = await engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
            t = Trajectory(sid, reward=float(sid == "a"))
            t.turns.append(
                Turn(PROMPT, gen.output_ids, gen.output_logprobs, gen.output_versions, "length")
            )
            t.rebuild_segments()
            return t

        # Tokens carry the version of the engine that sampled them: the lagging engine's are
        # one version older, so staleness counts them as such and a max_staleness=0 batch
        # drops their group.
        a, b = await traj(fresh, "a"), await traj(lagging, "b")
        assert token_staleness([a], 1) == {0: 4} and token_staleness([b], 1) == {1: 4}
        batcher = GroupBatcher(1, 2, max_staleness=0)
        batcher.open(0, "p", 1)
        batcher.add(0, a)
        batcher.add(0, b)
        assert batcher.drop_stale(1) == 1
    finally:
        await fresh.close()
        await lagging.close()


# ---------------------------------------------------------------------------------- SGLang


async def test_an_sglang_server_gets_a_checkpoint_folder_while_it_generates(base):
    """CPU weights reach an SGLang server as a folder (disk); it is paused around the load, its
    version moves, and a request across the update has tokens of both versions."""
    with serve_fake("--tokens-per-s", "200") as url:
        server = await SGLangEngine(url).connect()
        new = perturbed(base, seed=6)
        for mode in ("continue", "abort_resubmit"):
            mesh = TransferMesh(new, [server], mode=mode)
            assert [r for _, r, _ in mesh.plan.entries] == ["disk"]
            version = server.weight_version + 1
            stream = server.stream(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
            versions = list((await anext(stream)).versions)
            report = await mesh.push(version)
            assert report.delivered == 1, report.failed
            assert server.weight_version == version
            async for chunk in stream:
                versions += chunk.versions
            switch = versions.index(version)
            assert switch >= 1 and versions[switch:] == [version] * (len(versions) - switch)
            info = await server.get_server_info()
            assert not info["paused"] and info["weight_version"] == str(version)
            await mesh.close()
        await server.close()


# -------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
async def test_every_route_moves_smollm2_bit_exactly_while_generating(ray_local, smollm2_path):
    from transformers import AutoModelForCausalLM

    base = StateDictSource(AutoModelForCausalLM.from_pretrained(smollm2_path).state_dict()).tensors
    local = LocalEngine(smollm2_path)
    actor = spawn_engine(EngineConfig(), smollm2_path, num_cpus=1)
    try:
        for version, route in enumerate(["in_process", "shm", "broadcast", "disk"], start=1):
            engine = local if route == "in_process" else actor
            new = perturbed(base, seed=version)
            mesh = TransferMesh(new, [engine], TransferConfig(route=route, bucket_mb=64))
            old = engine.weight_version
            versions = await generate_across_push(engine, mesh, version)
            await mesh.close()
            switch = versions.index(version)
            assert versions == [old] * switch + [version] * (len(versions) - switch), route
            assert_same(await remote_weights(engine), new)
            del new
    finally:
        await local.close()
        await actor.close()


async def test_an_sglang_server_whose_update_fails_serves_nothing_until_a_whole_version():
    """SGLang loads buckets into its live weights: after a failure it may hold a mix, so it is
    left paused (its running requests aborted) until an update succeeds."""
    from trainer.transfer.sglang import sglang_update

    async def broken(flush: bool) -> None:
        await server.update_weights_from_tensor(["c2VyaWFsaXplZA=="], None)  # bucket 1 lands
        raise RuntimeError("the trainer died after the first bucket")

    async def whole(flush: bool) -> None:
        await server.update_weights_from_tensor(["c2VyaWFsaXplZA=="], 5)

    with serve_fake("--tokens-per-s", "200") as url:
        server = await SGLangEngine(url).connect()
        running = asyncio.ensure_future(
            server.generate(PROMPT, SamplingParams(max_tokens=1000, ignore_eos=True))
        )
        await asyncio.sleep(0.2)
        with pytest.raises(RuntimeError, match="after the first bucket"):
            await sglang_update(server, "continue", broken, session=True)
        assert (await running).finish_reason == "abort"
        info = await server.get_server_info()
        assert info["paused"] and info["weight_version"] == "default"
        stall = await sglang_update(server, "continue", whole, session=True)
        info = await server.get_server_info()
        assert not info["paused"] and info["weight_version"] == "5" and stall > 0
        out = await server.generate(PROMPT, SamplingParams(max_tokens=3))
        assert out.output_versions == [5, 5, 5]
        await server.close()
