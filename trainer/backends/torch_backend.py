"""The plain-torch train backend: an HF causal LM on CPU or one GPU.

One train step: the proximal log-probs are the policy's at the start of the step. With several
minibatches they come from a no-grad forward first; with one (the default) they *are* the
current log-probs, detached, since no update has happened yet, and that forward is skipped
(a quarter of the step's compute). The reference model's log-probs (KL term) come from a
no-grad forward. The batch is split into `num_minibatches` optimizer steps, each accumulated
over micro-batches of at most `micro_batch_tokens` packed tokens. Log-probs are those of the
sampling distribution, log_softmax(logits / temperature), exactly what the engine reports.

Packing (`Pack`): a GRPO group's samples share their prompt, which is most of their tokens in
single-turn RL (quickstart: ~100 prompt tokens, 16-64 generated). A micro-batch row holds the
prompt once and every continuation of it after it; a 4D mask lets each continuation attend to
the prompt and its own earlier tokens only, at its own positions, so the log-probs and the
gradients are those of separate forwards (tests compare them with a padded one), for a
fraction of the FLOPs. The rows of a micro-batch may share more: every Calc-v0 prompt opens
with the same 58-token chat template. Their longest common prefix (`SHARED_PREFIX_MIN` tokens
or more) is computed once, and each row attends to its keys and values as its past (gradients
flow back through them). Only loss positions go through the LM head.

`dtype`: `bf16` keeps fp32 master weights and optimizer state and runs forward/backward under
bf16 autocast; `auto` asks `gateway.machine.auto_dtype` (bf16 only where native and faster).
Every step reports `perf/train_tflops` (FLOPs counted by `machine.ModelShape` for the tokens
the packed forwards compute, over the step's wall time) and `perf/mfu` (that over the measured
matmul rate of the model's gate/up projection: `base.step_metrics`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

from gateway import machine
from trainer.algorithms import policy_loss, reduce_metrics
from trainer.backends.base import (
    BackendBase,
    TrainSample,
    check_samples,
    lr_factor,
    pad_rows,
    peak_gflops,
    rng_state,
    set_rng_state,
    step_metrics,
    train_dtype,
)
from trainer.backends.lora import Lora, MergedSource
from trainer.config import AlgorithmConfig, TrainBackendConfig
from trainer.transfer.endpoints import StateDictSource

CHECKPOINT_FILE = "trainer.pt"


def train_device(name: str) -> torch.device:
    """`train.device` resolved (`auto`: cuda when available); a missing GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but no CUDA GPU is visible; use train.device=cpu")
    return torch.device(name)


SHARED_PREFIX_MIN = 16
"""Tokens the rows of a micro-batch must share at their start for that prefix to be computed
once (a forward of its own: below this, it saves less than it costs)."""


@dataclass
class Pack:
    """One micro-batch, packed: each row holds a prompt once and, after it, every continuation
    of it in the micro-batch (a GRPO group's samples share their prompt). A continuation's
    tokens attend to the prompt and to their own earlier tokens only, at the positions they
    have in their own sample, so each sample's log-probs are those of its own forward pass.
    The prefix all rows share (`prefix`) is in none of them: it is every row's past."""

    samples: list[int]
    """Indices of the samples in this micro-batch, in output order."""
    prefix: torch.Tensor
    """[1, P] token ids at positions 0..P-1 of every row's sample (P may be 0)."""
    input_ids: torch.Tensor
    """[R, W] token ids after the prefix, rows right-padded."""
    position_ids: torch.Tensor
    """[R, W] each token's position in its own sample."""
    mask: torch.Tensor
    """[R, 1, W, P + W] bool: query attends to key, the prefix's keys first (pads attend to
    themselves and the prefix only)."""
    where: list[torch.Tensor]
    """Per sample: the flat index (row * W + column) of each of its positions (those in the
    prefix, where no loss is, point at column 0 of its row)."""
    tokens: int
    """Real (non-pad) tokens in the prefix and the rows: what the forward must compute."""
    attended: int
    """Sum over real tokens of the keys each attends to (attention FLOPs)."""


