"""Throughput of the embedded engine versus HF `generate`, side by side in one run.

    python bench/engine.py [--model smollm2] [--max-tokens 32] [--batches 1,8,32] [--threads N]

Same chat prompts, greedy, every request generating exactly `--max-tokens` new tokens (the
engine with `ignore_eos`, HF with `min_new_tokens`). HF runs a whole batch as one left-padded
`generate` call; the engine receives the same requests concurrently and batches them itself.
Tokens/s counts new tokens only, prefill included in the wall time. Peak RSS is sampled while
each run is in flight (the whole process, with only that side's model loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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


def run_hf(path: Path, batches: list[int], max_tokens: int) -> dict[int, tuple]:
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

    generate(prompts_for(path, 2), 4)  # warm-up
    results = {}
    for batch in batches:
        prompts = prompts_for(path, batch)
        results[batch] = peak_rss_during(lambda p=prompts: generate(p, max_tokens))
    model = None  # free it before the engine loads its own copy
    gc.collect()
    return results


def run_engine(
    path: Path, batches: list[int], max_tokens: int
) -> tuple[dict[int, tuple], frozenset[int]]:
    engine = LocalEngine(path, max_batch_size=max(batches))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def generate(prompts: list[list[int]], p: SamplingParams) -> list[list[int]]:
        outs = await asyncio.gather(*(engine.generate(x, p) for x in prompts))
        return [o.output_ids for o in outs]

    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    asyncio.run(generate(prompts_for(path, 2), warm))
    results = {}
    for batch in batches:
        prompts = prompts_for(path, batch)
        results[batch] = peak_rss_during(lambda p=prompts: asyncio.run(generate(p, params)))
    asyncio.run(engine.close())
    return results, engine.eos_token_ids


def agree(hf: list[int], engine: list[int], eos: frozenset[int]) -> bool:
    """Same greedy tokens up to the engine's first EOS (where HF's min_new_tokens forbids EOS)."""
    cut = next((i for i, t in enumerate(engine) if t in eos), len(engine))
    return hf[:cut] == engine[:cut]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or an HF folder")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    hf = run_hf(path, batches, args.max_tokens)
    engine, eos = run_engine(path, batches, args.max_tokens)

    print(
        f"\n{model_name(args.model)}, fp32, greedy, {args.max_tokens} new tokens per request, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        "| batch | HF generate tok/s | engine tok/s | engine/HF | same tokens "
        "| HF peak RSS | engine peak RSS |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        hf_out, hf_s, hf_rss = hf[batch]
        en_out, en_s, en_rss = engine[batch]
        hf_tps, en_tps = batch * args.max_tokens / hf_s, batch * args.max_tokens / en_s
        same = sum(agree(a, b, eos) for a, b in zip(hf_out, en_out, strict=True))
        print(
            f"| {batch} | {hf_tps:.1f} | {en_tps:.1f} | {en_tps / hf_tps:.2f}x | {same}/{batch} "
            f"| {hf_rss / 2**20:.0f} MiB | {en_rss / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
