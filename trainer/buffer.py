"""Pure-Python cores of the async loop: the staleness gate and the GRPO group batcher.

No Ray, engines or models here, so both are unit-tested on their own. The unit of both is the
*group* (one prompt, `num_samples_per_prompt` samples), the same unit as `rollout.batch_size`.

Staleness gate (DESIGN.md, "Async and staleness"): a group is admitted only while, after
admitting it, `accepted + running <= (max_staleness + version + 1) * batch_size`. `version` is
the number of train steps done; `accepted` counts every group accepted so far (trained or
waiting), `running` the groups in flight. With max_staleness 0 this admits exactly one batch per
version: synchronous RL. A run of `steps` steps never admits past its last batch: the capacity
stops at `steps * batch_size`, so nothing is generated during the last step that no step would
train (it would take cores from that step's training on a shared CPU).

The gate alone does not bound the lag: a long rollout can be overtaken by short ones admitted
after it, and the trainer, taking whatever is complete, would move on until the long one is too
old to train on. So the step at `version` also waits for every group admitted at
`version - max_staleness` or earlier (`GroupBatcher.waiting_for_old`), and `pop_batch` takes the
groups with the oldest tokens first. Long rollouts are thus admitted early and trained on
instead of discarded late; the price is that a step may wait for the slowest group admitted
max_staleness versions ago. Rarely, more than `batch_size` old groups are complete at once
(groups admitted later took earlier batches); those left over go too stale and are dropped and
handed back to the gate, so no trained token is ever more than max_staleness versions older
than the policy it trains. `bench/async.py` counts the drops: 0-1 per run, from 4-6 before
steps waited for old groups.

Batcher: a group is complete when all its samples are back. Aborted/errored samples are dropped
from it and recorded; a group with fewer than 2 usable samples, with all-equal rewards (when
zero-variance filtering is on) or too stale is dropped with its reason. Complete groups wait;
`pop_batch` takes `batch_size` of them, those with the oldest tokens first (stable sort, so
arrival order among equals), which keeps stale drops rare when generation runs ahead.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gateway.trajectory import Trajectory


class StalenessGate:
    """Admission control by the staleness window; see the module docstring."""

    def __init__(
        self, batch_size: int, max_staleness: int, version: int = 0, steps: int | None = None
    ) -> None:
        if batch_size <= 0 or max_staleness < 0:
            raise ValueError(
                f"need batch_size > 0 and max_staleness >= 0, got {batch_size}, {max_staleness}"
            )
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.version = version
        self.steps = steps
        """The run's last version (None: unbounded)."""
        self.accepted = version * batch_size  # a (re)started run has consumed `version` batches
        self.running = 0

    @property
    def capacity(self) -> int:
        versions = self.max_staleness + self.version + 1
        if self.steps is not None:
            versions = min(versions, self.steps)
        return versions * self.batch_size

    def can_admit(self) -> bool:
        return self.accepted + self.running + 1 <= self.capacity

    def admit(self) -> None:
        assert self.can_admit(), "admit() past the staleness window"
        self.running += 1

    def finish(self, accepted: bool) -> None:
        """A running group came back; `accepted` if it will be trained on (not filtered)."""
        assert self.running > 0
        self.running -= 1
        self.accepted += int(accepted)

    def unaccept(self, n: int = 1) -> None:
        """Accepted groups were dropped later (too stale at batch time): free their slots."""
        assert self.accepted >= n
        self.accepted -= n

    def set_version(self, version: int) -> None:
        self.version = version


@dataclass
class Group:
    """The samples of one prompt."""

    group_id: int
    prompt: Any
    admitted_version: int
    expected: int
    trajectories: list[Trajectory] = field(default_factory=list)
    """Usable (status ok) samples, in completion order."""
    dropped: list[Trajectory] = field(default_factory=list)
    """Aborted or failed samples, kept for the record."""

    @property
    def done(self) -> bool:
        return len(self.trajectories) + len(self.dropped) >= self.expected

    @property
    def rewards(self) -> list[float]:
        return [float(t.reward or 0.0) for t in self.trajectories]


def oldest_version(traj: Trajectory) -> int | None:
    """Smallest weight version among the trajectory's sampled tokens (None: no sampled tokens)."""
    versions = [
        v
        for s in traj.segments
        for v, m in zip(s.versions, s.loss_mask, strict=True)
        if m and v >= 0
    ]
    return min(versions) if versions else None


def token_staleness(trajectories: list[Trajectory], version: int) -> Counter[int]:
    """Histogram {lag: tokens}: lag = version - token version, over all sampled tokens."""
    hist: Counter[int] = Counter()
    for traj in trajectories:
        for seg in traj.segments:
            for v, m in zip(seg.versions, seg.loss_mask, strict=True):
                if m and v >= 0:
                    hist[version - v] += 1
    return hist


