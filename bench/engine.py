"""The embedded engine against HF `generate` and against this machine's roofline, in one run.

    python bench/engine.py [--model smollm2] [--max-tokens 32] [--batches 1,32,64]
                           [--repeats 3] [--threads N] [--dtype float32|bfloat16]

Same chat prompts, greedy, every request generating exactly `--max-tokens` new tokens (the
engine with `ignore_eos`, HF with `min_new_tokens`). HF runs a whole batch as one left-padded
`generate` call; the engine receives the same requests concurrently through the Engine
protocol and batches them itself. Tokens/s counts new tokens only, prefill included in the
wall time. HF and engine alternate within each repeat (so load from other processes hits both
alike); each keeps its best repeat.

The roofline is measured in the same run, before each repeat (`gateway/machine.py`; best of
the repeats): this machine's matmul GFLOP/s on the shapes each phase runs (prefill, decode at
the batch's size, the LM head; in `--dtype`) and its memory read rate give the least time the
workload can take (`machine.generation_seconds`: FLOPs and weight bytes counted from the model
config); "of roofline" is achieved tokens/s over that bound. memcpy (bytes copied per second)
is printed too; a decode step reads its weights, it does not copy them. "GFLOP/s" is the
workload's counted FLOPs over the wall time.

One thread computes at a time: HF, the probes and the checks each run on a thread of their own
that ends when they are done, and the engine exists only while it is measured (created, warmed
up, timed, closed). A second live thread with an OpenMP team in the process slows every
parallel region of the other ~1.5-2x on 2 cores (see `LocalEngine`), which would hit whichever
side ran beside the other's idle threads.

On a machine shared with other jobs, run `--threads 1`: with 2 torch threads and the cores
busy, each small op of a decode step waits for a descheduled OpenMP thread (measured: a
batch-1 step ~10x its matmuls alone), which measures the load, not the engine.

Checks printed beside the speed: "same tokens" counts requests whose greedy tokens agree with
HF's up to the engine's first EOS; "logprob err" is the largest |engine logprob - teacher-forced
HF logprob| over every generated token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway import machine
from gateway.engines.base import Generation, SamplingParams
from gateway.engines.local import LocalEngine
from gateway.models import model_name, resolve_model

T = TypeVar("T")

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
    """Run fn; return its result, wall seconds and the peak RSS meanwhile: the kernel's
    high-water mark (`VmHWM`), reset to the current RSS first through /proc/self/clear_refs.
    No sampling thread wakes up beside the measured run: on 2 cores one every 5 ms cost the
    engine a quarter of its batch-1 tokens/s and HF generate 14% (17.4 against 23.0 and 12.4
    against 14.4 in two runs of this bench, 2026-12-06, AVX2 EPYC)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return result, seconds, peak


