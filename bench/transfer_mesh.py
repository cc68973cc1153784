"""TransferMesh, side by side in one run: each route's bandwidth against this machine's memcpy.

    flock /tmp/bench.lock .venv/bin/python bench/transfer_mesh.py [sizes_mb=[100,1000]]
        [receivers=[1,3]] [routes=[in_process,shm,broadcast,disk]] [repeats=3]

Prints, in one run:
1. memcpy bandwidth: one core copying a 1 GB buffer into another (`memcpy_gb_per_s`, the probe
   of gateway/machine.py), the physical limit of a same-host copy and of each receiver's final copy into its weights;
2. per route, per state dict size (100 MB and 1 GB of fp32 tensors shaped like an LLM's) and
   receiver count (1 and 3): push seconds and GB/s (bytes x receivers / seconds), the fraction
   of memcpy, and for 3 receivers the aggregate's gain over 1 receiver. Receivers are "sink"
   engines: they apply a version like the local engine does (check every name and shape, then
   copy every tensor into preallocated weights), in this process (`in_process`) or each in its
   own Ray actor (the other routes), without a model to run;
3. pipelining: the broadcast route with 64 MiB buckets, packing bucket k+1 while bucket k is in
   flight, against one bucket after the other, for a trainer whose tensors are in memory and
   for one that waits 50 ms to gather each bucket (as a sharded trainer's gathers do);
4. the generation stall of an update: a real engine (the tiny model) generates a long request
   while versions are pushed; the largest gap between two tokens during a push, against the
   largest gap without pushes, and the stall the engine reports (its swap; in `abort_resubmit`,
   pause to resume), per mode, in this process and in a Ray actor over shm.

Every push is timed from the start of `TransferMesh.push` to the last receiver's apply; each
cell is the best of `repeats` pushes after one warm-up push (the machine is shared: the best
run is the least disturbed one). Run it under `flock /tmp/bench.lock` beside other benchmarks.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from gateway import machine
from gateway.config import parse_cli
from gateway.engines import EngineConfig
from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from gateway.engines.placement import Placement
from gateway.models import resolve_model
from trainer.actors import RayEngine, init_ray, spawn_engine
from trainer.transfer import StateDictSource, TransferConfig, TransferMesh


@dataclass
class BenchConfig:
    sizes_mb: list[int] = field(default_factory=lambda: [100, 1000])
    """State dict sizes to push, in MB."""
    receivers: list[int] = field(default_factory=lambda: [1, 3])
    """Receiver counts."""
    routes: list[str] = field(default_factory=lambda: ["in_process", "shm", "broadcast", "disk"])
    """Routes to measure."""
    repeats: int = 3
    """Timed pushes per cell (after one warm-up push); the best counts."""
    bucket_mb: float = 512
    """Bucket size of the route measurements."""
    pipeline_bucket_mb: float = 64
    """Bucket size of the pipelining comparison (several buckets in flight)."""
    stall_pushes: int = 4
    """Pushes during the generation of the stall measurement."""


def memcpy_gb_per_s(nbytes: int = 10**9) -> float:
    """One core copying `nbytes` between two buffers: gateway/machine.py's probe, on one thread
    (each receiver copies its weights on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return machine.measure_memcpy(nbytes=nbytes)
    finally:
        torch.set_num_threads(threads)


def llm_like_state(total_mb: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of LLM-like shapes (a 4 MB embedding-ish matrix and 1 MB projections)."""
    state: dict[str, torch.Tensor] = {}
    remaining = total_mb * 10**6 // 4
    i = 0
    while remaining > 0:
        n = min(remaining, 1024 * 1024 if i % 8 == 0 else 256 * 1024)
        state[f"model.layers.{i // 8}.w{i % 8}"] = torch.rand(n)
        remaining -= n
        i += 1
    return state


class SinkEngine:
    """The receiving end of a push without a model: preallocated weights that `update_weights`
    checks and copies into, all or nothing, off the event loop (as the local engine's thread
    does). Enough of the Engine protocol for TransferMesh."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.weights = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in specs.items()}
        self.weight_version = 0

    async def update_weights(self, state, version: int) -> None:
        for name, tensor in state.items():
            if self.weights[name].shape != tensor.shape:
                raise ValueError(f"{name}: shape {tensor.shape}")

        def copy() -> None:
            for name, tensor in state.items():
                self.weights[name].copy_(tensor)

        await asyncio.to_thread(copy)
        self.weight_version = version

    async def pause(self, mode: str = "in_place") -> None:
        pass

    async def resume(self) -> None:
        pass

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@ray.remote(num_cpus=1)
class SinkActor:
    """A `SinkEngine` in its own process, speaking what `RayEngine` calls."""

    def __init__(self, specs) -> None:
        torch.set_num_threads(1)
        self.engine = SinkEngine(specs)

    async def info(self) -> dict[str, Any]:
        return {"max_context": 1, "weight_version": 0, "placement": Placement.here()}

    async def run(self, fn, *args):
        return await fn(self.engine, *args), self.engine.weight_version

    async def health(self) -> tuple[bool, int]:
        return True, self.engine.weight_version

    async def close(self) -> None:
        pass


def sinks(state: dict[str, torch.Tensor], n: int, in_process: bool) -> list[Any]:
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    if in_process:
        return [SinkEngine(specs) for _ in range(n)]
    return [RayEngine(handle) for handle in [SinkActor.remote(specs) for _ in range(n)]]


async def time_pushes(mesh: TransferMesh, repeats: int, first_version: int = 1) -> float:
    """Best seconds of `repeats` pushes after one warm-up push."""
    best = float("inf")
    for i in range(repeats + 1):
        report = await mesh.push(first_version + i)
        assert not report.failed, report.failed
        if i:
            best = min(best, report.seconds)
    return best


async def route_table(bench: BenchConfig, memcpy: float) -> list[str]:
    rows = [
        "| route | state dict | receivers | seconds | GB/s | of memcpy | vs 1 receiver |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for route in bench.routes:
        for size in bench.sizes_mb:
            state = llm_like_state(size)
            nbytes = sum(t.numel() * 4 for t in state.values())
            single = 0.0
            for n in bench.receivers:
                engines = sinks(state, n, in_process=route == "in_process")
                cfg = TransferConfig(route=route, bucket_mb=bench.bucket_mb)
                mesh = TransferMesh(state, engines, cfg)
                seconds = await time_pushes(mesh, bench.repeats)
                await mesh.close()
                for engine in engines:
                    if isinstance(engine, RayEngine):
                        ray.kill(engine.handle)
                gbps = nbytes * n / seconds / 1e9
                single = gbps if n == 1 else single
                gain = f"{gbps / single:.2f}x" if n > 1 and single else ""
                rows.append(
                    f"| {route} | {size} MB | {n} | {seconds:.3f} | {gbps:.2f} | "
                    f"{gbps / memcpy:.0%} | {gain} |"
                )
                print(rows[-1], flush=True)
            del state
    return rows


class GatherLatency(StateDictSource):
    """A trainer that waits `delay_s` to gather each bucket (a sharded trainer's all-gather or a
    GPU-to-host copy: time the sending process spends waiting, not computing)."""

    def __init__(self, state: dict[str, torch.Tensor], delay_s: float) -> None:
        super().__init__(state)
        self.delay_s = delay_s

    def hf_tensors(self, names):
        time.sleep(self.delay_s)
        yield from super().hf_tensors(names)


async def pipeline_table(bench: BenchConfig) -> list[str]:
    size = max(bench.sizes_mb)
    state = llm_like_state(size)
    nbytes = sum(t.numel() * 4 for t in state.values())
    delay = 0.05
    rows = [
        f"| broadcast, {size} MB, {bench.pipeline_bucket_mb:g} MiB buckets, 1 receiver | "
        "one bucket after another | pipelined | gain |",
        "|---|---:|---:|---:|",
    ]
    sources = {
        "the trainer's tensors in memory (packing is a copy)": state,
        f"{delay * 1e3:.0f} ms to gather each bucket (a sharded trainer)": GatherLatency(
            state, delay
        ),
    }
    for label, source in sources.items():
        seconds = {}
        for pipeline in (False, True):
            engines = sinks(state, 1, in_process=False)
            cfg = TransferConfig(
                route="broadcast", bucket_mb=bench.pipeline_bucket_mb, pipeline=pipeline
            )
            mesh = TransferMesh(source, engines, cfg)
            seconds[pipeline] = await time_pushes(mesh, bench.repeats)
            await mesh.close()
            ray.kill(engines[0].handle)
        rows.append(
            f"| {label} | {seconds[False]:.3f} s ({nbytes / seconds[False] / 1e9:.2f} GB/s) | "
            f"{seconds[True]:.3f} s ({nbytes / seconds[True] / 1e9:.2f} GB/s) | "
            f"{seconds[False] / seconds[True]:.2f}x |"
        )
        print(rows[-1], flush=True)
    return rows


async def token_gaps(engine: Any, mesh: TransferMesh | None, pushes: int) -> tuple[float, list]:
    """Largest gap between two streamed chunks of a generation (requests back to back) while
    `pushes` versions are pushed, one every 0.5 s (none without a mesh); and the reports."""
    params = SamplingParams(max_tokens=4000, ignore_eos=True, seed=0)
    gaps: list[float] = []
    reports = []

    async def generate() -> None:
        while True:
            stream = engine.stream([1, 15, 27], params)
            await anext(stream)  # the first token's wait is prefill, not a stall
            last = time.perf_counter()
            async for _ in stream:
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

    reader = asyncio.ensure_future(generate())
    await asyncio.sleep(0.5)
    for _ in range(pushes):
        if mesh is not None:
            reports.append(await mesh.push(engine.weight_version + 1))
        await asyncio.sleep(0.5)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    return max(gaps), reports


async def stall_table(bench: BenchConfig) -> list[str]:
    path = resolve_model("tiny")
    rows = [
        "| engine | mode | route | typical token gap | largest gap, no push | largest gap, "
        "pushing | stall reported (median) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    from transformers import AutoModelForCausalLM

    state = StateDictSource(AutoModelForCausalLM.from_pretrained(path).state_dict()).tensors
    for where in ("in process", "Ray actor"):
        for mode in ("continue", "abort_resubmit"):
            if where == "in process":
                engine = LocalEngine(path)
            else:
                engine = spawn_engine(EngineConfig(), path, num_cpus=1)
            mesh = TransferMesh(state, [engine], mode=mode)
            await mesh.push(1)  # warm: the segment exists, the engine has swapped once
            quiet, _ = await token_gaps(engine, None, bench.stall_pushes)
            loud, reports = await token_gaps(engine, mesh, bench.stall_pushes)
            typical = await typical_gap(engine)
            stall = statistics.median(r.stalls["engine0"] for r in reports)
            route = mesh.plan.entries[0][1]
            rows.append(
                f"| {where} | {mode} | {route} | {typical * 1e3:.1f} ms | {quiet * 1e3:.1f} ms | "
                f"{loud * 1e3:.1f} ms | {stall * 1e3:.1f} ms |"
            )
            print(rows[-1], flush=True)
            await mesh.close()
            await engine.close()
    return rows


async def typical_gap(engine: Any) -> float:
    out = []
    last = time.perf_counter()
    params = SamplingParams(max_tokens=64, ignore_eos=True, seed=0)
    async for _ in engine.stream([1, 15, 27], params):
        now = time.perf_counter()
        out.append(now - last)
        last = now
    return statistics.median(out[1:])


async def main(argv: list[str]) -> None:
    bench = parse_cli(BenchConfig, argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_ray(num_cpus=8)  # logical CPUs: one per sink actor; the machine has its own cores
    memcpy = memcpy_gb_per_s()
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}", flush=True)
    print(f"memcpy (one core, 1 GB): {memcpy:.2f} GB/s\n", flush=True)
    sections = [
        await route_table(bench, memcpy),
        await pipeline_table(bench),
        await stall_table(bench),
    ]
    print()
    print(f"memcpy (one core, 1 GB): {memcpy:.2f} GB/s\n")
    for rows in sections:
        print("\n".join(rows) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
