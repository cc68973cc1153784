"""The trajectory record: what one session (one rollout) generated, token-exact.

Defined once here, since the gateway produces it, and used by the trainer, AgentFlow and the
sandbox runners alike. A turn is one engine call; segments are the maximal token sequences
obtained by merging each turn onto an earlier segment whose tokens its prompt extends exactly.
Nothing is ever re-tokenized: segments are made only of ids the gateway sent to the engine and
ids the engine sampled. A turn whose reply never reached the client (it disconnected, or its
request was aborted at shutdown) stays in `turns` with `delivered=False` but is left out of the
segments: the agent never saw those tokens, so nothing it did next (and no reward) depends on
them, and the trainer, which trains on segments only, never trains on them.

`TrajectoryLog` appends closed trajectories to a JSONL file, one line each, fsync'd before the
close returns (the gateway's `log_dir`); `read_trajectories` reads such a file back.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

Status = Literal["ok", "aborted", "error"]


@dataclass
class Turn:
    """One engine call: the exact prompt ids sent and what the engine sampled."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """Behaviour log-probability of each sampled token under the weights that sampled it."""
    output_versions: list[int]
    """Weight version that produced each output token."""
    finish_reason: str
    """`stop`, `length`, `tool_calls` or `abort`."""
    endpoint: str = ""
    started_at: float = 0.0
    duration_s: float = 0.0
    delivered: bool = True
    """False when the client went away before the whole reply reached it; such a turn is kept
    here but left out of the segments."""
    max_tokens: int | None = None
    """The output cap the engine was given (the session's cap, when it forces one)."""
    asked_max_tokens: int | None = None
    """The max_tokens the client asked for (None: it sent none)."""


@dataclass
class Segment:
    """A token sequence to train on; `loss_mask` is 1 exactly on the tokens the engine sampled."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-probs on sampled tokens, 0.0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """Weight version on sampled tokens, -1 elsewhere."""
    teacher_logprobs: list[float] | None = None
    """A teacher's log-probs of the sampled tokens (0.0 elsewhere), when the trainer's Teacher
    Manager scored the segment for on-policy distillation; the gateway leaves it None."""

    def extend(self, prompt_ids: list[int], turn: Turn) -> None:
        new_prompt = prompt_ids[len(self.token_ids) :]
        self.token_ids += new_prompt + turn.output_ids
        self.loss_mask += [0] * len(new_prompt) + [1] * len(turn.output_ids)
        self.logprobs += [0.0] * len(new_prompt) + list(turn.output_logprobs)
        self.versions += [-1] * len(new_prompt) + list(turn.output_versions)


@dataclass
class Trajectory:
    session_id: str
    status: Status = "ok"
    reason: str = ""
    """Why the rollout was aborted or failed; empty when ok."""
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    """Reward breakdown, verifier output, sandbox logs: anything attached with the reward."""
    metadata: dict[str, Any] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    forks: int = 0
    """Turns that could not extend any earlier segment (diverged history), excluding siblings."""

    def rebuild_segments(self) -> None:
        self.segments, self.forks = build_segments(self.turns)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record; a segment no teacher scored has no `teacher_logprobs` key (the
        gateway's record is the same with or without distillation)."""
        data = dataclasses.asdict(self)
        for seg in data["segments"]:
            if seg["teacher_logprobs"] is None:
                del seg["teacher_logprobs"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        turns = [Turn(**t) for t in data.pop("turns", [])]
        segments = [Segment(**s) for s in data.pop("segments", [])]
        return cls(turns=turns, segments=segments, **data)


def build_segments(turns: list[Turn]) -> tuple[list[Segment], int]:
    """Merge turns into segments; return them and the number of forks.

    A turn extends the most recent segment whose tokens are a prefix of its prompt. A turn that
    extends none starts a new segment; that is a fork unless an earlier turn had the very same
    prompt (a sibling sample: `n > 1`, or a retry), which is a legitimate new sequence.
    """
    segments: list[Segment] = []
    seen_prompts: set[tuple[int, ...]] = set()
    forks = 0
    for turn in turns:
        if not turn.delivered:
            continue
        prompt = turn.prompt_ids
        target = next(
            (
                s
                for s in reversed(segments)
                if len(s.token_ids) <= len(prompt) and prompt[: len(s.token_ids)] == s.token_ids
            ),
            None,
        )
        if target is None:
            if segments and tuple(prompt) not in seen_prompts:
                forks += 1
            target = Segment()
            segments.append(target)
        seen_prompts.add(tuple(prompt))
        target.extend(prompt, turn)
    return segments, forks


class TrajectoryLog:
    """Appends trajectories to a JSONL file, one line each, durably (flushed and fsync'd)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with open(self.path, "ab+") as f:  # end a line a crash cut short, so it stays alone
            if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                f.write(b"\n")

    def append(self, traj: Trajectory) -> None:
        """Blocking (an fsync): call it from a worker thread in async code."""
        line = orjson.dumps(traj.to_dict()) + b"\n"
        with self._lock, open(self.path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_trajectories(path: str | Path) -> Iterator[Trajectory]:
    """The trajectories of a gateway's `log_dir/trajectories.jsonl` (or any file written by
    `TrajectoryLog`), in the order they closed. Lines a crash cut short are skipped."""
    with open(path, "rb") as f:
        for line in f:
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a write a crash interrupted
            yield Trajectory.from_dict(data)
