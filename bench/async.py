"""Async vs synchronous RL, side by side: the same workload with max_staleness 0, 1 and 2.

    .venv/bin/python bench/async.py                       # tiny model, quick
    .venv/bin/python bench/async.py tool_s=0.5            # rollouts also wait on an environment
    .venv/bin/python bench/async.py model=smollm2 steps=6

Each setting runs the real loop (`trainer.controller.Controller`): the embedded engine
(`LocalEngine`) generates, the torch backend trains, TransferMesh (in process) swaps the
engine's weights after every step. The workload has long-tailed response lengths: each sample's length is drawn
from a Pareto distribution (seeded, the same draws for every setting) and forced with
`ignore_eos`, so a few long generations hold up a synchronous batch while the rest of the
engine idles. Rollouts call the engine directly (no gateway or env), so the benchmark measures
the controller's overlap of generation and training, not agent overheads. With `tool_s > 0`
each rollout first waits on its "environment" (tool calls, a sandbox starting) for a
long-tailed time that uses no CPU, as agent rollouts do.

On a machine where the engine and the trainer share the same few cores, pure generation leaves
async little to overlap: both are CPU-bound, so what the trainer computes the engine loses.
Time spent waiting on environments is what async turns into throughput there.

Reported per setting: trained tokens per second of wall time (the sampled tokens of the
batches the trainer took; generation that ran ahead, or was dropped, is not counted; the first
step, which loads and warms up everything, is excluded), the mean `time/trainer_idle_frac`, the mean and max
staleness, and the throughput ratio to max_staleness=0. Targets (DESIGN.md): async >= 1.5x the
synchronous throughput, trainer idle < 10%.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import parse_cli
from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from gateway.models import resolve_model
from gateway.trajectory import Trajectory, Turn
from trainer.backends.torch_backend import TorchBackend
from trainer.config import TrainerConfig
from trainer.controller import Controller
from trainer.metrics import read_metrics
from trainer.transfer import TransferMesh


@dataclass
class BenchConfig:
    model: str = "tiny"
    """Model to generate with and train: `tiny`, `smollm2` or an HF folder."""
    staleness: list[int] = field(default_factory=lambda: [0, 1, 2])
    """max_staleness settings to compare (the first is the baseline)."""
    steps: int = 6
    """Train steps per setting."""
    batch_size: int = 4
    """Prompts (groups) per step."""
    num_samples_per_prompt: int = 4
    """Samples per prompt."""
    min_tokens: int = 8
    """Shortest response; lengths are min_tokens * Pareto(alpha), capped at max_tokens."""
    max_tokens: int = 256
    """Longest response."""
    alpha: float = 1.2
    """Pareto shape: smaller means a longer tail."""
    tool_s: float = 0.0
    """Shortest environment wait per rollout, seconds; waits are tool_s * Pareto(alpha), capped
    at 20 * tool_s. 0 = pure generation."""
    max_batch_size: int = 32
    """Engine's continuous-batching limit."""
    lr: float = 1e-5
    """Learning rate (the benchmark measures speed; the updates only need to be real)."""
    out: str = ""
    """Folder for the runs and results.json; empty = a temporary folder."""


class LongTailSource:
    """Samples a continuation of a short prompt with a long-tailed, seeded length."""

    def __init__(self, engine: LocalEngine, bench: BenchConfig) -> None:
        self.engine = engine
        self.bench = bench

    async def rollout(self, prompt, *, group_id, sample_index, seed) -> Trajectory:
        rng = random.Random(seed)
        b = self.bench
        length = min(b.max_tokens, int(b.min_tokens * rng.paretovariate(b.alpha)))
        if b.tool_s:
            await asyncio.sleep(min(20 * b.tool_s, b.tool_s * rng.paretovariate(b.alpha)))
        ids = [1, 100 + prompt % 1000, 200 + prompt % 97]
        params = SamplingParams(max_tokens=length, temperature=1.0, seed=seed, ignore_eos=True)
        gen = await self.engine.generate(ids, params)
        turn = Turn(
            ids, gen.output_ids, gen.output_logprobs, gen.output_versions, gen.finish_reason
        )
        # a reward that varies within a group, so no group is filtered away
        traj = Trajectory(f"{group_id}-{sample_index}", turns=[turn], reward=float(rng.random()))
        traj.rebuild_segments()
        return traj


async def run_setting(bench: BenchConfig, staleness: int, out: Path) -> dict[str, float]:
    cfg = TrainerConfig()
    cfg.model.name = bench.model
    cfg.rollout.max_staleness = staleness
    cfg.rollout.batch_size = bench.batch_size
    cfg.rollout.num_samples_per_prompt = bench.num_samples_per_prompt
    cfg.rollout.filter_zero_variance = False
    cfg.rollout.max_tokens = bench.max_tokens
    cfg.train.lr = bench.lr
    cfg.train.device = "cpu"
    cfg.run.steps = bench.steps
    cfg.run.checkpoint_every = 0
    cfg.run.samples_per_step = 0
    cfg.eval.every = 0
    cfg.logging.progress = False
    path = resolve_model(bench.model)
    run_dir = out / f"staleness_{staleness}"
    backend = TorchBackend(path, cfg.train, cfg.algorithm, total_steps=cfg.run.steps)
    async with LocalEngine(path, max_batch_size=bench.max_batch_size) as engine:
        push = TransferMesh(backend, [engine], mode=cfg.rollout.partial_rollout)
        ctl = Controller(cfg, backend, LongTailSource(engine, bench), push, run_dir=run_dir)
        await ctl.run()
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 2]
    # wall time of the loop itself: exclude the end-of-run checkpoint
    wall = sum(r["time/step_s"] - r["time/checkpoint_s"] for r in rows)
    tokens = sum(r["throughput/tokens_per_s"] * r["time/step_s"] for r in rows)
    return {
        "max_staleness": staleness,
        "trained_tokens_per_s": tokens / wall,
        "trainer_idle_frac": sum(r["time/trainer_idle_frac"] for r in rows) / len(rows),
        "staleness_mean": sum(r["staleness/mean"] for r in rows) / len(rows),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "dropped_stale": rows[-1].get("rollout/dropped_stale", 0.0),
    }


async def main(argv: list[str]) -> None:
    bench = parse_cli(BenchConfig, argv)
    if bench.steps < 3:
        raise ValueError("steps must be >= 3 (the first step is warm-up and not measured)")
    out = Path(bench.out or tempfile.mkdtemp(prefix="loongsage-bench-async-"))
    results = [await run_setting(bench, s, out) for s in bench.staleness]
    base = results[0]["trained_tokens_per_s"]
    print(f"\nasync benchmark: model={bench.model}, {bench.steps} steps, "
          f"{bench.batch_size}x{bench.num_samples_per_prompt} samples/step, "
          f"lengths {bench.min_tokens}*Pareto({bench.alpha}) <= {bench.max_tokens}, "
          f"env waits {bench.tool_s}*Pareto({bench.alpha}) s")  # fmt: skip
    print(f"{'max_staleness':>13} {'trained tok/s':>13} {'vs sync':>8} {'trainer idle':>13} "
          f"{'staleness mean/max':>19} {'dropped stale':>13}")  # fmt: skip
    for r in results:
        print(
            f"{r['max_staleness']:>13} {r['trained_tokens_per_s']:>13.1f} "
            f"{r['trained_tokens_per_s'] / base:>7.2f}x "
            f"{r['trainer_idle_frac']:>12.1%} {r['staleness_mean']:>10.2f} / {r['staleness_max']:<6.0f} "
            f"{r['dropped_stale']:>13.0f}"
        )
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"runs and results.json in {out}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
