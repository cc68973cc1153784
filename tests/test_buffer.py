"""The staleness gate and the group batcher, without engines: a discrete-event simulation of
rollouts with long-tailed durations and a trainer with a fixed step time."""

from __future__ import annotations

import heapq
import random

import pytest

from gateway.trajectory import Segment, Trajectory
from trainer.buffer import GroupBatcher, StalenessGate, oldest_version, token_staleness


def traj(reward: float, versions: list[int], status: str = "ok", reason: str = "") -> Trajectory:
    n = len(versions)
    seg = Segment(
        token_ids=[7] * (n + 1),
        loss_mask=[0] + [1] * n,
        logprobs=[0.0] + [-1.0] * n,
        versions=[-1] + versions,
    )
    return Trajectory("s", status=status, reason=reason, reward=reward, segments=[seg])


def simulate(
    max_staleness: int, batch_size: int = 4, steps: int = 12, seed: int = 0, wait_for_old=True
):
    """Run the gate + batcher against simulated rollouts, as the controller does; return
    per-step observations."""
    rng = random.Random(seed)
    n = 2
    gate = StalenessGate(batch_size, max_staleness)
    batcher = GroupBatcher(batch_size, n, max_staleness, filter_zero_variance=False)
    events: list[tuple[float, int, int]] = []  # (finish time, group id, admitted version)
    now, next_gid, train_until = 0.0, 0, None
    trained: list[dict] = []
    running_while_training = []
    while len(trained) < steps:
        while gate.can_admit():
            gate.admit()
            batcher.open(next_gid, prompt=next_gid, version=gate.version)
            duration = rng.paretovariate(1.5)  # long tail
            heapq.heappush(events, (now + duration, next_gid, gate.version))
            next_gid += 1
        if train_until is None:
            gate.unaccept(batcher.drop_stale(gate.version))
            waiting = wait_for_old and batcher.waiting_for_old(gate.version)
            if batcher.num_ready() >= batch_size and not waiting:
                batch = batcher.pop_batch(gate.version)
                trained.append({"version": gate.version, "staleness": batch.staleness})
                train_until = now + 1.0
                running_while_training.append(gate.running)
                continue
        # next event: a rollout finishing or the train step ending
        if train_until is not None and (not events or train_until <= events[0][0]):
            now, train_until = train_until, None
            gate.set_version(gate.version + 1)
            continue
        now, gid, version = heapq.heappop(events)
        for i in range(n):
            done = batcher.add(gid, traj(float(i), [version] * 3))
        assert done is not None
        gate.finish(accepted=done[1])
        assert gate.accepted + gate.running <= gate.capacity
    return trained, running_while_training, batcher


def test_max_staleness_0_is_synchronous():
    trained, running_while_training, batcher = simulate(max_staleness=0)
    assert all(set(t["staleness"]) == {0} for t in trained)
    assert running_while_training == [0] * len(trained)  # nothing generates during training
    assert batcher.drops["stale"] == 0


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_lag_is_bounded(max_staleness):
    trained, running_while_training, _ = simulate(max_staleness=max_staleness, steps=30)
    lags = [lag for t in trained for lag in t["staleness"]]
    assert max(lags) <= max_staleness  # never older than the window
    assert max(lags) >= 1  # and the window is actually used
    assert any(r > 0 for r in running_while_training)  # generation overlaps training


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_waiting_for_old_groups_trains_long_rollouts_instead_of_dropping_them(max_staleness):
    drops = {}
    for wait in (False, True):
        *_, batcher = simulate(max_staleness, steps=60, wait_for_old=wait)
        drops[wait] = batcher.drops["stale"]
    assert drops[False] >= 10 and drops[True] <= drops[False] // 5, drops


def test_waiting_for_old():
    b = GroupBatcher(batch_size=2, num_samples_per_prompt=1, max_staleness=1)
    b.open(0, "p", version=0)
    assert not b.waiting_for_old(0)  # admitted at the current version: not old yet
    assert b.waiting_for_old(1)  # the step at version 1 is its last chance
    b.add(0, traj(1.0, [0]))
    assert not b.waiting_for_old(1)  # complete: nothing to wait for


