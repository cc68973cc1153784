"""The one metrics interface of a run: metrics.jsonl always, TensorBoard/W&B when asked, plots,
readable samples, and the summary printed at the end.

`MetricsLogger.log(step, metrics)` appends one JSON line per step to `<run>/metrics.jsonl` (with
`step` and `time_s`, the run's wall time, which continues across a resume) and mirrors it to
TensorBoard and W&B when `logging.tensorboard` / `logging.wandb` are set. Asking for one that is
not installed is an error at start, not a silent no-op. `plot_run` turns metrics.jsonl into PNGs
at the end: reward and eval curves, the train-inference gap, and the trainer's utilization
timeline (waiting for generation vs training vs weight sync, per step). `SamplesLog` writes a
few trajectories per step to `<run>/samples.jsonl` (decoded text, and token ids, loss mask,
logprobs and versions for `python -m trainer.view`); `PhaseTimer` times the phases of a
step as context managers; `Summary` is what a run returns and prints.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.server.ui import turn_layout
from gateway.trajectory import Segment, Trajectory

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """See the module docstring. `resume_step` drops lines after that step (they are redone)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "loongsage",
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        offset = 0.0
        if resume_step is not None:
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            offset = max((r.get("time_s", 0.0) for r in kept), default=0.0)
        elif self.path.exists():
            self.path.unlink()
        self._start = time.monotonic() - offset
        self._file = self.path.open("a")
        self._tb = None
        self._wandb = None
        if tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError(
                    "logging.tensorboard=true but the tensorboard package is not installed: "
                    "pip install tensorboard, or set logging.tensorboard=false"
                )
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb:
            if importlib.util.find_spec("wandb") is None:
                raise ValueError(
                    "logging.wandb=true but the wandb package is not installed: "
                    "pip install wandb, or set logging.wandb=false"
                )
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(
                project=wandb_project, dir=str(self.run_dir), config=dict(config or {})
            )

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def log(self, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Write one line for `step`; returns the record written."""
        record: dict[str, Any] = {"step": step, "time_s": round(self.elapsed(), 3)}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else None  # JSON has no NaN
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and v is not None}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: Path) -> list[Path]:
    """PNG plots of `<run_dir>/metrics.jsonl` into `<run_dir>/plots/`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / METRICS_FILE)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(rows, "reward/mean"), label="train reward (mean)")
    ax.plot(*_series(rows, "eval/success_rate"), "o-", label="eval success rate (held out)")
    ax.set_xlabel("step")
    ax.set_title("Reward and evaluation")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "reward.png")

    gap = [
        ("logprob_abs_diff", "mean |logp_train - logp_rollout|"),
        ("k3_kl", "k3 KL(rollout || train)"),
        ("clip_frac", "IS ratio truncated/masked fraction"),
    ]
    parts = [("mismatch", "fresh tokens (numerical)"), ("off_policy", "stale tokens (drift)")]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, (key, title) in zip(axes.flat, gap, strict=False):
        for part, label in parts:
            ax.plot(*_series(rows, f"{part}/{key}"), "o-", markersize=3, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    for part, label in parts:
        ax.plot(*_series(rows, f"{part}/ratio_max"), label=f"max, {label}")
        ax.plot(*_series(rows, f"{part}/ratio_min"), label=f"min, {label}")
    ax.set_yscale("log")
    ax.set_title("IS ratio exp(logp_train - logp_rollout)", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle("Train-inference gap")
    save(fig, "mismatch.png")

    # Trainer timeline: each step ends at time_s after waiting, training and syncing.
    phases = [
        ("time/generation_wait_s", "waiting for rollouts", "tab:gray"),
        ("time/train_s", "training", "tab:blue"),
        ("time/weight_sync_s", "weight sync", "tab:orange"),
        ("time/eval_s", "evaluation", "tab:green"),
        ("time/checkpoint_s", "checkpoint", "tab:purple"),
    ]
    steps = [r for r in rows if r.get("time/train_s") is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5))
    for r in steps:
        durations = [r.get(k) or 0.0 for k, _, _ in phases]
        start = r["time_s"] - sum(durations)
        for (_, _, color), d in zip(phases, durations, strict=True):
            top.broken_barh([(start, d)], (0, 1), color=color)
            start += d
    top.set_yticks([])
    top.set_xlabel("wall time (s)")
    top.set_title("Trainer utilization timeline")
    xs = [r["step"] for r in steps]
    base = [0.0] * len(steps)
    for key, label, color in phases:
        vals = [r.get(key) or 0.0 for r in steps]
        bottom.bar(xs, vals, bottom=base, label=label, color=color)
        base = [b + v for b, v in zip(base, vals, strict=True)]
    bottom.set_xlabel("step")
    bottom.set_ylabel("seconds")
    bottom.legend(fontsize=8)
    save(fig, "timeline.png")
    return written


class PhaseTimer:
    """Seconds spent in each phase of one step, by metric name:
    `with timer("time/train_s"): ...`; phases that did not run read 0."""

    def __init__(self, *phases: str) -> None:
        self.seconds = dict.fromkeys(phases, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.monotonic() - start


class SamplesLog:
    """`<run>/samples.jsonl`: the first `per_step` trajectories of each step, one line each: step,
    id, reward, status and reason, the decoded text when a `decode` is given, and everything
    `python -m trainer.view` shows token by token, kept compact (`pack_segment`): the segments'
    token ids, loss mask, logprobs and versions, and where each turn's output sits
    (`gateway.server.ui.turn_layout`). `resume_step` drops lines after that step (they are
    redone); a fresh run starts the file empty. `sample_trajectory` reads a line back."""

    def __init__(
        self,
        run_dir: Path,
        per_step: int,
        decode: Callable[[list[int]], str] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.path = Path(run_dir) / "samples.jsonl"
        self.per_step = per_step
        self.decode = decode
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            kept = [
                x for x in lines if resume_step is not None and json.loads(x)["step"] <= resume_step
            ]
            self.path.write_text("".join(x + "\n" for x in kept))

    def write(self, step: int, trajectories: list[Trajectory]) -> None:
        with self.path.open("a") as f:
            for traj in trajectories[: self.per_step]:
                tokens = [t for s in traj.segments for t in s.token_ids]
                rec = {
                    "step": step,
                    "id": traj.session_id,
                    "reward": traj.reward,
                    "status": traj.status,
                    "reason": traj.reason,
                    "versions": sorted({v for s in traj.segments for v in s.versions if v >= 0}),
                    "text": self.decode(tokens) if self.decode else None,
                    "metadata": traj.metadata,
                    "info": traj.info,
                    "forks": traj.forks,
                    "segments": [pack_segment(s) for s in traj.segments],
                    "turns": turn_layout(traj),
                }
                f.write(json.dumps(rec, default=str) + "\n")


def pack_segment(seg: Segment) -> dict[str, Any]:
    """A segment for samples.jsonl: its token ids, the `[start, end)` spans of sampled tokens
    (loss mask 1), and only for those the logprobs (4 decimals) and versions (as `[version,
    count]` runs); the rest of a segment is 0 / 0.0 / -1 by definition."""
    spans: list[list[int]] = []
    logprobs: list[float] = []
    runs: list[list[int]] = []
    for i, m in enumerate(seg.loss_mask):
        if not m:
            continue
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
        logprobs.append(round(seg.logprobs[i], 4))
        v = seg.versions[i]
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return {"token_ids": seg.token_ids, "sampled": spans, "logprobs": logprobs, "versions": runs}


def unpack_segment(packed: Mapping[str, Any]) -> Segment:
    n = len(packed["token_ids"])
    seg = Segment(list(packed["token_ids"]), [0] * n, [0.0] * n, [-1] * n)
    positions = [i for a, b in packed["sampled"] for i in range(a, b)]
    versions = [v for v, count in packed["versions"] for _ in range(count)]
    for i, lp, v in zip(positions, packed["logprobs"], versions, strict=True):
        seg.loss_mask[i], seg.logprobs[i], seg.versions[i] = 1, lp, v
    return seg


def sample_trajectory(record: Mapping[str, Any]) -> tuple[Trajectory, list[dict[str, Any]]]:
    """A samples.jsonl line as a Trajectory (segments, no turns) and its turns' layout."""
    traj = Trajectory(
        session_id=record.get("id") or "",
        status=record["status"],
        reason=record.get("reason") or "",
        reward=record.get("reward"),
        info=record.get("info") or {},
        metadata=record.get("metadata") or {},
        segments=[unpack_segment(s) for s in record.get("segments") or []],
        forks=record.get("forks") or 0,
    )
    return traj, list(record.get("turns") or [])


@dataclass
class Summary:
    run_dir: Path
    steps: int
    reward_first: float | None = None
    reward_last: float | None = None
    eval_first: dict[str, float] = field(default_factory=dict)
    eval_last: dict[str, float] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    final_model: Path | None = None
    aborted: dict[str, int] = field(default_factory=dict)
    """Rollouts that ended `aborted` or `error` (never trained on), by reason."""

    def record(self, metrics: Mapping[str, float], evaluation: dict[str, float]) -> None:
        """One step's metrics and, when it evaluated, its evaluation."""
        if self.reward_first is None:
            self.reward_first = metrics["reward/mean"]
        self.reward_last = metrics["reward/mean"]
        self.eval_last = evaluation or self.eval_last

    def text(self) -> str:
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        lines = [
            f"LoongSage run finished: {self.steps} steps in {self.run_dir}",
            f"  train reward (mean): {fmt(self.reward_first)} -> {fmt(self.reward_last)}",
        ]
        for key in sorted(self.eval_last):
            lines.append(f"  {key}: {fmt(self.eval_first.get(key))} -> {fmt(self.eval_last[key])}")
        if self.aborted:
            top = sorted(self.aborted.items(), key=lambda kv: -kv[1])[:3]
            reasons = "; ".join(f"{n}x {reason[:120]}" for reason, n in top)
            lines.append(f"  aborted rollouts: {sum(self.aborted.values())} ({reasons})")
        lines.append(f"  plots: {', '.join(str(p) for p in self.plots)}")
        lines.append(f"  model: {self.final_model} (Hugging Face folder)")
        return "\n".join(lines)
