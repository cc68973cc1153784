"""The plain-torch train backend: an HF causal LM on CPU or one GPU.

One train step: the proximal log-probs are the policy's at the start of the step. With several
minibatches they come from a no-grad forward first; with one (the default) they *are* the
current log-probs, detached, since no update has happened yet, and that forward is skipped
(a quarter of the step's compute). The reference model's log-probs (KL term) come from a
no-grad forward. The batch is split into `num_minibatches` optimizer steps, each accumulated
over micro-batches that fit `micro_batch_tokens` padded tokens. Log-probs are those of the
sampling distribution, log_softmax(logits / temperature), exactly what the engine reports.
`bf16` keeps fp32 master weights and optimizer state and runs forward/backward under bf16
autocast.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.models import resolve_model
from trainer.algorithms import policy_loss, reduce_metrics
from trainer.backends.base import (
    TrainSample,
    check_samples,
    lr_factor,
    micro_batches,
    pad_rows,
    rng_state,
    set_rng_state,
)
from trainer.config import AlgorithmConfig, TrainBackendConfig, TrainerConfig

CHECKPOINT_FILE = "trainer.pt"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but no CUDA GPU is visible; use train.device=cpu")
    return torch.device(name)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    score_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-prob of each token given the previous ones, and its entropy if asked.

    Only positions where `score_mask` (default: attention_mask) is 1 are projected to the
    vocabulary; the others, and position 0, are 0. With a large vocabulary and long prompts or
    padding, the output projection is most of the cost, so skipping prompt and pad tokens pays.
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask)[0]
    select = (score_mask if score_mask is not None else attention_mask)[:, 1:] > 0
    h = hidden[:, :-1][select]  # [N, H]: the positions that predict a scored token
    logits = model.get_output_embeddings()(h).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:  # Gemma-2 style models cap logits before sampling
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, input_ids[:, 1:][select].unsqueeze(-1)).squeeze(-1) - lse
    shape = (input_ids.shape[0], input_ids.shape[1] - 1)
    logp = torch.zeros(shape, dtype=picked.dtype, device=picked.device)
    logp = torch.nn.functional.pad(logp.masked_scatter(select, picked), (1, 0))
    entropy = None
    if with_entropy:
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        entropy = torch.zeros(shape, dtype=ent.dtype, device=ent.device).masked_scatter(select, ent)
        entropy = torch.nn.functional.pad(entropy, (1, 0))
    return logp, entropy


class TorchBackend:
    """TrainBackend on plain torch; see the module docstring."""

    def __init__(
        self,
        model_path: str | Path,
        train: TrainBackendConfig,
        algorithm: AlgorithmConfig,
        *,
        temperature: float = 1.0,
        total_steps: int = 0,
        seed: int = 0,
    ) -> None:
        self.cfg = train
        self.algorithm = algorithm
        self.temperature = temperature
        self.device = _device(train.device)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.to(self.device)
        self.model.config.use_cache = False
        if train.gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
        self.model.train()  # HF only checkpoints in train mode; these models have no dropout
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.ref_model = None
        if algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=train.lr, weight_decay=train.weight_decay, foreach=False
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, train.warmup_steps, total_steps, train.lr_schedule),
        )
        self._step = 0

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> TorchBackend:
        """The backend of a run (`train.kind=torch`): cfg.model trained with cfg.train."""
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

    # -- forward helpers ------------------------------------------------------------------------

    def _autocast(self):
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bf16"
        )

    def _pad(self, rows: list[list[float]] | list[list[int]], value: float, dtype) -> torch.Tensor:
        return pad_rows(rows, value, dtype).to(self.device)

    def _inputs(self, rows: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._pad([s.token_ids for s in rows], self.pad_id, torch.long)
        attn = self._pad([[1] * len(s.token_ids) for s in rows], 0, torch.long)
        return ids, attn

    @torch.no_grad()
    def _score(
        self, model: torch.nn.Module, samples: list[TrainSample], only_loss: bool = True
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for mb in micro_batches(list(range(len(samples))), samples, self.cfg.micro_batch_tokens):
            rows = [samples[i] for i in mb]
            ids, attn = self._inputs(rows)
            mask = self._pad([s.loss_mask for s in rows], 0, torch.long) if only_loss else None
            with self._autocast():
                logp, _ = token_logprobs(model, ids, attn, self.temperature, score_mask=mask)
            for j, i in enumerate(mb):
                out[i] = logp[j, : len(samples[i].token_ids)].float()
        return out

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        return [t.tolist() for t in self._score(self.model, samples, only_loss=False)]

    # -- the train step -------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        check_samples(samples)
        separate_proximal = self.algorithm.num_minibatches > 1 and len(samples) > 1
        proximal = self._score(self.model, samples) if separate_proximal else None
        ref = self._score(self.ref_model, samples) if self.ref_model is not None else None
        lr = self.optimizer.param_groups[0]["lr"]
        k = min(self.algorithm.num_minibatches, len(samples))
        minibatches = [list(range(len(samples)))[j::k] for j in range(k)]
        outputs, grad_norms, losses = [], [], []
        for mini in minibatches:
            num_tokens = sum(sum(samples[i].loss_mask) for i in mini)
            num_seqs = sum(1 for i in mini if any(samples[i].loss_mask))
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for mb in micro_batches(mini, samples, self.cfg.micro_batch_tokens):
                rows = [samples[i] for i in mb]
                ids, attn = self._inputs(rows)
                mask = self._pad([s.loss_mask for s in rows], 0, torch.float32)
                behaviour = self._pad([s.logprobs for s in rows], 0.0, torch.float32)
                adv = self._pad([s.token_advantages() for s in rows], 0.0, torch.float32)
                with self._autocast():
                    logp, entropy = token_logprobs(
                        self.model,
                        ids,
                        attn,
                        self.temperature,
                        self.algorithm.entropy_coef > 0,
                        score_mask=mask,
                    )
                if proximal is None:
                    prox = logp.detach()
                else:
                    prox = self._pad([proximal[i].tolist() for i in mb], 0.0, torch.float32)
                out = policy_loss(
                    self.algorithm,
                    logp,
                    prox,
                    behaviour,
                    adv,
                    mask,
                    ref_logprobs=(
                        self._pad([ref[i].tolist() for i in mb], 0.0, torch.float32)
                        if ref
                        else None
                    ),
                    entropy=entropy,
                    num_tokens=max(num_tokens, 1),
                    num_seqs=max(num_seqs, 1),
                )
                out.loss.backward()
                loss_sum += out.loss.item()
                outputs.append((out.metrics, out.num_tokens))
            max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
            grad_norms.append(torch.nn.utils.clip_grad_norm_(self.params, max_norm).item())
            self.optimizer.step()
            losses.append(loss_sum)
        self.scheduler.step()
        self._step += 1
        metrics = reduce_metrics(outputs)
        metrics.update(
            {
                "train/loss": sum(losses) / len(losses),
                "train/grad_norm": sum(grad_norms) / len(grad_norms),
                "train/lr": lr,
                "train/tokens": float(sum(sum(s.loss_mask) for s in samples)),
                "train/sequences": float(len(samples)),
            }
        )
        return metrics

    # -- weights and checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self._step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "extra": extra,
        }
        tmp = path / f".{CHECKPOINT_FILE}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / CHECKPOINT_FILE)  # a crash mid-save leaves the old file intact

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        file = Path(path) / CHECKPOINT_FILE
        if not file.is_file():
            raise ValueError(f"run.resume: {file} does not exist; point it at a checkpoint folder")
        state = torch.load(file, map_location=self.device, weights_only=False)  # our own file
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self._step = state["step"]
        return state["extra"]

    def save_hf(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
