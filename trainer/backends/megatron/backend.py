"""One rank of the megatron-core train backend (`train.kind=megatron`).

Every rank runs this class with the same arguments and the same calls (SPMD): `trainer/cluster.py`
starts `tensor_parallel * pipeline_parallel * data_parallel` of them as Ray actors and sends each
call to all; with one rank it also runs in the caller's process. The ranks find each other
through `torch.distributed` (env:// — RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NCCL on GPUs,
gloo on CPU) and Megatron's `parallel_state` splits them into tensor, pipeline and data parallel
groups.

A train step, on each rank:
- every rank receives every sample; data-parallel rank d trains on its share (samples dealt
  longest first, round robin), packed into micro-batches of at most `micro_batch_tokens` padded
  tokens; the loss is normalized by the token (or sequence) count of the whole minibatch, as in
  the torch backend, so the shares add up;
- Megatron's pipeline schedule (`get_forward_backward_func`: plain micro-batch accumulation
  without pipeline parallelism, 1F1B with it) runs forward and backward; the last stage projects
  only the positions that predict a scored token onto the vocabulary (a hook on the output
  layer) and calls `trainer.algorithms.policy_loss`, the same loss as the torch backend;
- the schedule divides each micro-batch loss by the number of micro-batches and Megatron's DDP
  averages gradients over data-parallel ranks; policy_loss's shares are meant to be summed, so
  each is multiplied by (micro-batches x data-parallel size) first;
- gradients are reduced by Megatron's DDP (reduce-scatter into the distributed optimizer on GPU,
  all-reduce on CPU), the norm is clipped across model-parallel ranks, and the optimizer steps.
Metrics are gathered from the last stage's first TP rank of every data-parallel rank and merged
with `reduce_metrics`, so every rank returns the same numbers. `perf/*` as in the torch backend,
with the FLOPs the padded micro-batches compute, and `perf/mfu` over the peak of one device
(measured by each rank at start) times the number of ranks (on CPU the ranks share its cores).

Weights out: `hf_tensors()` yields this stage's weights under their HF names, full size (TP
shards all-gathered; every TP rank of the stage iterates together); `state_dict()` gathers every
stage's onto global rank 0 (the others return {}). Checkpoints are one file per rank (model
shard, optimizer, RNG) and need the same parallel layout to resume; `save_hf` writes an HF
folder from rank 0.

On a machine without CUDA the few CPU workarounds of `compat.py` are installed; fp32 only there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from gateway import machine
from trainer.algorithms import policy_loss, reduce_metrics
from trainer.backends.base import (
    BackendBase,
    TrainSample,
    check_samples,
    lr_factor,
    micro_batches,
    pad_rows,
    peak_gflops,
    rng_state,
    set_rng_state,
    step_metrics,
    train_dtype,
)
from trainer.backends.megatron import compat
from trainer.backends.megatron.convert import (
    Param,
    hf_shapes,
    megatron_name,
    params,
    shard,
    stage_of,
    unshard,
)
from trainer.backends.megatron.logprobs import vocab_parallel_logprobs
from trainer.backends.megatron.model import (
    Arch,
    build_model,
    transformer_config,
    use_transformer_engine,
)
from trainer.config import AlgorithmConfig, TrainBackendConfig
from trainer.transfer.buckets import TensorSpec, dtype_name

CHECKPOINT_DIR = "megatron"


@dataclass
class _MicroBatch:
    """One micro-batch, as tensors on the device; `index` are the sample indices of its rows."""

    index: list[int]
    lengths: list[int]
    ids: torch.Tensor
    positions: torch.Tensor
    select: torch.Tensor
    """[B, T-1] bool: positions whose next token is projected onto the vocabulary."""
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    lag: torch.Tensor
    """[B, T] versions each token lags the weights being trained (0: fresh)."""
    proximal: torch.Tensor | None = None
    ref: torch.Tensor | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp: int, pp: int, dp: int, cuda: bool) -> None:
    """torch.distributed (env:// when MASTER_ADDR is set, else a group of one) and Megatron's
    parallel groups; a process that already has them with other sizes gets new ones."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, init_method="env://")
        else:
            url = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(backend, init_method=url, rank=0, world_size=1)
    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ValueError(
            f"train.tensor_parallel={tp} x pipeline_parallel={pp} x data_parallel={dp} = "
            f"{tp * pp * dp} ranks, but {world} started; with more than one rank use "
            "ray.enabled=true (trainer/cluster.py starts them)"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
        ):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )


class _HFReader:
    """Tensors of an HF folder's safetensors files, read one at a time by name."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ValueError(
                f"train.kind=megatron reads safetensors; {folder} has none (save the model "
                "with save_pretrained(..., safe_serialization=True))"
            )
        self.handles = [safe_open(str(folder / f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}  # noqa: SIM118

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"the model folder has no tensor {name!r}")
        return self.where[name].get_tensor(name)


class MegatronBackend(BackendBase):
    """TrainBackend on megatron-core, one rank of it; see the module docstring."""

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
        try:
            from megatron.core import parallel_state
        except ImportError:
            raise ValueError(
                "train.kind=megatron needs megatron-core: pip install -e '.[megatron]'"
            ) from None

        self.cuda = torch.cuda.is_available()
        if train.dtype == "auto":  # bf16 where native and faster on a GPU; fp32 on CPU (its only)
            bf16 = self.cuda and train_dtype("auto", "cuda") == torch.bfloat16
            train = replace(train, dtype="bf16" if bf16 else "fp32")
        self.cfg = train
        self.algorithm = algorithm
        self.temperature = temperature
        self.total_steps = total_steps
        self.model_path = Path(model_path)
        if train.device == "cpu" and self.cuda:
            raise ValueError(
                "train.device=cpu: the megatron backend runs on the GPUs it is given; "
                "use train.kind=torch to train on the CPU of a CUDA machine"
            )
        if train.device.startswith("cuda") and not self.cuda:
            raise ValueError(f"train.device={train.device} but no CUDA GPU is visible")
        if not self.cuda:
            if train.dtype != "fp32":
                raise ValueError(
                    "train.dtype=bf16 with train.kind=megatron needs CUDA; use fp32 on CPU"
                )
            compat.install()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else None
        tp, pp = train.tensor_parallel, train.pipeline_parallel
        init_parallel(tp, pp, train.data_parallel, self.cuda)
        if self.cuda:
            from megatron.core import tensor_parallel

            torch.manual_seed(seed)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            compat.seed(seed)

        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.arch = Arch.from_hf(self.hf_config)
        self.shape = machine.ModelShape.from_config(self.hf_config)
        dtype = torch.bfloat16 if train.dtype == "bf16" else torch.float32
        self.peak_gflops = peak_gflops(self.shape, dtype, self.device or "cpu")
        """One device's matmul rate on the widest linear layer: the MFU denominator per rank."""
        self.arch.check_parallel(tp, pp)
        self.tp, self.pp = tp, pp
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.layer_offset = self.pp_rank * (self.arch.num_layers // pp)
        self.te = use_transformer_engine()
        self.config = transformer_config(
            self.arch, tp=tp, pp=pp, bf16=train.dtype == "bf16", cuda=self.cuda
        )
        if train.gradient_checkpointing:
            self.config.recompute_granularity = "full"
            self.config.recompute_method = "uniform"
            self.config.recompute_num_layers = 1

        reader = _HFReader(self.model_path)
        model = self._build(reader)
        self.model = self._wrap_ddp(model)
        self.ref_model = None
        if algorithm.kl_coef > 0:
            self.ref_model = self._build(reader).eval().requires_grad_(False)
        self.optimizer = self._make_optimizer()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self._step = 0
        self._select: torch.Tensor | None = None

    # -- building -------------------------------------------------------------------------------

    def _build(self, reader: _HFReader) -> torch.nn.Module:
        """This stage's GPTModel with the HF weights loaded, on the device."""
        model = build_model(
            self.arch,
            self.config,
            te=self.te,
            pre_process=self.first_stage,
            post_process=self.last_stage,
        )
        if self.device is not None:
            model.to(self.device)
        own = dict(model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for param in params(self.arch, self.te):
                name = megatron_name(param, self.layer_offset)
                if name not in own:
                    continue
                hf = [reader(n) for n in param.hf]
                own[name].copy_(shard(self.arch, param, hf, self.tp_rank, self.tp))
                loaded.add(name)
        missing = set(own) - loaded
        assert not missing, f"parameters the converter does not fill: {sorted(missing)}"
        if self.last_stage:
            model.output_layer.register_forward_pre_hook(self._select_positions)
        if self.first_stage and self.arch.padding_idx is not None:
            model.embedding.word_embeddings.register_forward_hook(self._no_padding_grad)
        return model

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.distributed.distributed_data_parallel_config import (
            DistributedDataParallelConfig,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cuda,
        )
        ddp = DistributedDataParallel(self.config, ddp_config, model)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = ddp.no_sync
        return ddp

    def _make_optimizer(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.cuda:
            return compat.CpuOptimizer(
                params, self.cfg.lr, self.cfg.weight_decay, self.cfg.grad_clip
            )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        bf16 = self.cfg.dtype == "bf16"
        return get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=self.cfg.lr,
                weight_decay=self.cfg.weight_decay,
                clip_grad=self.cfg.grad_clip,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )

    # -- forward --------------------------------------------------------------------------------

    def _select_positions(self, module: torch.nn.Module, args: tuple) -> tuple:
        """Output-layer pre-hook: keep the hidden states [T, B, H] of positions that predict a
        scored token, as [N, 1, H], so that only those are projected onto the vocabulary."""
        hidden, *rest = args
        picked = hidden[:-1].transpose(0, 1)[self._select]
        return (picked.unsqueeze(1), *rest)

    def _no_padding_grad(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        """Embedding forward hook: HF's padding_idx rule, no gradient to the pad token's row
        from lookups (model.py)."""
        if out.requires_grad:
            keep = (args[0] != self.arch.padding_idx).unsqueeze(-1).to(out.dtype)
            out.register_hook(lambda grad: grad * keep)

    def _micro_batches(
        self, idx: list[int], samples: list[TrainSample], *, only_loss: bool = True
    ) -> list[_MicroBatch]:
        out = []
        for mb in micro_batches(idx, samples, self.cfg.micro_batch_tokens):
            rows = [samples[i] for i in mb]
            ids = pad_rows([s.token_ids for s in rows], self.pad_id, torch.long)
            mask = pad_rows([s.loss_mask for s in rows], 0, torch.float32)
            if only_loss:
                select = mask[:, 1:] > 0
            else:
                select = pad_rows([[1] * len(s.token_ids) for s in rows], 0, torch.long)
                select = select[:, 1:] > 0
            adv = pad_rows([s.token_advantages() for s in rows], 0.0, torch.float32)
            batch = _MicroBatch(
                index=mb,
                lengths=[len(s.token_ids) for s in rows],
                ids=ids,
                positions=torch.arange(ids.shape[1]).expand_as(ids),
                select=select,
                mask=mask,
                behaviour=pad_rows([s.logprobs for s in rows], 0.0, torch.float32),
                advantages=adv,
                lag=pad_rows([s.lags(self._step) for s in rows], 0, torch.long),
            )
            out.append(self._to_device(batch))
        return out

    def _to_device(self, batch: _MicroBatch) -> _MicroBatch:
        if self.device is None:
            return batch
        for name, value in vars(batch).items():
            if isinstance(value, torch.Tensor):
                setattr(batch, name, value.to(self.device, non_blocking=True))
        return batch

    def _forward(self, model: torch.nn.Module, batch: _MicroBatch) -> torch.Tensor:
        self._select = batch.select
        mask = None if self.cuda else compat.causal_mask(batch.ids.shape[1])
        return model(batch.ids, batch.positions, mask)

    def _logprobs(self, batch: _MicroBatch, logits: torch.Tensor, with_entropy: bool):
        """[B, T] log-probs (and entropy) of the selected positions, 0 elsewhere and at 0."""
        targets = batch.ids[:, 1:][batch.select]
        logp, entropy = vocab_parallel_logprobs(
            logits.squeeze(0),
            targets,
            vocab_size=self.arch.vocab_size,
            temperature=self.temperature,
            with_entropy=with_entropy,
        )

        def spread(values: torch.Tensor) -> torch.Tensor:
            shape = (batch.ids.shape[0], batch.ids.shape[1] - 1)
            full = torch.zeros(shape, dtype=values.dtype, device=values.device)
            return torch.nn.functional.pad(full.masked_scatter(batch.select, values), (1, 0))

        return spread(logp), spread(entropy) if entropy is not None else None

    def _schedule(self, model: torch.nn.Module, batches: list[_MicroBatch], step_fn, forward_only):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=step_fn,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=max(b.ids.shape[1] for b in batches),
            micro_batch_size=max(b.ids.shape[0] for b in batches),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, batches: list[_MicroBatch]) -> dict[int, torch.Tensor]:
        """Sample index -> its log-probs (on the last stage; {} elsewhere)."""

        def step_fn(data: Iterator[_MicroBatch], m: torch.nn.Module):
            batch = next(data)
            out = self._forward(m, batch)

            def collect(logits: torch.Tensor):
                logp, _ = self._logprobs(batch, logits, with_entropy=False)
                return logits.new_zeros(()), {"batch": batch, "logp": logp}

            return out, collect

        got = self._schedule(model, batches, step_fn, forward_only=True)
        rows: dict[int, torch.Tensor] = {}
        for item in got if self.last_stage else []:
            batch = item["batch"]
            for j, (i, n) in enumerate(zip(batch.index, batch.lengths, strict=True)):
                rows[i] = item["logp"][j, :n]
        return rows

    def _my_share(self, idx: list[int], samples: list[TrainSample]) -> list[int]:
        """This data-parallel rank's samples of `idx`: dealt longest first, round robin."""
        order = sorted(idx, key=lambda i: -len(samples[i].token_ids))
        return order[self.dp_rank :: self.dp]

    def _gather(self, value: Any) -> list[Any]:
        """`value` of every rank (small Python objects)."""
        if dist.get_world_size() == 1:
            return [value]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    @property
    def _reports(self) -> bool:
        """Whether this rank's results are its data-parallel rank's (one per DP rank)."""
        return self.last_stage and self.tp_rank == 0

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        mine = self._my_share(list(range(len(samples))), samples)
        rows = {}
        if mine:
            batches = self._micro_batches(mine, samples, only_loss=False)
            rows = self._score(self.model, batches)
        lists = {i: row.tolist() for i, row in rows.items()}
        merged: dict[int, list[float]] = {}
        for part in self._gather(lists if self._reports else {}):
            merged.update(part)
        return [merged[i] for i in range(len(samples))]

    # -- the train step -------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        check_samples(samples)
        lr = self.cfg.lr * lr_factor(
            self._step, self.cfg.warmup_steps, self.total_steps, self.cfg.lr_schedule
        )
        for group in self.optimizer.param_groups:
            # Megatron's groups carry multipliers (no weight decay on biases and norms) that
            # its own LR scheduler applies; the CPU optimizer's one group has none.
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)
        start, flops, counted = time.perf_counter(), 0, 0
        k = min(self.algorithm.num_minibatches, len(samples))
        minibatches = [list(range(len(samples)))[j::k] for j in range(k)]
        shares = [self._my_share(mini, samples) for mini in minibatches]
        proximal = None
        if k > 1:  # the policy before this step's first update
            everything = sorted(i for share in shares for i in share)
            scored = self._micro_batches(everything, samples)
            proximal = self._score(self.model, scored)
            flops += self._flops(scored)
        outputs: list[tuple[dict[str, float], int]] = []
        losses, grad_norms = [], []
        for mini, mine in zip(minibatches, shares, strict=True):
            batches = self._micro_batches(mine, samples) if mine else self._blank()
            ref = self._score(self.ref_model, batches) if self.ref_model is not None else None
            flops += self._flops(batches, train=True)
            if self.ref_model is not None:
                flops += self._flops(batches)
            if self.last_stage:
                for batch in batches:
                    batch.proximal = self._rows(proximal, batch) if proximal else None
                    batch.ref = self._rows(ref, batch) if ref is not None else None
            num_tokens = sum(sum(samples[i].loss_mask) for i in mini)
            num_seqs = sum(1 for i in mini if any(samples[i].loss_mask))
            loss_sum, mb_outputs = self._train_minibatch(
                batches, max(num_tokens, 1), max(num_seqs, 1)
            )
            ok, grad_norm, _ = self.optimizer.step()
            assert ok, "the optimizer skipped a step (bf16 needs no loss scaling)"
            grad_norms.append(float(grad_norm or 0.0))
            report = (loss_sum, mb_outputs, flops) if self._reports else (0.0, [], 0)
            parts = self._gather(report)  # FLOPs ride along: each DP share once
            losses.append(sum(p[0] for p in parts))
            outputs += [o for p in parts for o in p[1]]
            counted, flops = counted + sum(p[2] for p in parts), 0
        self._step += 1
        seconds = time.perf_counter() - start
        world = dist.get_world_size()
        return reduce_metrics(outputs) | step_metrics(
            samples, losses, grad_norms, lr, counted, seconds, self.peak_gflops, world
        )

    def _flops(self, batches: list[_MicroBatch], train: bool = False) -> int:
        """Model FLOPs of the forwards (and backwards, `train`) over these padded micro-batches,
        the whole model's (all stages and TP shards): only scored positions reach the LM head."""
        count = 0
        for b in batches:
            rows, length = b.ids.shape
            attended = rows * machine.causal_attended([length])
            count += self.shape.forward_flops(b.ids.numel(), int(b.select.sum()), attended)
        return 3 * count if train else count

    def _blank(self) -> list[_MicroBatch]:
        """A data-parallel rank with no sample in a minibatch still takes part in the gradient
        reduction: one micro-batch of two pad tokens with nothing to score."""
        blank = TrainSample([self.pad_id] * 2, [0, 0], [0.0, 0.0], 0.0)
        return self._micro_batches([0], [blank])

    def _rows(self, scored: dict[int, torch.Tensor], batch: _MicroBatch) -> torch.Tensor:
        return pad_rows([scored[i].tolist() for i in batch.index], 0.0, torch.float32).to(
            batch.mask.device
        )

    def _train_minibatch(
        self, batches: list[_MicroBatch], num_tokens: int, num_seqs: int
    ) -> tuple[float, list[tuple[dict[str, float], int]]]:
        """Forward and backward over this rank's micro-batches, gradients reduced over
        data-parallel ranks; returns this rank's summed loss and per-micro-batch metrics."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        scale = len(batches) * self.dp
        loss_sum = 0.0
        outputs: list[tuple[dict[str, float], int]] = []

        def loss_fn(batch: _MicroBatch, logits: torch.Tensor):
            nonlocal loss_sum
            logp, entropy = self._logprobs(batch, logits, self.algorithm.entropy_coef > 0)
            out = policy_loss(
                self.algorithm,
                logp,
                batch.proximal if batch.proximal is not None else logp.detach(),
                batch.behaviour,
                batch.advantages,
                batch.mask,
                ref_logprobs=batch.ref,
                entropy=entropy,
                lag=batch.lag,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            loss_sum += out.loss.item()
            outputs.append((out.metrics, out.num_tokens))
            return out.loss * scale, {}

        def step_fn(data: Iterator[_MicroBatch], m: torch.nn.Module):
            batch = next(data)
            return self._forward(m, batch), partial(loss_fn, batch)

        self.model.train()
        self._schedule(self.model, batches, step_fn, forward_only=False)
        return loss_sum, outputs

    # -- weights and checkpoints ----------------------------------------------------------------

    def _exported(self) -> list[Param]:
        """The Params the HF folder is made of, in order (a tied output layer is the
        embedding's copy, not a tensor of its own)."""
        tied = self.arch.tie_word_embeddings
        return [
            p
            for p in params(self.arch, self.te)
            if not (tied and p.megatron == "output_layer.weight")
        ]

    def hf_specs(self) -> list[TensorSpec]:
        """HF name, shape and dtype of every tensor of the model's HF folder, in the order
        `hf_tensors` yields them; from the config, no communication. Tied weights appear once,
        as `model.embed_tokens.weight`, as in the folder."""
        shapes = hf_shapes(self.arch)
        dtype = dtype_name(self.config.params_dtype)
        return [
            TensorSpec(name, tuple(shapes[name]), dtype) for p in self._exported() for name in p.hf
        ]

    def hf_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (all of them, or `names`), yielded on global rank 0.

        Collective: every rank calls it with the same names, and iterates it to the end. For
        each parameter, the tensor-parallel ranks of the pipeline stage that holds it all-gather
        its shards and convert them; under pipeline parallelism that stage's first rank then
        sends the HF tensors to global rank 0. Data-parallel replicas other than the first take
        no part. Other ranks yield nothing. A yielded tensor is valid until the next is asked
        for; one parameter (three tensors for a fused q/k/v) is gathered at a time, which is
        the unit a streaming weight push buckets."""
        from megatron.core import parallel_state

        if self.dp_rank != 0:
            return
        wanted = None if names is None else set(names)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        own = dict(self.model.module.named_parameters())
        shapes = hf_shapes(self.arch)
        for param in self._exported():
            if wanted is not None and wanted.isdisjoint(param.hf):
                continue
            stage = stage_of(param, self.arch, self.pp)
            tensors: list[torch.Tensor] = []
            if stage == self.pp_rank:
                local = own[megatron_name(param, self.layer_offset)].detach()
                if self.tp > 1 and param.split != "replicated":
                    shards = [torch.empty_like(local) for _ in range(self.tp)]
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
                else:
                    shards = [local]
                tensors = unshard(self.arch, param, shards)
            if self.tp_rank != 0:
                continue
            if stage != 0:  # the owner's first TP rank sends to global rank 0 (stage 0's)
                if self.pp_rank == stage:
                    for t in tensors:
                        dist.send(t.contiguous(), dist.get_global_rank(pp_group, 0), pp_group)
                elif self.pp_rank == 0:
                    tensors = []
                    for name in param.hf:
                        buf = torch.empty(
                            shapes[name], dtype=self.config.params_dtype, device=self.device
                        )
                        dist.recv(buf, dist.get_global_rank(pp_group, stage), pp_group)
                        tensors.append(buf)
            if self.pp_rank == 0:
                for name, t in zip(param.hf, tensors, strict=True):
                    if wanted is None or name in wanted:
                        yield name, t

    def weight_source(self) -> MegatronBackend:
        """The HF-name view TransferMesh reads (`hf_specs`, `hf_tensors`, and `device`, so that
        the planner learns where the weights are without gathering): the backend itself."""
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every HF-named weight on global rank 0 (CPU tensors; tied weights under both HF
        names, as an HF model's state dict has them); {} on the other ranks."""
        out = {name: t.cpu() for name, t in self.hf_tensors()}
        if out and self.arch.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def _rank_file(self, path: Path) -> Path:
        return Path(path) / CHECKPOINT_DIR / f"rank{dist.get_rank():05d}.pt"

    def _optimizer_file(self, path: Path) -> Path:
        """The distributed optimizer's state of this (TP, PP) position, written and read by its
        first data-parallel rank."""
        return Path(path) / CHECKPOINT_DIR / f"optimizer_tp{self.tp_rank}_pp{self.pp_rank}.pt"

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        file = self._rank_file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self._step,
            "layout": (self.tp, self.pp, self.dp),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_state(),
            "extra": extra,
        }
        if self.cuda:  # the distributed optimizer keeps its shards of Adam's state apart
            self.optimizer.save_parameter_state(str(self._optimizer_file(path)))
        tmp = file.with_name(f".{file.name}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, file)  # a crash mid-save leaves the old file intact
        dist.barrier()

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        file = self._rank_file(path)
        if not file.is_file():
            raise ValueError(
                f"run.resume: {file} does not exist; point it at a checkpoint folder of a "
                f"train.kind=megatron run with {dist.get_world_size()} ranks"
            )
        state = torch.load(file, map_location=self.device or "cpu", weights_only=False)
        if tuple(state["layout"]) != (self.tp, self.pp, self.dp):
            raise ValueError(
                f"run.resume: {path} was saved with (tensor, pipeline, data) parallel "
                f"{tuple(state['layout'])}; this run has {(self.tp, self.pp, self.dp)}"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.cuda:
            self.optimizer.load_parameter_state(str(self._optimizer_file(path)))
        set_rng_state(state["rng"])
        self._step = state["step"]
        return state["extra"]

    def save_hf(self, path: Path) -> None:
        """An HF folder (safetensors, config, tokenizer), written by global rank 0."""
        from huggingface_hub import save_torch_state_dict

        state = self.state_dict()
        if self.arch.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # as save_pretrained: one copy of a tied weight
        if dist.get_rank() == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            save_torch_state_dict(state, path)
            self.hf_config.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            gen = self.model_path / "generation_config.json"
            if gen.is_file():
                shutil.copy(gen, path / gen.name)
        dist.barrier()