@dataclass
class Batch:
    """What one train step consumes."""

    groups: list[Group]
    version: int
    """Policy version being trained (train steps done before this one)."""
    staleness: Counter[int]
    """Token staleness histogram {lag: tokens}."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def metrics(self) -> dict[str, float]:
        total = sum(self.staleness.values())
        rewards = [r for g in self.groups for r in g.rewards]
        lengths = [t.num_output_tokens for t in self.trajectories]
        forks = [t.forks for t in self.trajectories]
        out = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "response/len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "response/len_max": float(max(lengths, default=0)),
            # Segments beyond the first: an agent that edits its own history (mini-swe-agent
            # drops malformed replies) or a template that is not append-only.
            "rollout/forks_mean": sum(forks) / len(forks) if forks else 0.0,
            "rollout/forks_max": float(max(forks, default=0)),
            "staleness/mean": sum(k * n for k, n in self.staleness.items()) / total
            if total
            else 0.0,
            "staleness/max": float(max(self.staleness, default=0)),
        }
        for lag, n in sorted(self.staleness.items()):
            out[f"staleness/frac_{lag}"] = n / total
        return out


class GroupBatcher:
    """Collects samples into groups and complete groups into batches; see the module docstring."""

    def __init__(
        self,
        batch_size: int,
        num_samples_per_prompt: int,
        max_staleness: int,
        filter_zero_variance: bool = True,
    ) -> None:
        self.batch_size = batch_size
        self.num_samples_per_prompt = num_samples_per_prompt
        self.max_staleness = max_staleness
        self.filter_zero_variance = filter_zero_variance
        self.pending: dict[int, Group] = {}
        self.ready: list[Group] = []
        self.drops: Counter[str] = Counter()
        """Why groups were dropped, cumulative: few_samples, zero_variance, stale."""
        self.aborted_samples = 0
        self.abort_reasons: Counter[str] = Counter()

    def open(self, group_id: int, prompt: Any, version: int) -> None:
        """A group was admitted; its samples will arrive through `add`."""
        assert group_id not in self.pending, f"group {group_id} opened twice"
        self.pending[group_id] = Group(group_id, prompt, version, self.num_samples_per_prompt)

    def add(self, group_id: int, traj: Trajectory) -> tuple[Group, bool] | None:
        """Record one finished sample. When it completes its group, return (group, accepted)."""
        group = self.pending[group_id]
        if traj.status == "ok":
            group.trajectories.append(traj)
        else:
            group.dropped.append(traj)
            self.aborted_samples += 1
            self.abort_reasons[traj.reason or traj.status] += 1
        if not group.done:
            return None
        del self.pending[group_id]
        reason = self._reject_reason(group)
        if reason:
            self.drops[reason] += 1
            return group, False
        self.ready.append(group)
        return group, True

    def _reject_reason(self, group: Group) -> str:
        if len(group.trajectories) < 2:
            return "few_samples"
        if self.filter_zero_variance and len(set(group.rewards)) == 1:
            return "zero_variance"
        return ""

    def num_ready(self) -> int:
        return len(self.ready)

    def waiting_for_old(self, version: int) -> bool:
        """A group admitted max_staleness or more versions ago is still generating: the step at
        `version` must wait for it, or it would be too stale for the next one."""
        return any(
            version - g.admitted_version >= self.max_staleness for g in self.pending.values()
        )

    @staticmethod
    def _oldest(group: Group, default: int) -> int:
        olds = [oldest_version(t) for t in group.trajectories]
        return min((v for v in olds if v is not None), default=default)

    def drop_stale(self, version: int) -> int:
        """Drop waiting groups with a token older than version - max_staleness; return how many."""
        keep = [g for g in self.ready if version - self._oldest(g, version) <= self.max_staleness]
        stale = len(self.ready) - len(keep)
        self.ready = keep
        self.drops["stale"] += stale
        return stale

    def pop_batch(self, version: int) -> Batch:
        """batch_size waiting groups, those with the oldest tokens first (they are the next to
        go stale), then by arrival. Call drop_stale first; needs a full batch ready."""
        assert len(self.ready) >= self.batch_size, "pop_batch without a full batch ready"
        order = sorted(range(len(self.ready)), key=lambda i: self._oldest(self.ready[i], version))
        chosen = set(order[: self.batch_size])
        groups = [g for i, g in enumerate(self.ready) if i in chosen]
        self.ready = [g for i, g in enumerate(self.ready) if i not in chosen]
        # Train in a fixed order whatever the completion order: reproducible steps and resumes.
        groups.sort(key=lambda g: g.group_id)
        for g in groups:
            g.trajectories.sort(key=lambda t: t.metadata.get("sample_index", 0))
        trajs = [t for g in groups for t in g.trajectories]
        return Batch(groups=groups, version=version, staleness=token_staleness(trajs, version))

    def metrics(self) -> dict[str, float]:
        """Cumulative counters for metrics.jsonl."""
        out = {f"rollout/dropped_{k}": float(v) for k, v in sorted(self.drops.items())}
        out["rollout/aborted_samples"] = float(self.aborted_samples)
        return out


class PromptStream:
    """The training prompts, in a seeded order that a checkpoint can resume exactly.

    With `items`, each epoch is a fresh seeded shuffle of them; without, prompts are integer
    task seeds (for envs whose `reset(seed=...)` draws the task). State: how many were drawn.
    """

    def __init__(self, items: list[Any] | None = None, seed: int = 0) -> None:
        if items is not None and not items:
            raise ValueError("PromptStream: items is empty; give at least one prompt")
        self.items = items
        self.seed = seed
        self.index = 0
        self._order: list[int] = []
        self._epoch = -1

    def next(self) -> Any:
        i = self.index
        self.index += 1
        if self.items is None:
            return random.Random(f"{self.seed}:{i}").randrange(2**31)
        epoch, pos = divmod(i, len(self.items))
        if epoch != self._epoch:
            self._order = list(range(len(self.items)))
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self.items[self._order[pos]]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
