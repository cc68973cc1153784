"""The controller's loop: sync and async with a pure-Python rollout source and the real torch
backend (tiny model), then end to end with the real embedded engine generating the rollouts."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from gateway.trajectory import Trajectory, Turn
from trainer.backends.torch_backend import TorchBackend
from trainer.config import TrainerConfig, load
from trainer.controller import Controller
from trainer.metrics import read_metrics
from trainer.transfer import PushReport, TransferMesh

REQUIRED = [
    "step", "time_s", "reward/mean", "response/len_mean", "throughput/tokens_per_s",
    "time/generation_wait_s", "time/train_s", "time/weight_sync_s", "time/trainer_idle_frac",
    "staleness/mean", "staleness/max", "mismatch/tokens", "off_policy/tokens",
    "train/grad_norm", "train/lr",
]  # fmt: skip


class ToySource:
    """Pure-Python rollouts: seeded tokens and reward, long-tailed durations, and per-token
    versions read from `version` (moved by ToyPush) while the rollout runs."""

    def __init__(self, fail_every: int = 0) -> None:
        self.version = 0
        self.spans: list[tuple[int, int]] = []  # (version at start, version at end)
        self.fail_every = fail_every
        self.calls = 0

    async def rollout(self, prompt, *, group_id, sample_index, seed) -> Trajectory:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError("agent crashed")
        rng = random.Random(seed)
        start = self.version
        out_ids, versions = [], []
        for _ in range(rng.randint(2, 6)):
            await asyncio.sleep(min(rng.paretovariate(1.2), 20) * 0.002)
            out_ids.append(rng.randrange(100, 1000))
            versions.append(self.version)
        self.spans.append((start, self.version))
        turn = Turn(
            prompt_ids=[1, 10 + prompt % 50, 2],
            output_ids=out_ids,
            output_logprobs=[-7.0] * len(out_ids),
            output_versions=versions,
            finish_reason="stop",
            max_tokens=6,
        )
        traj = Trajectory(f"{group_id}-{sample_index}", reward=float(rng.random() < 0.5))
        traj.turns.append(turn)
        traj.rebuild_segments()
        return traj


class ToyPush:
    def __init__(self, source: ToySource) -> None:
        self.source = source
        self.versions: list[int] = []

    async def push(self, version: int) -> PushReport:
        self.versions.append(version)
        self.source.version = version
        return PushReport(version=version, bytes=1, seconds=1e-6)


def config(tmp_path, *overrides: str) -> TrainerConfig:
    return load(["recipe=tiny", f"run.dir={tmp_path}", *overrides])


def backend_for(cfg: TrainerConfig, path) -> TorchBackend:
    return TorchBackend(
        path, cfg.train, cfg.algorithm, temperature=cfg.rollout.temperature,
        total_steps=cfg.run.steps, seed=cfg.run.seed,
    )  # fmt: skip


class CountingEvaluator:
    def __init__(self) -> None:
        self.steps: list[int] = []

    async def evaluate(self, step: int) -> dict[str, float]:
        self.steps.append(step)
        return {"eval/success_rate": step / 10}


class RecordingController(Controller):
    """Keeps every batch it trains on, for the tests to compare."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches = []

    async def train_step(self, batch, timer):
        self.batches.append(batch)
        return await super().train_step(batch, timer)


async def run_toy(tmp_path, tiny_model_path, *overrides, source=None):
    cfg = config(tmp_path, *overrides)
    source = source or ToySource()
    push = ToyPush(source)
    evaluator = CountingEvaluator()
    ctl = RecordingController(
        cfg, backend_for(cfg, tiny_model_path), source, push, evaluator=evaluator,
        decode=lambda ids: " ".join(map(str, ids)),
    )  # fmt: skip
    summary = await ctl.run()
    return ctl, summary, source, push, evaluator


async def test_synchronous_run_and_run_directory(tmp_path, tiny_model_path):
    ctl, summary, source, push, evaluator = await run_toy(
        tmp_path, tiny_model_path, "rollout.max_staleness=0", "run.steps=3", "eval.every=2"
    )
    assert all(start == end for start, end in source.spans)  # nothing spans a weight update
    assert push.versions == [1, 2, 3]
    assert evaluator.steps == [0, 2, 3]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/success_rate"] == 0.0 and rows[2]["eval/success_rate"] == 0.2
    for row in rows[1:]:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert row["staleness/max"] == 0.0
        assert 0.0 <= row["time/trainer_idle_frac"] <= 1.0
        assert row["mismatch/logprob_abs_diff"] > 0  # behaviour logprobs are fake: a gap
        assert row["off_policy/tokens"] == 0  # synchronous: every token is fresh
    assert (tmp_path / "config.yaml").is_file()
    assert load([f"recipe={tmp_path / 'config.yaml'}"]) == ctl.cfg  # resolved config reloads
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [1, 2, 3] and samples[0]["text"].startswith("1 ")
    assert {p.name for p in summary.plots} == {"reward.png", "mismatch.png", "timeline.png"}
    AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000003",
    ]  # fmt: skip: run.keep_checkpoints=2
    assert "eval/success_rate: 0.000 -> 0.300" in summary.text()


