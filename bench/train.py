"""The torch train backend against this machine's matmul peak, packed and as it was, in one run.

    python bench/train.py [--model smollm2] [--prompts 2] [--samples 8] [--repeats 2]
                            [--threads N] [--dtype auto] [--lora-rank 16]

A quickstart-shaped batch: `--prompts` Calc-v0 (difficulty 0) chat prompts, `--samples`
continuations of each (random tokens, 16-64 long, all trained), one train step per repeat.
Three layouts of the same step, and LoRA, alternating within each repeat (load from other
processes hits all alike), each keeping its best repeat:

- `packed`: the backend as it runs (a prompt forwarded once per micro-batch row, its
  continuations after it; the rows' common prefix, the chat template, once per micro-batch);
- `rows`: the same rows, each with its own copy of the template;
- `padded`: the layout before packing: every sample its own right-padded row;
- `lora`: `packed` training rank `--lora-rank` adapters on the frozen model
  (trainer/backends/lora.py; its FLOPs lack the frozen weights' gradients; 0 leaves it out).

Roofline: the matmul rate of the model's gate/up projection over 1024 tokens (what
`perf/mfu` divides by), measured before each repeat, best kept. "GFLOP/s" is the step's
counted FLOPs (`gateway.machine.ModelShape`: forward + backward of the tokens each layout
forwards, the LM head on the loss positions) over its wall time; "of peak" divides by the
roofline. "tokens/s" counts trained (loss) tokens, the same for both layouts: its ratio is
the speed-up of the step. On a loaded machine the fraction of peak moves with the load (the
peak and the steps are measured at different moments); the packed/padded ratio holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import gymnasium as gym
import torch
from transformers import AutoTokenizer

import envs  # noqa: F401  (registers loongsage/Calc-v0)
from gateway import machine
from gateway.models import resolve_model
from trainer.backends.base import PEAK_ROWS, TrainSample, micro_batches
from trainer.backends.torch_backend import Pack, TorchBackend, pack
from trainer.config import AlgorithmConfig, TrainBackendConfig


class RowsBackend(TorchBackend):
    """Packed rows, each computing the template it shares with the others."""

    def _packs(self, idx: list[int], samples: list[TrainSample], share: bool = True) -> list[Pack]:
        return super()._packs(idx, samples, share=False)


class PaddedBackend(TorchBackend):
    """The step with the layout it had before packing: one padded row per sample."""

    def _packs(self, idx: list[int], samples: list[TrainSample], share: bool = True) -> list[Pack]:
        batches = micro_batches(idx, samples, self.cfg.micro_batch_tokens)
        return [pack(samples, [[i] for i in b], self.device, share=False) for b in batches]


def quickstart_batch(path: str, prompts: int, per_prompt: int, seed: int = 0) -> list[TrainSample]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    env = gym.make("loongsage/Calc-v0", difficulty=0, calculator=False)
    rng = random.Random(seed)
    samples = []
    for p in range(prompts):
        _, info = env.reset(seed=seed + p)
        prompt = list(
            tokenizer.apply_chat_template(
                info["messages"], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for _ in range(per_prompt):
            n = rng.randint(16, 64)
            tail = [rng.randrange(1000, 20000) for _ in range(n)]
            samples.append(
                TrainSample(
                    prompt + tail,
                    [0] * len(prompt) + [1] * n,
                    [0.0] * len(prompt) + [-1.0] * n,
                    rng.choice([-1.0, 1.0]),
                )
            )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or an HF folder")
    parser.add_argument("--prompts", type=int, default=2, help="prompts (GRPO groups)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=2, help="steps per layout; best is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: no LoRA layout")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    samples = quickstart_batch(path, args.prompts, args.samples)
    cfg = TrainBackendConfig(
        device="cpu", lr=1e-6, dtype=args.dtype, micro_batch_tokens=args.micro_batch_tokens
    )
    layouts = [
        ("packed", TorchBackend, cfg),
        ("rows", RowsBackend, cfg),
        ("padded", PaddedBackend, cfg),
    ]
    if args.lora_rank:
        layouts.append(("lora", TorchBackend, dataclasses.replace(cfg, lora_rank=args.lora_rank)))
    backends = {name: cls(path, c, AlgorithmConfig(), temperature=0.7) for name, cls, c in layouts}
    first = backends["packed"]
    shape, dtype = first.shape, first.dtype
    print(machine.describe())
    print(
        f"model {args.model}: {shape.params / 1e6:.0f}M params; dtype {args.dtype} -> "
        f"{str(dtype).removeprefix('torch.')}; {len(samples)} samples, "
        f"{sum(len(s.token_ids) for s in samples)} tokens, "
        f"{sum(sum(s.loss_mask) for s in samples)} trained"
    )
    trained = sum(sum(s.loss_mask) for s in samples)
    peak, best = 0.0, {name: (float("inf"), {}) for name in backends}
    for _ in range(args.repeats):
        peak = max(
            peak, machine.measure_matmul(PEAK_ROWS, shape.hidden, 2 * shape.intermediate, dtype)
        )
        for name, backend in backends.items():
            start = time.perf_counter()
            metrics = backend.train_step(samples)
            seconds = time.perf_counter() - start
            if seconds < best[name][0]:
                best[name] = (seconds, metrics)
    print(
        f"roofline: matmul {PEAK_ROWS}x{shape.hidden}x{2 * shape.intermediate} {peak:.1f} GFLOP/s"
    )
    print(f"{'layout':8} {'step s':>8} {'tokens/s':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for name, (seconds, metrics) in best.items():
        gflops = metrics["perf/train_tflops"] * 1e3
        print(
            f"{name:8} {seconds:8.1f} {trained / seconds:9.1f} {gflops:8.1f} {gflops / peak:8.0%}"
        )
    for name in list(best)[1:]:
        print(f"packed vs {name}: {best[name][0] / best['packed'][0]:.2f}x trained tokens/s")


if __name__ == "__main__":
    main()
