"""Train backends: what the controller needs from whatever holds the weights and the optimizer.

A backend takes `TrainSample`s (token ids, loss mask, behaviour log-probs, advantage), runs one
train step with the one loss of `trainer.algorithms`, hands its weights to the weight push and
saves/loads resumable checkpoints and final HF folders. `make_backend` picks one by
`train.kind`: `torch` (CPU or one GPU, trainer/backends/torch_backend.py) or `megatron`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from trainer.algorithms import group_advantages
from trainer.buffer import Batch
from trainer.config import TrainerConfig


@dataclass
class TrainSample:
    """One segment to train on, with its trajectory's advantage."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """Behaviour log-probs (the engine's), aligned with token_ids; 0.0 where loss_mask is 0."""
    advantage: float


def samples_from_batch(batch: Batch, advantage: str = "grpo") -> list[TrainSample]:
    """Group-normalized advantages per group, broadcast to every segment of each trajectory."""
    samples = []
    for group in batch.groups:
        adv = group_advantages(torch.tensor([group.rewards]), advantage)[0].tolist()
        for traj, a in zip(group.trajectories, adv, strict=True):
            for seg in traj.segments:
                if any(seg.loss_mask):
                    samples.append(TrainSample(seg.token_ids, seg.loss_mask, seg.logprobs, a))
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


class MegatronBackend:
    """Placeholder for the megatron-core backend (GPU, tensor/pipeline parallel)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "train.kind=megatron needs the megatron extra and a GPU "
            "(pip install -e '.[megatron]' on a CUDA machine); on CPU use train.kind=torch"
        )


def make_backend(cfg: TrainerConfig) -> TrainBackend:
    """The backend `cfg.train.kind` names, loaded with cfg.model."""
    from gateway.models import resolve_model

    if cfg.train.kind == "megatron":
        return MegatronBackend(cfg)  # type: ignore[return-value]
    from trainer.backends.torch_backend import TorchBackend

    return TorchBackend(
        resolve_model(cfg.model.name),
        cfg.train,
        cfg.algorithm,
        temperature=cfg.rollout.temperature,
        total_steps=cfg.run.steps,
        seed=cfg.run.seed,
    )
