"""Train backends, chosen by `train.kind` from `TRAIN_BACKENDS`.

`torch` (CPU or one GPU, trainer/backends/torch_backend.py) and `megatron` (megatron-core,
tensor/pipeline/data parallel, trainer/backends/megatron/; one rank per process, started by
trainer/cluster.py). A kind is a lazy entry point (`gateway/registry.py`) that
builds a `TrainBackend` (trainer/backends/base.py) from the run's `TrainerConfig` (both kinds
inherit `BackendBase.from_config`); a new one is a module and one `register` line here, with
`parallel=True` when it runs as several ranks (`train.tensor_parallel` and friends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.registry import Registry
from trainer.backends.base import TrainBackend, TrainSample, train_samples

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

TRAIN_BACKENDS: Registry[TrainBackend] = Registry("train.kind")
TRAIN_BACKENDS.register(
    "torch", "trainer.backends.torch_backend:TorchBackend.from_config", parallel=False, lora=True
)
TRAIN_BACKENDS.register(
    "megatron",
    "trainer.backends.megatron.backend:MegatronBackend.from_config",
    parallel=True,
    cpu_bf16=False,  # megatron-core's CPU path (gloo, no Transformer Engine) is fp32 only
)


def make_backend(cfg: TrainerConfig) -> TrainBackend:
    """The backend `cfg.train.kind` names, loaded with cfg.model."""
    return TRAIN_BACKENDS.build(cfg.train.kind, cfg)


__all__ = ["TRAIN_BACKENDS", "TrainBackend", "TrainSample", "make_backend", "train_samples"]