async def test_async_run_overlaps_and_bounds_staleness(tmp_path, tiny_model_path):
    _, _, source, _, _ = await run_toy(
        tmp_path, tiny_model_path, "rollout.max_staleness=1", "run.steps=4",
        "rollout.num_samples_per_prompt=3", "run.checkpoint_every=0", "eval.every=0",
        "algorithm.overlong_buffer=2",
    )  # fmt: skip
    rows = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert all(r["staleness/max"] <= 1 for r in rows)
    # replies of 2-6 tokens under a cap of 6: those of 5 and 6 lose 0.5 and 1
    assert all(0 <= r["overlong/frac"] <= 1 for r in rows)
    assert any(r["overlong/penalty_mean"] > 0 for r in rows)
    # batch v+1 was generated with version v while step v trained: generation overlapped it
    assert any(r["staleness/max"] == 1 for r in rows)
    assert len(source.spans) == 4 * 2 * 3  # but never past the last step's batch


async def test_failing_rollouts_are_data(tmp_path, tiny_model_path, caplog):
    ctl, summary, _, _, _ = await run_toy(
        tmp_path, tiny_model_path, "run.steps=2", "rollout.num_samples_per_prompt=3",
        source=ToySource(fail_every=4),
    )  # fmt: skip
    n = ctl.batcher.abort_reasons["RuntimeError: agent crashed"]
    assert n >= 1 and summary.aborted == {"RuntimeError: agent crashed": n}
    assert f"aborted rollouts: {n} ({n}x RuntimeError: agent crashed)" in summary.text()
    assert 1 <= read_metrics(tmp_path / "metrics.jsonl")[-1]["rollout/aborted_samples"] <= n
    warned = [r for r in caplog.records if "not trained on: RuntimeError" in r.getMessage()]
    assert len(warned) == n


