"""The staleness bound under adversarial rollouts, checked with the workload's own record.

The real `Controller` and the real torch backend (tiny model) train on rollouts from a source
that stamps each output token with the weight version its "engine" holds when it samples it, and
keeps that stamp in its own table. The backend subclass counts its own train steps and, for
every trained token, looks the stamp up in that table: neither `Segment.versions`,
`token_staleness` nor the gate's counters are read to decide whether the bound held.

Two workloads, each under max_staleness 1, 2 and 3:

- *long tails*: one sample in every fourth group keeps generating (a partial rollout, tokens of
  successive versions) until the policy is `max_staleness` versions past its admission — the
  longest a rollout can take and still be trained on. The bound must hold at exactly the window
  (tokens of lag max_staleness are trained), and no group is dropped as stale: the step that
  would make them too old waits for them (`GroupBatcher.waiting_for_old`). (With more than
  `batch_size` such groups admitted at one version, some must be dropped: one step cannot
  train them all. Every fourth group keeps it to at most `batch_size`.)
- *a lagging receiver*: one sample in every fourth group comes from an engine that missed the
  last `max_staleness + 1` weight pushes (a failed receiver keeps its old version). Such a group
  can never be trained; it must be dropped, and the drop counter must equal the number of
  those groups the test counts itself.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.trajectory import Trajectory, Turn
from trainer.backends.torch_backend import TorchBackend
from trainer.config import load
from trainer.controller import Controller
from trainer.transfer import PushReport

STEPS = 6


class Workload:
    """Rollouts whose prompt ids name (group, sample) and whose token versions are recorded."""

    def __init__(self, kind: str, max_staleness: int) -> None:
        self.kind = kind
        self.max_staleness = max_staleness
        self.version = 0  # what a healthy engine holds: moved by Push
        self.stamps: dict[tuple[int, int], list[int]] = {}
        """(group, sample) -> the version of each output token, as sampled."""
        self.controller: Controller | None = None
        self._moved = asyncio.Condition()

    async def set_version(self, version: int) -> None:
        async with self._moved:
            self.version = version
            self._moved.notify_all()

    def adversary(self, group_id: int, sample_index: int) -> bool:
        return group_id % 4 == 1 and sample_index == 0

    async def rollout(self, prompt, *, group_id, sample_index, seed) -> Trajectory:
        rng = random.Random(seed)
        admitted = self.controller.batcher.pending[group_id].admitted_version
        lag = 0
        if self.kind == "lagging" and self.adversary(group_id, sample_index):
            lag = self.max_staleness + 1
        out, stamps = [], []
        for _ in range(rng.randint(2, 5)):
            await asyncio.sleep(rng.random() * 0.002)
            out.append(rng.randrange(1000, 2000))
            stamps.append(max(0, self.version - lag))
        if self.kind == "long_tail" and self.adversary(group_id, sample_index):
            while self.version < admitted + self.max_staleness:
                async with self._moved:
                    await self._moved.wait_for(lambda: self.version > stamps[-1])
                out.append(rng.randrange(1000, 2000))
                stamps.append(self.version)
            await asyncio.sleep(0.05)  # arrive after the trainer has looked, unless it waits
        self.stamps[(group_id, sample_index)] = stamps
        prompt_ids = [1, 100 + group_id, 50 + sample_index]
        turn = Turn(prompt_ids, out, [-7.0] * len(out), list(stamps), "stop")
        traj = Trajectory(f"{group_id}-{sample_index}", reward=float(sample_index % 2))
        traj.turns.append(turn)
        traj.rebuild_segments()
        return traj


class Push:
    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    async def push(self, version: int) -> PushReport:
        await self.workload.set_version(version)
        return PushReport(version=version, bytes=1, seconds=1e-6)


class CountingBackend(TorchBackend):
    """The real backend; it also records, per train step, which (group, sample) it trained and
    the lag of every trained token, from the workload's own stamps."""

    def __init__(self, workload: Workload, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workload = workload
        self.steps_taken = 0
        self.trained: list[tuple[int, int]] = []
        self.lags: list[int] = []

    def train_step(self, samples):
        for s in samples:
            key = (s.token_ids[1] - 100, s.token_ids[2] - 50)
            stamps = self.workload.stamps[key]
            trained = [i for i, m in enumerate(s.loss_mask) if m]
            assert len(trained) == len(stamps)
            self.lags += [self.steps_taken - v for v in stamps]
            self.trained.append(key)
        self.steps_taken += 1
        return super().train_step(samples)


async def run(kind: str, max_staleness: int, tmp_path, model_path):
    cfg = load(["recipe=tiny", f"run.dir={tmp_path}", f"run.steps={STEPS}",
                f"rollout.max_staleness={max_staleness}", "rollout.num_samples_per_prompt=2",
                "eval.every=0", "run.checkpoint_every=0", "run.samples_per_step=0"])  # fmt: skip
    workload = Workload(kind, max_staleness)
    backend = CountingBackend(
        workload, model_path, cfg.train, cfg.algorithm, temperature=1.0, seed=0
    )
    ctl = Controller(cfg, backend, workload, Push(workload))
    workload.controller = ctl
    await asyncio.wait_for(ctl.run(), timeout=120)
    return ctl, workload, backend


def stale_drops(ctl: Controller, workload: Workload, backend: CountingBackend) -> set[int]:
    """Groups that came back complete but were neither trained nor left waiting at the end:
    the stale drops, counted from the workload's stamps and the backend's record. Each must
    hold a token more than max_staleness versions older than the final policy, and the
    controller's drop counter must agree."""
    complete = {g for g, s in workload.stamps if (g, 1 - s) in workload.stamps}
    trained = {g for g, _ in backend.trained}
    waiting = {g.group_id for g in ctl.batcher.ready}
    dropped = complete - trained - waiting
    for g in dropped:
        oldest = min(workload.stamps[(g, 0)] + workload.stamps[(g, 1)])
        assert backend.steps_taken - oldest > workload.max_staleness, g
    assert ctl.batcher.drops["stale"] == len(dropped)
    return dropped


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
async def test_long_rollouts_are_trained_at_the_edge_of_the_window(
    tmp_path, tiny_model_path, max_staleness
):
    ctl, workload, backend = await run("long_tail", max_staleness, tmp_path, tiny_model_path)
    assert backend.steps_taken == STEPS
    assert max(backend.lags) == max_staleness  # the window is reached, never passed
    assert min(backend.lags) >= 0
    long_ones = {k for k in backend.trained if workload.adversary(*k)}
    assert len(long_ones) >= 2  # long rollouts were trained on ...
    assert stale_drops(ctl, workload, backend) == set()  # ... none discarded as too stale


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
async def test_groups_from_a_lagging_receiver_are_dropped_and_counted(
    tmp_path, tiny_model_path, max_staleness
):
    ctl, workload, backend = await run("lagging", max_staleness, tmp_path, tiny_model_path)
    assert backend.steps_taken == STEPS
    assert 0 <= min(backend.lags) and max(backend.lags) <= max_staleness
    assert stale_drops(ctl, workload, backend)