def test_gate_window_arithmetic():
    gate = StalenessGate(batch_size=2, max_staleness=1)
    for _ in range(4):  # (1 + 0 + 1) * 2
        assert gate.can_admit()
        gate.admit()
    assert not gate.can_admit()
    gate.finish(accepted=False)  # a filtered group frees its slot
    assert gate.can_admit()
    gate.admit()
    gate.set_version(1)
    assert gate.capacity == 6 and gate.can_admit()
    resumed = StalenessGate(batch_size=2, max_staleness=0, version=3)
    assert resumed.accepted == 6 and resumed.capacity == 8
    last = StalenessGate(batch_size=2, max_staleness=1, version=2, steps=3)
    assert last.capacity == 6  # the last step's batch, not one more for a step never trained
    last.running = 2
    assert not last.can_admit()
    last.set_version(1)
    assert last.capacity == 6
    last.set_version(0)
    assert last.capacity == 4
    assert not StalenessGate(batch_size=2, max_staleness=1, steps=0).can_admit()
    with pytest.raises(ValueError):
        StalenessGate(batch_size=0, max_staleness=0)


def test_batcher_groups_and_drops():
    b = GroupBatcher(batch_size=2, num_samples_per_prompt=3, max_staleness=0)
    for gid in range(4):
        b.open(gid, prompt=f"p{gid}", version=0)
    # group 0: one aborted sample, two ok with different rewards -> accepted with 2 samples
    assert b.add(0, traj(1.0, [0])) is None
    assert b.add(0, traj(0.0, [0], status="aborted", reason="sandbox timeout")) is None
    group, accepted = b.add(0, traj(0.0, [0]))
    assert accepted and len(group.trajectories) == 2 and len(group.dropped) == 1
    # group 1: all rewards equal -> filtered
    b.add(1, traj(1.0, [0]))
    b.add(1, traj(1.0, [0]))
    assert b.add(1, traj(1.0, [0]))[1] is False
    assert b.drops["zero_variance"] == 1
    # group 2: only one usable sample -> dropped
    b.add(2, traj(1.0, [0], status="error", reason="agent crashed"))
    b.add(2, traj(1.0, [0], status="aborted", reason="sandbox timeout"))
    assert b.add(2, traj(0.0, [0]))[1] is False
    assert b.drops["few_samples"] == 1
    assert b.abort_reasons == {"sandbox timeout": 2, "agent crashed": 1}
    assert b.num_ready() == 1
    for r in (0.0, 1.0, 0.5):
        b.add(3, traj(r, [0, 0]))
    batch = b.pop_batch(version=0)
    assert [g.prompt for g in batch.groups] == ["p0", "p3"]  # arrival order
    assert batch.staleness == {0: 2 + 6}
    m = batch.metrics()
    assert m["reward/mean"] == pytest.approx((1 + 0 + 0 + 1 + 0.5) / 5)
    assert m["staleness/max"] == 0.0 and m["response/len_mean"] == 0.0  # no turns recorded
    assert b.metrics()["rollout/aborted_samples"] == 3.0


def test_zero_variance_kept_when_filter_off():
    b = GroupBatcher(
        batch_size=1, num_samples_per_prompt=2, max_staleness=0, filter_zero_variance=False
    )
    b.open(0, "p", 0)
    b.add(0, traj(1.0, [0]))
    assert b.add(0, traj(1.0, [0]))[1] is True


def test_drop_stale_and_histogram():
    b = GroupBatcher(batch_size=1, num_samples_per_prompt=2, max_staleness=1)
    b.open(0, "old", 0)
    b.add(0, traj(0.0, [0, 1]))
    b.add(0, traj(1.0, [1, 1]))
    b.open(1, "new", 1)
    b.add(1, traj(0.0, [1, 2]))
    b.add(1, traj(1.0, [2, 2]))
    assert b.drop_stale(version=2) == 1  # group 0 has a token of version 0: lag 2 > 1
    batch = b.pop_batch(version=2)
    assert batch.groups[0].prompt == "new"
    assert batch.staleness == {1: 1, 0: 3}
    assert batch.metrics()["staleness/mean"] == pytest.approx(0.25)
    assert oldest_version(traj(0.0, [3, 2])) == 2
    assert token_staleness([traj(0.0, [3, 2])], 3) == {0: 1, 1: 1}


def test_prompt_stream_is_seeded_and_resumable():
    from trainer.buffer import PromptStream

    a = PromptStream(["a", "b", "c"], seed=1)
    first = [a.next() for _ in range(6)]
    assert sorted(first[:3]) == ["a", "b", "c"] and sorted(first[3:]) == ["a", "b", "c"]
    b = PromptStream(["a", "b", "c"], seed=1)
    b.load_state_dict({"index": 4})
    assert [b.next() for _ in range(2)] == first[4:]
    seeds = PromptStream(seed=3)
    s = [seeds.next() for _ in range(3)]
    resumed = PromptStream(seed=3)
    resumed.load_state_dict(seeds.state_dict())
    assert resumed.next() == seeds.next() and len(set(s)) == 3
    assert [PromptStream(seed=4).next() for _ in range(2)][0] != s[0]
    with pytest.raises(ValueError, match="items is empty"):
        PromptStream([])
