"""What the controller needs from whatever holds the weights and the optimizer.

A backend takes `TrainSample`s (token ids, loss mask, behaviour log-probs, advantages), runs one
train step with the one loss of `trainer.algorithms`, hands its weights to the weight push and
saves/loads resumable checkpoints and final HF folders. `train_samples` turns a batch and its
advantages (computed in `trainer.algorithms`) into samples. What every backend does the same
way lives here too: building from a run's config and counting steps (`BackendBase`), checking
samples, packing them into micro-batches, the LR schedule, the RNG state a checkpoint keeps, and
the `perf/*` metrics (FLOPs counted by `machine.ModelShape` over the measured matmul peak).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

import numpy as np
import torch

from gateway import machine
from gateway.models import resolve_model

if TYPE_CHECKING:
    from trainer.buffer import Batch
    from trainer.config import TrainerConfig


@dataclass
class TrainSample:
    """One segment to train on, with its advantage."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """Behaviour log-probs (the engine's), aligned with token_ids; 0.0 where loss_mask is 0."""
    advantage: float | list[float]
    """Its trajectory's advantage, for every token; or one per token, aligned with token_ids
    (on-policy distillation: `trainer.algorithms.add_distill_advantages`)."""
    versions: list[int] = field(default_factory=list)
    """Weight version that sampled each token (-1 where loss_mask is 0); empty: all fresh."""
    teacher_logprobs: list[float] | None = None
    """The segment's `teacher_logprobs`, when a teacher scored it."""

    def lags(self, version: int) -> list[int]:
        """How many versions behind `version` (the weights being trained) each token was
        sampled; 0 for fresh and untrained tokens."""
        if not self.versions:
            return [0] * len(self.token_ids)
        return [version - v if v >= 0 else 0 for v in self.versions]

    def token_advantages(self) -> list[float]:
        """One advantage per token."""
        if isinstance(self.advantage, list):
            return self.advantage
        return [self.advantage] * len(self.token_ids)


def train_samples(batch: Batch, advantages: list[list[float]]) -> list[TrainSample]:
    """Every segment with sampled tokens, with its trajectory's advantage (`advantages[g][i]` for
    trajectory i of group g)."""
    samples = []
    for group, adv in zip(batch.groups, advantages, strict=True):
        for traj, a in zip(group.trajectories, adv, strict=True):
            for seg in traj.segments:
                if any(seg.loss_mask):
                    samples.append(
                        TrainSample(
                            seg.token_ids,
                            seg.loss_mask,
                            seg.logprobs,
                            a,
                            seg.versions,
                            seg.teacher_logprobs,
                        )
                    )
    return samples


def check_samples(samples: list[TrainSample]) -> None:
    if not samples:
        raise ValueError("train_step needs at least one sample")
    for s in samples:
        if not len(s.token_ids) == len(s.loss_mask) == len(s.logprobs):
            raise ValueError("a sample's token_ids, loss_mask and logprobs differ in length")


def micro_batches(idx: list[int], samples: list[TrainSample], budget: int) -> list[list[int]]:
    """Greedy packing of samples `idx`, longest first, so that rows * longest row <= budget
    (`train.micro_batch_tokens`; a longer sample is a micro-batch of its own)."""
    order = sorted(idx, key=lambda i: -len(samples[i].token_ids))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            cur = batches[-1]
            width = len(samples[cur[0]].token_ids)  # longest, since sorted
            if width * (len(cur) + 1) <= budget:
                cur.append(i)
                continue
        batches.append([i])
    return batches


def pad_rows(rows: list[list[float]] | list[list[int]], value: float, dtype) -> torch.Tensor:
    """Right-padded [len(rows), longest row] tensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak LR at train step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`train.dtype` as a torch dtype: `auto` asks `machine.auto_dtype` (bf16 only where it is
    native and measured faster, else fp32)."""
    if name == "auto":
        return machine.auto_dtype(str(device))
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


PEAK_ROWS = 1024


def peak_gflops(shape: machine.ModelShape, dtype: torch.dtype, device: torch.device | str) -> float:
    """Measured matmul GFLOP/s of the gate/up projection over PEAK_ROWS tokens: the largest
    matmul of a layer, at a micro-batch's size, the best rate the step's matmuls can reach."""
    return machine.matmul_gflops(
        PEAK_ROWS, shape.hidden, 2 * shape.intermediate, dtype, str(device)
    )


def step_metrics(
    samples: list[TrainSample],
    losses: list[float],
    grad_norms: list[float],
    lr: float,
    flops: float,
    seconds: float,
    peak: float,
    devices: int = 1,
) -> dict[str, float]:
    """A train step's own metrics (the loss terms come from `algorithms.reduce_metrics`): mean
    loss and grad norm over its optimizer steps, its tokens and sequences; `perf/train_tflops`,
    its counted FLOPs per second, and `perf/mfu`, that over `devices` times one device's
    measured `peak` (GFLOP/s, `peak_gflops`)."""
    return {
        "train/loss": sum(losses) / len(losses),
        "train/grad_norm": sum(grad_norms) / len(grad_norms),
        "train/lr": lr,
        "train/tokens": float(sum(sum(s.loss_mask) for s in samples)),
        "train/sequences": float(len(samples)),
        "perf/train_tflops": flops / seconds / 1e12,
        "perf/mfu": flops / seconds / (peak * 1e9 * devices),
    }


def rng_state() -> dict[str, Any]:
    """Every RNG a checkpoint restores (torch, CUDA, Python, numpy)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])


@runtime_checkable
class TrainBackend(Protocol):
    @property
    def step(self) -> int:
        """Train steps taken (= the weight version the backend holds)."""
        ...

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One step (num_minibatches optimizer steps, one LR-schedule step); returns metrics:
        `train/*` (loss, grad_norm, lr, ...), the `mismatch/*` train-inference gap on fresh
        tokens and the `off_policy/*` drift on stale ones (trainer.algorithms)."""
        ...

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Current log-prob of each token given the ones before it (0.0 at position 0)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights for the weight push (live tensors: receivers copy them)."""
        ...

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """Model, optimizer, scheduler, RNG and `extra` (controller/data state) into folder path."""
        ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore a save_checkpoint folder; returns its `extra`."""
        ...

    def save_hf(self, path: Path) -> None:
        """An HF model folder (weights, config, tokenizer) loadable by transformers / SGLang."""
        ...


class BackendBase:
    """What the backends share: `from_config` (the registry's entry point) calls
    `__init__(model_path, train, algorithm, *, temperature, total_steps, seed)`, and `step`
    reads `_step`, which the subclass sets to 0 and counts up in `train_step`."""

    _step: int

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> Self:
        """The backend of a run: cfg.model trained with cfg.train."""
        return cls(
            resolve_model(cfg.model.name),
            cfg.train,
            cfg.algorithm,
            temperature=cfg.rollout.temperature,
            total_steps=cfg.run.steps,
            seed=cfg.run.seed,
        )

    @property
    def step(self) -> int:
        return self._step