def pack(
    samples: list[TrainSample], units: list[list[int]], device: torch.device, share: bool = True
) -> Pack:
    """Rows from `units` (sample indices sharing the tokens before their first loss token);
    with `share`, their common prefix is computed once when it is long enough. Each row keeps
    at least its last prompt token (whose hidden state predicts the first loss token)."""
    prompts = [samples[u[0]].token_ids[: _prompt_len(samples[u[0]])] for u in units]
    shared = 0
    if share and len(units) > 1:
        shared = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
        shared = shared if shared >= SHARED_PREFIX_MIN else 0
    rows, where_rows = [], []
    for unit, prompt_ids in zip(units, prompts, strict=True):
        prompt = len(prompt_ids)
        tokens = list(prompt_ids[shared:])
        positions, branch = list(range(shared, prompt)), [0] * (prompt - shared)
        cols = [0] * shared + list(range(prompt - shared))  # the prompt's, in the row
        for b, i in enumerate(unit, start=1):
            ids = samples[i].token_ids
            start = len(tokens)
            where_rows.append((len(rows), cols + list(range(start, start + len(ids) - prompt))))
            tokens += ids[prompt:]
            positions += range(prompt, len(ids))
            branch += [b] * (len(ids) - prompt)
        rows.append((tokens, positions, branch))
    width = max(len(t) for t, _, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    br = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, (t, p, b) in enumerate(rows):
        ids[r, : len(t)], pos[r, : len(t)], br[r, : len(t)] = (
            torch.tensor(t),
            torch.tensor(p),
            torch.tensor(b),
        )
    col = torch.arange(width)
    causal = col[None, :] <= col[:, None]
    same = (br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])
    real = br >= 0
    mask = causal & same & real[:, None, :] & real[:, :, None]
    tokens = int(real.sum())
    attended = int(mask.sum()) + tokens * shared + machine.causal_attended([shared])
    mask |= torch.eye(width, dtype=torch.bool)  # pad rows attend to something (no NaN)
    mask = torch.cat([torch.ones(len(rows), width, shared, dtype=torch.bool), mask], dim=2)
    where = [torch.tensor(cols, device=device) + r * width for r, cols in where_rows]
    return Pack(
        samples=[i for unit in units for i in unit],
        prefix=torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device),
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        mask=mask[:, None].to(device),
        where=where,
        tokens=tokens + shared,
        attended=attended,
    )


