"""Throughput of the embedded engine versus HF `generate`, side by side in one run.

    python bench/engine.py [--model smollm2] [--max-tokens 32] [--batches 1,8,32]
                           [--repeats 1] [--threads N]

Same chat prompts, greedy, every request generating exactly `--max-tokens` new tokens (the
engine with `ignore_eos`, HF with `min_new_tokens`). HF runs a whole batch as one left-padded
`generate` call; the engine receives the same requests concurrently and batches them itself.
Tokens/s counts new tokens only, prefill included in the wall time. Both sides run in one
process, alternating per batch size (so load from other processes hits both alike); "peak RSS
extra" is the highest RSS sampled during a run minus the RSS just before it (activations, KV
cache). "same tokens": requests whose greedy tokens agree up to the engine's first EOS.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.engines.base import SamplingParams
from gateway.engines.local import LocalEngine
from gateway.models import model_name, resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain on a tin roof.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers larger than 100.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph, mentioning the families.",
    "What is 17 times 23?",
    "Give me a short motivational quote.",
]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def peak_rss_during(fn: Callable[[], object]) -> tuple[object, float, int]:
    """Run fn; return its result, wall seconds and the peak RSS seen meanwhile."""
    peak, done = [rss_bytes()], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    return result, seconds, max(peak[0], rss_bytes())


def prompts_for(path: Path, batch: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = []
    for i in range(batch):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            add_generation_prompt=True,
            tokenize=True,
        )
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def hf_runner(path: Path) -> Callable[[list[list[int]], int], list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    return generate


def engine_runner(engine: LocalEngine) -> Callable[[list[list[int]], int], list[list[int]]]:
    async def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(x, params) for x in prompts))
        return [o.output_ids for o in outs]

    return lambda prompts, n: asyncio.run(run(prompts, n))


def agree(hf: list[int], engine: list[int], eos: frozenset[int]) -> bool:
    """Same greedy tokens up to the engine's first EOS (where HF's min_new_tokens forbids EOS)."""
    cut = next((i for i, t in enumerate(engine) if t in eos), len(engine))
    return hf[:cut] == engine[:cut]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or an HF folder")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side; best is kept")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    engine = LocalEngine(path, max_batch_size=max(batches))
    sides = {"hf": hf_runner(path), "engine": engine_runner(engine)}
    for run in sides.values():
        run(prompts_for(path, 2), 4)  # warm-up
    baseline = rss_bytes()
    rows = []
    for batch in batches:
        prompts = prompts_for(path, batch)
        outs, seconds, extra = {}, {k: float("inf") for k in sides}, dict.fromkeys(sides, 0)
        for _ in range(args.repeats):  # alternate the two sides so load changes hit both
            for name, run in sides.items():
                before = rss_bytes()
                outs[name], took, peak = peak_rss_during(
                    lambda r=run, p=prompts: r(p, args.max_tokens)
                )
                seconds[name] = min(seconds[name], took)
                extra[name] = max(extra[name], peak - before)
        rows.append((batch, outs, seconds, extra))
    asyncio.run(engine.close())

    print(
        f"\n{model_name(args.model)}, fp32, greedy, {args.max_tokens} new tokens per request, "
        f"torch threads {torch.get_num_threads()}, best of {args.repeats}; process RSS with "
        f"both models loaded {baseline / 2**20:.0f} MiB"
    )
    print(
        "| batch | HF generate tok/s | engine tok/s | engine/HF | same tokens "
        "| HF peak RSS extra | engine peak RSS extra |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, outs, seconds, extra in rows:
        hf_tps, en_tps = (batch * args.max_tokens / seconds[k] for k in ("hf", "engine"))
        same = sum(
            agree(a, b, engine.eos_token_ids)
            for a, b in zip(outs["hf"], outs["engine"], strict=True)
        )
        print(
            f"| {batch} | {hf_tps:.1f} | {en_tps:.1f} | {en_tps / hf_tps:.2f}x | {same}/{batch} "
            f"| {extra['hf'] / 2**20:.0f} MiB | {extra['engine'] / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