async def test_resume_trains_the_same_next_batch(tmp_path, tiny_model_path):
    # synchronous: which groups make a batch does not depend on completion timing
    first, *_ = await run_toy(
        tmp_path / "a", tiny_model_path, "run.steps=2", "rollout.max_staleness=0"
    )
    ckpt = tmp_path / "a" / "checkpoints" / "step_000001"
    resumed, *_ = await run_toy(
        tmp_path / "b",
        tiny_model_path,
        "run.steps=2",
        f"run.resume={ckpt}",
        "rollout.max_staleness=0",
    )
    a, b = first.batches[-1], resumed.batches[-1]
    assert [(g.group_id, g.prompt, g.rewards) for g in a.groups] == [
        (g.group_id, g.prompt, g.rewards) for g in b.groups
    ]
    for pa, pb in zip(
        first.backend.model.parameters(), resumed.backend.model.parameters(), strict=True
    ):
        assert torch.equal(pa, pb)
    rows = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2]
    # resuming in place redoes step 2: metrics and samples keep one copy of each step
    again, *_ = await run_toy(tmp_path / "a", tiny_model_path, "run.steps=2",
                              f"run.resume={ckpt}", "rollout.max_staleness=0")  # fmt: skip
    assert [r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [0, 1, 2]
    lines = (tmp_path / "a" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


class EngineSource:
    """Real rollouts: the embedded engine samples a continuation; reward = it contains an even
    token id among its first four (arbitrary, but it varies within a group)."""

    def __init__(self, engine: LocalEngine, max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens

    async def rollout(self, prompt, *, group_id, sample_index, seed) -> Trajectory:
        ids = [1, 10 + prompt % 1000, 20 + prompt % 7]
        params = SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=seed)
        gen = await self.engine.generate(ids, params)
        turn = Turn(ids, gen.output_ids, gen.output_logprobs, gen.output_versions,
                    gen.finish_reason)  # fmt: skip
        traj = Trajectory(f"{group_id}-{sample_index}", turns=[turn])
        traj.reward = float(any(t % 2 == 0 for t in gen.output_ids[:4]))
        traj.rebuild_segments()
        return traj


async def test_end_to_end_with_the_embedded_engine(tmp_path, tiny_model_path):
    cfg = config(tmp_path, "rollout.max_staleness=1")
    backend = backend_for(cfg, tiny_model_path)
    async with LocalEngine(tiny_model_path, max_batch_size=8) as engine:
        ctl = Controller(
            cfg, backend, EngineSource(engine, cfg.rollout.max_tokens),
            TransferMesh(backend, [engine], mode=cfg.rollout.partial_rollout),
        )  # fmt: skip
        await ctl.run()
        assert engine.weight_version == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert not [k for k in REQUIRED if k not in row]
        # the engine's logprobs and the trainer's agree on the tiny model in fp32 (fresh
        # tokens; stale ones differ by a step of policy drift, reported as off_policy/*)
        if row["mismatch/tokens"]:
            assert row["mismatch/logprob_abs_diff"] < 1e-5
        assert row["mismatch/tokens"] + row["off_policy/tokens"] == row["train/tokens"]
        assert row["staleness/max"] <= 1
        assert row["weights/bytes"] > 0


class BrokenPrompts:
    def next(self):
        raise OSError("dataset file vanished")


async def test_a_failing_prompt_stream_stops_the_run_with_its_error(tmp_path, tiny_model_path):
    cfg = config(tmp_path)
    source = ToySource()
    ctl = Controller(cfg, backend_for(cfg, tiny_model_path), source, ToyPush(source),
                     prompts=BrokenPrompts())  # fmt: skip
    with pytest.raises(RuntimeError, match="admitting rollouts failed") as info:
        await asyncio.wait_for(ctl.run(), timeout=60)
    assert isinstance(info.value.__cause__, OSError)


def test_trainer_config_has_no_unknown_sections():
    with pytest.raises(ValueError, match="did you mean rollout"):
        load(["rolout.batch_size=2"])


async def test_mid_run_eval_overlaps_the_next_train_step_and_sees_one_version(
    tmp_path, tiny_model_path
):
    """The step-0 eval waits until the first rollouts have finished (a controller that
    evaluated before admitting any would never get there); the step-1 eval until the backend
    has trained step 2 (one that held the trainer for its eval would not); no weights are
    pushed meanwhile."""
    cfg = config(tmp_path, "run.steps=3", "eval.every=1")
    source = ToySource()
    push = ToyPush(source)
    backend = backend_for(cfg, tiny_model_path)
    seen: list[tuple[int, int, list[int]]] = []

    class OverlapEvaluator:
        async def evaluate(self, step: int) -> dict[str, float]:
            async with asyncio.timeout(120):
                while step == 0 and len(source.spans) < cfg.rollout.batch_size:
                    await asyncio.sleep(0.01)
                while 0 < step < cfg.run.steps and backend.step <= step:
                    await asyncio.sleep(0.01)
            seen.append((step, backend.step, list(push.versions)))
            return {"eval/success_rate": step / 10}

    ctl = Controller(cfg, backend, source, push, evaluator=OverlapEvaluator())
    await ctl.run()
    assert seen == [(0, 0, []), (1, 2, [1]), (2, 3, [1, 2]), (3, 3, [1, 2, 3])]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # one line per step, eval included
    assert [r["eval/success_rate"] for r in rows] == [0.0, 0.1, 0.2, 0.3]
    assert all(r["time/eval_s"] >= 0 for r in rows[1:])


async def test_rollouts_stop_before_the_final_evaluation(tmp_path, tiny_model_path):
    """No rollout is started that no step would train: the last step's batch is the last one
    admitted, so the final evaluation does not share the engines with rollouts (a mid-run one
    does) and the final checkpoint holds no admitted prompt."""
    cfg = config(tmp_path, "run.steps=3", "eval.every=1", "rollout.max_staleness=1")
    running: dict[int, int] = {}

    class SlowSource(ToySource):
        async def rollout(self, prompt, **kw) -> Trajectory:
            await asyncio.sleep(0.2)
            return await super().rollout(prompt, **kw)

    class InflightEvaluator:
        async def evaluate(self, step: int) -> dict[str, float]:
            running[step] = len(ctl._tasks)
            return {}

    source = SlowSource()

    ctl = Controller(
        cfg, backend_for(cfg, tiny_model_path), source, ToyPush(source),
        evaluator=InflightEvaluator(),
    )  # fmt: skip
    await ctl.run()
    assert running[1] > 0 and running[3] == 0, running
    state = torch.load(tmp_path / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert state["extra"]["controller"]["pending"] == [], state["extra"]["controller"]
    assert len(source.spans) == 3 * 2 * 2