def prefix_cache(model: torch.nn.Module, prefix: torch.Tensor, rows: int) -> DynamicCache | None:
    """The keys and values of `prefix` ([1, P] ids at positions 0..P-1), computed once, as the
    past of each of `rows` rows (their gradients flow back through it); None if P is 0."""
    if prefix.shape[1] == 0:
        return None
    once = DynamicCache(config=model.config)
    positions = torch.arange(prefix.shape[1], device=prefix.device)[None]
    model.base_model(input_ids=prefix, position_ids=positions, cache=once, use_cache=True)
    return DynamicCache(
        ddp_cache_data=[
            (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
            for layer in once.layers
        ]
    )


def _prompt_len(sample: TrainSample) -> int:
    """Tokens before the first loss token (all of them if none is trained)."""
    return next((j for j, m in enumerate(sample.loss_mask) if m), len(sample.token_ids))


def token_logprobs(
    model: torch.nn.Module,
    packed: Pack,
    samples: list[TrainSample],
    temperature: float,
    with_entropy: bool = False,
    only_loss: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """[S, T] log-prob of each token of the packed samples given the previous ones, its
    entropy if asked, and how many positions went through the LM head.

    Only loss positions (all positions unless `only_loss`) are projected to the vocabulary;
    the others, position 0 and padding are 0. With a large vocabulary and long prompts, the
    output projection is most of the cost, so skipping prompt tokens pays.
    """
    hidden = model.base_model(
        input_ids=packed.input_ids,
        attention_mask=packed.mask,
        position_ids=packed.position_ids,
        cache=prefix_cache(model, packed.prefix, packed.input_ids.shape[0]),
    )[0]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    rows = [samples[i] for i in packed.samples]
    width = max(len(s.token_ids) for s in rows)
    select = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for r, s in enumerate(rows):
        select[r, : len(s.token_ids) - 1] = (
            torch.tensor(s.loss_mask[1:], dtype=torch.bool) if only_loss else True
        )
    select = select.to(hidden.device)
    index = torch.cat([w[:-1][select[r, : len(w) - 1]] for r, w in enumerate(packed.where)])
    flat = packed.input_ids.reshape(-1)
    targets = torch.cat([flat[w[1:]][select[r, : len(w) - 1]] for r, w in enumerate(packed.where)])
    softcap = getattr(model.config, "final_logit_softcapping", None) or 0.0
    head = model.get_output_embeddings()
    picked, ent = VocabLogprobs.apply(
        hidden[index], head.weight, head.bias, targets, temperature, softcap, with_entropy
    )
    shape = (len(rows), width - 1)
    logp = torch.zeros(shape, dtype=picked.dtype, device=picked.device)
    logp = torch.nn.functional.pad(logp.masked_scatter(select, picked), (1, 0))
    entropy = None
    if with_entropy:
        entropy = torch.zeros(shape, dtype=ent.dtype, device=ent.device).masked_scatter(select, ent)
        entropy = torch.nn.functional.pad(entropy, (1, 0))
    return logp, entropy, int(index.numel())


VOCAB_CHUNK_ELEMENTS = 2**24
"""Logits computed at once in `VocabLogprobs`' forward (rows x vocabulary, 64 MB in fp32)."""


class VocabLogprobs(torch.autograd.Function):
    """`log_softmax(head(hidden) / T)` at each target, and if asked the entropy of each row's
    distribution, for an LM head `weight` [V, H] (and `bias`); Gemma-2's `softcap` first.

    What autograd would compute, in one [N, V] fp32 buffer: the forward makes the logits a
    chunk of rows at a time, turns them into probabilities in place and keeps them; the
    backward turns those into the logits' gradient in place, then two matmuls. Autograd's chain
    (divide, logsumexp, gather and their backwards) allocates and sweeps several such buffers:
    forward + backward of 2659 rows of SmolLM2 took 6.0 s that way against 4.2 s this way
    (matmuls included, 1 thread, the 2-core Xeon). The log-prob is `(z_t - max) - log(sum
    exp(z - max))`, as `megatron/logprobs.py` computes it. Under autocast the matmuls run in
    the autocast dtype, as the `nn.Linear` they replace would."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, with_entropy):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False):
            h, w = (hidden, weight) if dtype is None else (hidden.to(dtype), weight.to(dtype))
            n, vocab = h.shape[0], w.shape[0]
            probs = torch.empty(n, vocab, dtype=torch.float32, device=hidden.device)
            capped = torch.empty_like(probs) if softcap else None
            logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
            entropy = torch.empty(n if with_entropy else 0, device=hidden.device)
            step = max(1, VOCAB_CHUNK_ELEMENTS // vocab)
            for a in range(0, n, step):
                z, b = probs[a : a + step], min(a + step, n)
                if z.dtype == h.dtype:
                    torch.mm(h[a:b], w.T, out=z)
                else:
                    z.copy_(h[a:b] @ w.T)
                if bias is not None:
                    z.add_(bias)
                if softcap:
                    capped[a:b] = z.div_(softcap).tanh_()
                    z.mul_(softcap)
                z.div_(temperature)
                z.sub_(z.amax(-1, keepdim=True))
                picked = z.gather(-1, targets[a:b, None]).squeeze(-1)
                total = z.exp_().sum(-1, keepdim=True)
                logp[a:b] = picked - total.log().squeeze(-1)
                z.div_(total)
                if with_entropy:
                    entropy[a:b] = -torch.xlogy(z, z).sum(-1)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(h, w, targets, probs, entropy, capped)
        ctx.dtypes, ctx.temperature = (hidden.dtype, weight.dtype), temperature
        ctx.bias = bias is not None
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, w, targets, probs, entropy, capped = ctx.saved_tensors
        with torch.autocast(h.device.type, enabled=False):
            # d logp_t / dz = onehot_t - p;  d H / dz = -p (log p + H); in place of p
            by_entropy = None
            if entropy.numel() and grad_entropy is not None:
                by_entropy = torch.xlogy(probs, probs).add_(probs * entropy[:, None])
                by_entropy.mul_(-grad_entropy[:, None])
            grad = probs.mul_(-grad_logp[:, None])
            grad.scatter_add_(-1, targets[:, None], grad_logp[:, None])
            if by_entropy is not None:
                grad.add_(by_entropy)
            grad.div_(ctx.temperature)
            if capped is not None:
                grad.mul_(capped.square_().neg_().add_(1))
            need = ctx.needs_input_grad  # a frozen LM head (LoRA) needs no weight gradient
            grad_bias = grad.sum(0) if ctx.bias and need[2] else None
            grad = grad.to(h.dtype)
            grad_hidden = (grad @ w).to(ctx.dtypes[0]) if need[0] else None
            grad_weight = (grad.T @ h).to(ctx.dtypes[1]) if need[1] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


class TorchBackend(BackendBase):
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
        self.device = train_device(train.device)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.to(self.device)
        self.model.config.use_cache = False
        self.dtype = train_dtype(train.dtype, self.device)
        self.shape = machine.ModelShape.from_config(self.model.config)
        self.peak_gflops = peak_gflops(self.shape, self.dtype, self.device)
        """The MFU denominator: this machine's matmul rate on the model's widest linear layer."""
        self._flops = 0
        if train.gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
        self.model.train()  # HF only checkpoints in train mode; these models have no dropout
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.ref_model = None
        if algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.lora = Lora(self.model, train.lora_rank, train.lora_alpha) if train.lora_rank else None
        trained = self.model if self.lora is None else self.lora
        self.params = [p for p in trained.parameters() if p.requires_grad]
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        if head is not None and embed.weight is head.weight:
            # The lookup's gradient as sparse rows, added onto the LM head's dense one (the
            # head is in every backward, with no loss position too, so the sum is dense): no
            # dense [vocab, hidden] zeros + scatter + add, ~15% of a quickstart step here.
            embed.sparse = True
        # fused: one kernel over all parameters, ~9x the per-parameter loop on a 2-core EPYC
        # (SmolLM2's 135M parameters, 1 thread: 0.23 s a step instead of 2.1 s).
        self.optimizer = torch.optim.AdamW(
            self.params, lr=train.lr, weight_decay=train.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, train.warmup_steps, total_steps, train.lr_schedule),
        )
        self._step = 0
        self._cores: machine.CoreBoard | None = None
        self._own_threads = self._threads = torch.get_num_threads()
        self._thread_checks: list[int] = []

    def share_cores(self, board: machine.CoreBoard) -> None:
        """Compute with the cores of the idle processes on `board` too (CPU lending: a CPU
        run's engines lend theirs while they have nothing to generate). The thread count is
        re-read from the board before each decoder layer's forward and backward, and goes back
        to this process's own after each step; the backend is marked busy on the board while
        it computes (so an engine may borrow its cores while it waits). `perf/mfu` is then over
        the peak of its own threads times the step's mean threads over them (`perf/threads`)."""
        if self.device.type != "cpu":
            raise ValueError(f"borrowing CPU cores needs train.device=cpu, not {self.device}")
        self._cores = board
        board.mark(busy=False, cores=self._own_threads)
        layers = [m for m in self.model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in layers or [self.model]:
            layer.register_forward_pre_hook(lambda *_: self._borrow())
            layer.register_forward_hook(self._borrow_in_backward)

    def _borrow(self, *_: Any) -> None:
        assert self._cores is not None
        threads = self._own_threads + self._cores.idle_cores()
        if threads != self._threads:
            torch.set_num_threads(threads)  # this thread's; backward on CPU runs on it too
            self._threads = threads
        self._thread_checks.append(threads)

    def _borrow_in_backward(self, module: Any, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._borrow)  # runs just before this layer's backward

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        """Busy on the board while computing; this process's own threads again afterwards."""
        if self._cores is None:
            yield
            return
        self._cores.mark(busy=True, cores=self._own_threads)
        try:
            yield
        finally:
            torch.set_num_threads(self._own_threads)
            self._threads = self._own_threads
            self._cores.mark(busy=False, cores=self._own_threads)

    def _thread_metrics(self) -> dict[str, float]:
        """The step's mean thread count over its layers, when borrowing."""
        checks, self._thread_checks = self._thread_checks, []
        return {"perf/threads": sum(checks) / len(checks)} if checks else {}

    # -- forward helpers ------------------------------------------------------------------------

    def _autocast(self):
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16
        )

    def _pad(self, rows: list[list[float]] | list[list[int]], value: float, dtype) -> torch.Tensor:
        return pad_rows(rows, value, dtype).to(self.device)

    def _packs(self, idx: list[int], samples: list[TrainSample], share: bool = True) -> list[Pack]:
        """Micro-batches of `micro_batch_tokens` packed tokens (rows * widest row, padding
        included). Samples with the same prompt share a row (split when it would not fit);
        rows are packed greedily, longest first. With `share`, the rows' common prefix is
        computed once (not under gradient checkpointing, which would recompute the rows'
        forward onto the same cache)."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i in idx:
            by_prompt.setdefault(tuple(samples[i].token_ids[: _prompt_len(samples[i])]), []).append(
                i
            )
        units: list[tuple[int, list[int]]] = []  # (packed length, samples)
        for prompt, members in by_prompt.items():
            length, unit = len(prompt), []
            for i in members:
                tail = len(samples[i].token_ids) - len(prompt)
                if unit and length + tail > self.cfg.micro_batch_tokens:
                    units.append((length, unit))
                    length, unit = len(prompt), []
                length += tail
                unit.append(i)
            units.append((length, unit))
        units.sort(key=lambda u: -u[0])
        batches: list[list[tuple[int, list[int]]]] = []
        for unit in units:
            if (
                batches
                and batches[-1][0][0] * (len(batches[-1]) + 1) <= self.cfg.micro_batch_tokens
            ):
                batches[-1].append(unit)  # the first unit is the widest, since sorted
            else:
                batches.append([unit])
        share = share and not self.cfg.gradient_checkpointing
        return [pack(samples, [u for _, u in batch], self.device, share) for batch in batches]

    @torch.no_grad()
    def _score(
        self, model: torch.nn.Module, samples: list[TrainSample], only_loss: bool = True
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for mb in self._packs(list(range(len(samples))), samples, share=only_loss):
            with self._autocast():
                logp, _, logits = token_logprobs(
                    model, mb, samples, self.temperature, only_loss=only_loss
                )
            self._flops += self.shape.forward_flops(mb.tokens, logits, mb.attended)
            for j, i in enumerate(mb.samples):
                out[i] = logp[j, : len(samples[i].token_ids)].float()
        return out

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        with self._computing():
            out = [t.tolist() for t in self._score(self.model, samples, only_loss=False)]
        self._thread_checks.clear()
        return out

    # -- the train step -------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        with self._computing():
            return self._train_step(samples)

    def _train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        check_samples(samples)
        start, self._flops = time.perf_counter(), 0
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
            for packed in self._packs(mini, samples):
                mb = packed.samples
                rows = [samples[i] for i in mb]
                mask = self._pad([s.loss_mask for s in rows], 0, torch.float32)
                behaviour = self._pad([s.logprobs for s in rows], 0.0, torch.float32)
                lag = self._pad([s.lags(self._step) for s in rows], 0, torch.long)
                adv = self._pad([s.token_advantages() for s in rows], 0.0, torch.float32)
                with self._autocast():
                    logp, entropy, logits = token_logprobs(
                        self.model,
                        packed,
                        samples,
                        self.temperature,
                        self.algorithm.entropy_coef > 0,
                    )
                self._flops += self.shape.train_flops(
                    packed.tokens, logits, packed.attended, frozen=self.lora is not None
                )
                if self.lora is not None:
                    self._flops += 3 * packed.tokens * self.lora.flops_per_token
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
                    lag=lag,
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
        seconds = time.perf_counter() - start
        threads = self._thread_metrics()
        cores = threads.get("perf/threads", self._own_threads) / self._own_threads
        metrics = step_metrics(
            samples, losses, grad_norms, lr, self._flops, seconds, self.peak_gflops, cores
        )
        return reduce_metrics(outputs) | metrics | threads

    # -- weights and checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights by HF name (with LoRA: merged)."""
        state = self.model.state_dict()
        if self.lora is not None:
            return self.lora.merged(state)
        return {k: v.detach() for k, v in state.items()}

    def weight_source(self) -> StateDictSource | MergedSource:
        """The push's view of the weights: the parameters themselves, which the shm route may
        move into its segment (the optimizer then updates them there); with LoRA, the base
        weights merged with the adapters as they are read."""
        state = self.model.state_dict(keep_vars=True)
        return StateDictSource(state) if self.lora is None else MergedSource(state, self.lora)

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self._step,
            "model": self.model.state_dict(),
            "lora": self.lora.state_dict() if self.lora is not None else None,
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
        if (state.get("lora") is None) != (self.lora is None):
            raise ValueError(
                f"run.resume: {file} was saved with{'out' if self.lora else ''} LoRA; resume "
                "with the train.lora_rank it was trained with"
            )
        self.model.load_state_dict(state["model"])
        if self.lora is not None:
            self.lora.load_state_dict(state["lora"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self._step = state["step"]
        return state["extra"]

    def save_hf(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=self.state_dict())
        self.tokenizer.save_pretrained(path)