def prompts_for(path: Path, batch: int, distinct: bool = False) -> list[list[int]]:
    """The chat prompts of `batch` requests: the questions in turn (so a batch of 32 is 8
    groups of 4 identical prompts, as n samples per prompt are in RL), or all different."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = []
    for i in range(batch):
        question = QUESTIONS[i % len(QUESTIONS)]
        if distinct:
            question = f"Request {i}. {question}"
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
        )
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def prefill_lengths(prompts: list[list[int]]) -> list[int]:
    """Per distinct prompt, its tokens after the longest prefix it shares with an earlier one:
    what an engine that reuses prefixes (this one: identical prompts, the chat template of a
    batch's prompts, see `_llama.PrefixCache`) must prefill at least."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in {tuple(p): p for p in prompts}:
        shared = next((n for n in range(len(p), 0, -1) if p[:n] in seen), 0)
        seen.update(p[: n + 1] for n in range(len(p)))
        out.append(len(p) - shared)
    return out


def hf_runner(model: torch.nn.Module) -> Callable[[list[list[int]], int], list[list[int]]]:
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


def alone(threads: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a thread of its own, which ends with it (its OpenMP team goes too)."""

    def run() -> T:
        torch.set_num_threads(threads)  # per thread
        return fn(*args)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


class EngineSide:
    """The engine, alive only while it is measured: `with side.open() as run: run(prompts, n)`."""

    def __init__(self, path: Path, max_batch_size: int, dtype: str) -> None:
        self.path, self.max_batch_size, self.dtype = path, max_batch_size, dtype
        self.engine: LocalEngine | None = None
        self.forward, self.eos_token_ids = "", frozenset()

    @contextlib.contextmanager
    def open(self) -> Iterator[EngineSide]:
        self.engine = LocalEngine(self.path, dtype=self.dtype, max_batch_size=self.max_batch_size)
        self.forward, self.eos_token_ids = self.engine.forward, self.engine.eos_token_ids
        try:
            # Warm-up on tokens no measured prompt starts with: the engine's prefix cache then
            # holds nothing of them (within a batch, prompts still share their chat template).
            self([list(range(100, 140))] * 2, 4)
            yield self
        finally:
            asyncio.run(self.engine.close())
            self.engine = None

    def __call__(self, prompts: list[list[int]], n: int) -> list[Generation]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

        async def run() -> list[Generation]:
            return list(await asyncio.gather(*(self.engine.generate(x, params) for x in prompts)))

        return asyncio.run(run())


def agree(hf: list[int], engine: list[int], eos: frozenset[int]) -> bool:
    """Same greedy tokens up to the engine's first EOS (where HF's min_new_tokens forbids EOS)."""
    cut = next((i for i, t in enumerate(engine) if t in eos), len(engine))
    return hf[:cut] == engine[:cut]


def logprob_error(
    model: torch.nn.Module, prompts: list[list[int]], outs: list[Generation]
) -> float:
    """Largest |engine logprob - logprob of a teacher-forced HF forward| over all new tokens."""
    worst = 0.0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            seq = torch.tensor([prompt + out.output_ids])
            logp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
            targets = seq[0, len(prompt) :, None]
            ref = logp[len(prompt) - 1 : -1].gather(-1, targets)[:, 0]
            worst = max(worst, float((ref - torch.tensor(out.output_logprobs)).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or an HF folder")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--batches", default="1,32,64", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; best is kept")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="all prompts different (sharing only their chat template)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="HF's and the engine's"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # what the engine's thread takes
    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    hf_model = alone(
        threads, lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    )
    shape = machine.ModelShape.from_config(hf_model.config)
    hf_generate = hf_runner(hf_model)
    engine = EngineSide(path, max(batches), args.dtype)
    sides = {  # each opens a runner: HF's on a thread of its own per call, the engine anew
        "hf": lambda: contextlib.nullcontext(lambda p, n: alone(threads, hf_generate, p, n)),
        "engine": engine.open,
    }
    alone(threads, hf_generate, prompts_for(path, 2), 4)  # warm-up
    baseline = rss_bytes()
    rates: dict[tuple[int, int, int], float] = {}
    memory = {"memcpy": 0.0, "read": 0.0}

    def probe(batch: int, prompt_tokens: int) -> None:
        """Re-measure this batch's matmul shapes and memcpy; keep each one's best so far."""
        for m in (prompt_tokens, batch):
            for i, o in [*shape.linears().values(), (shape.hidden, shape.hidden)]:
                got = machine.measure_matmul(m, i, o, dtype)
                rates[m, i, o] = max(rates.get((m, i, o), 0), got)
        head = (batch, shape.hidden, shape.vocab)
        rates[head] = max(rates.get(head, 0), machine.measure_matmul(*head, dtype))
        memory["memcpy"] = max(memory["memcpy"], machine.measure_memcpy())
        memory["read"] = max(memory["read"], machine.measure_read())

    rows = []
    for batch in batches:
        prompts = prompts_for(path, batch, args.distinct)
        outs, seconds, extra = {}, dict.fromkeys(sides, float("inf")), dict.fromkeys(sides, 0)
        for _ in range(args.repeats):  # machine, HF, engine in turn: load changes hit all
            alone(threads, probe, batch, sum(prefill_lengths(prompts)))
            for name, side in sides.items():
                with side() as run:
                    before = rss_bytes()
                    outs[name], took, peak = peak_rss_during(
                        lambda r=run, p=prompts: r(p, args.max_tokens)
                    )
                seconds[name] = min(seconds[name], took)
                extra[name] = max(extra[name], peak - before)
        rows.append((batch, prompts, outs, seconds, extra))

    lengths = {b: [len(p) for p in prompts] for b, prompts, *_ in rows}
    distinct = {b: prefill_lengths(prompts) for b, prompts, *_ in rows}
    print(
        f"\n{model_name(args.model)}, {args.dtype}, greedy, {args.max_tokens} new tokens per "
        f"request, best of {args.repeats}; engine forward: {engine.forward}; process RSS with HF's "
        f"model loaded {baseline / 2**20:.0f} MiB"
    )
    for b in batches:
        if sum(distinct[b]) < sum(lengths[b]):
            print(
                f"batch {b}: {len(distinct[b])} distinct prompts, {sum(distinct[b])} of "
                f"{sum(lengths[b])} prompt tokens after the prefixes they share (the roofline "
                "prefills those, the engine those and whatever prefix is under 16 tokens, HF "
                "generate all)"
            )
    print(
        f"machine: {alone(threads, machine.describe)}; memcpy {memory['memcpy']:.1f} GB/s "
        f"(bytes copied), read {memory['read']:.1f} GB/s (the roofline's memory rate)"
    )
    print("\nmeasured linear-layer GFLOP/s, best kernel, [m, k] x [k, n]:")
    names = {**{v: k for k, v in shape.linears().items()}, (shape.hidden, shape.vocab): "lm_head"}
    for batch in batches:
        for m, what in ((sum(distinct[batch]), "prefill"), (batch, "decode")):
            got = [
                f"{names[i, o]} {r:.0f}"
                for (mm, i, o), r in rates.items()
                if mm == m and (i, o) in names
            ]
            print(f"- batch {batch} {what}, m={m}: {', '.join(got)}")
    big = (1024, shape.hidden, shape.intermediate)
    fp32, bf16 = alone(
        threads,
        lambda: [machine.measure_matmul(*big, dt) for dt in (torch.float32, torch.bfloat16)],
    )
    print(f"- {big[0]}x{big[1]}x{big[2]}: fp32 {fp32:.0f}, bf16 {bf16:.0f}")
    print(
        "\n| batch | HF generate tok/s | engine tok/s | roofline tok/s | engine/HF "
        "| engine of roofline | HF of roofline | engine GFLOP/s | same tokens | logprob err "
        "| HF peak RSS extra | engine peak RSS extra |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, prompts, outs, seconds, extra in rows:
        new = batch * args.max_tokens
        hf_tps, en_tps = (new / seconds[k] for k in ("hf", "engine"))
        bound = machine.generation_seconds(
            shape,
            lengths[batch],
            args.max_tokens,
            lambda *mkn: rates[mkn],
            memory["read"],
            dtype,
            distinct=distinct[batch],
        )
        roof_tps = new / bound
        steps = args.max_tokens - 1  # decode steps after the prefill's token
        flops = shape.forward_flops(  # what the engine computes: prefill, then the steps
            sum(distinct[batch]), logits=batch, attended=machine.causal_attended(distinct[batch])
        ) + shape.forward_flops(
            batch * steps,
            attended=sum(n * steps + steps * (steps + 1) // 2 for n in lengths[batch]),
        )
        same = sum(
            agree(a, b.output_ids, engine.eos_token_ids)
            for a, b in zip(outs["hf"], outs["engine"], strict=True)
        )
        err = alone(threads, logprob_error, hf_model, prompts, outs["engine"])
        print(
            f"| {batch} | {hf_tps:.1f} | {en_tps:.1f} | {roof_tps:.1f} | {en_tps / hf_tps:.2f}x "
            f"| {en_tps / roof_tps:.0%} | {hf_tps / roof_tps:.0%} "
            f"| {flops / seconds['engine'] / 1e9:.1f} | {same}/{batch} | {err:.1e} "
            f"| {extra['hf'] / 2**20:.0f} MiB | {extra['engine'] / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
