"""What the controller needs from whatever holds the weights and the optimizer.

A backend takes `TrainSample`s (token ids, loss mask, behaviour log-probs, advantages), runs one
train step with the one loss of `trainer.algorithms`, hands its weights to the weight push and
saves/loads resumable checkpoints and final HF folders. `train_samples` turns a batch and its
advantages (computed in `trainer.algorithms`) into samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from trainer.buffer import Batch


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
    teacher_logprobs: list[float] | None = None
    """The segment's `teacher_logprobs`, when a teacher scored it."""

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
                            seg.token_ids, seg.loss_mask, seg.logprobs, a, seg.teacher_logprobs
                        )
                    )
    return samples


@runtime_checkable
class TrainBackend(Protocol):
    @property
    def step(self) -> int:
        """Train steps taken (= the weight version the backend holds)."""
        ...

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One step (num_minibatches optimizer steps, one LR-schedule step); returns metrics:
        `train/*` (loss, grad_norm, lr, ...) and the `mismatch/*` train-inference gap."""
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
