"""The local engine's two forwards (lean Llama over a slot cache, transformers' own) against
transformers itself, and one request's non-finite numbers never reaching its batch neighbours."""

from __future__ import annotations

import asyncio
import shutil
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gateway import machine
from gateway.engines import _llama
from gateway.engines.base import MIN_TEMPERATURE, EngineError, SamplingParams
from gateway.engines.local import LocalEngine

PROMPTS = [[1, 504, 3458, 282, 4799, 314], [1, 28, 17, 9, 355], [1, 8396, 2, 7, 1306, 52, 52]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def sampled(seed: int, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


def tiny_variant(src, dst, **overrides):
    """A tiny random model like `tiny` (same tokenizer) with other config fields."""
    config = AutoConfig.from_pretrained(src)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def untied_path(tiny_model_path, tmp_path_factory):
    """Llama with a separate LM head: NaN in one input embedding reaches only rows fed it."""
    return tiny_variant(
        tiny_model_path, tmp_path_factory.mktemp("untied"), tie_word_embeddings=False
    )


@pytest.fixture(scope="module")
def qwen2_path(tiny_model_path, tmp_path_factory):
    """An architecture the lean forward does not cover (biased q/k/v)."""
    config = AutoConfig.from_pretrained(tiny_model_path)
    fields = {
        k: getattr(config, k)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
    }
    dst = tmp_path_factory.mktemp("qwen2")
    qwen = AutoConfig.for_model("qwen2", tie_word_embeddings=True, **fields)
    qwen.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path / name, dst / name)
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(qwen).to(torch.float32).save_pretrained(dst)
    return dst


def hf_reference(path, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens (generate) and the teacher-forced logprobs of them."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )[0, len(prompt) :].tolist()
        logp = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0].float(), dim=-1)
    targets = torch.tensor(out)[:, None]
    return out, logp[len(prompt) - 1 : -1].gather(-1, targets)[:, 0]


def test_lean_forward_covers_llama_only(tiny_model_path, qwen2_path):
    assert _llama.unsupported(AutoConfig.from_pretrained(tiny_model_path)) is None
    assert "model_type" in _llama.unsupported(AutoConfig.from_pretrained(qwen2_path))


def test_prepacked_and_plain_matmuls_give_hfs_logits(tiny_model_path):
    """The lean forward's two ways to multiply (oneDNN's prepacked weights; the plain buffers,
    which steps of one row use) give transformers' logits."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    runner = _llama.LeanRunner(hf, 2)
    assert runner.model.packed is not None and runner.model.packed_head is not None
    with torch.inference_mode():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS[:2]])
        prepacked = runner.prefill(PROMPTS[:2])
        runner.reset()
        runner.model.packed = runner.model.packed_head = None
        plain = runner.prefill(PROMPTS[:2])
    torch.testing.assert_close(prepacked, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", [(30, 48), (31, 49), (1, 5), (97, 130)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kernel", ["compiled", "fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_matmul_is_the_matmul(monkeypatch, dtype, kernel, threads, shape):
    """`machine.gemv` (the compiled kernel, or without it `split_gemv` and torch's linear) is
    x @ W.T for one row and an [out, in] weight, adding into the residual in place."""
    if kernel == "fallback":
        monkeypatch.setattr(machine, "cpu_kernels", lambda: None)
    torch.manual_seed(0)
    weight, x, residual = torch.randn(shape), torch.randn(1, shape[1]), torch.randn(1, shape[0])
    expected = x.to(dtype).float() @ weight.to(dtype).float().T
    weight, x, residual = weight.to(dtype), x.to(dtype), residual.to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = machine.gemv(x, weight)
        added = residual.clone()
        machine.gemv(x, weight, added)
        split = machine.split_gemv(x.float(), weight.float(), threads)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == dtype and out.shape == (1, shape[0])
    torch.testing.assert_close(out.float(), expected, **tol)
    torch.testing.assert_close(added.float(), residual.float() + expected, **tol)
    torch.testing.assert_close(split, expected, **tol)


@pytest.mark.skipif(
    sys.platform != "linux" or not shutil.which("c++"), reason="needs a C++ compiler and OpenMP"
)
def test_cpu_kernels_build_here():
    """Where a compiler is, the engine runs its compiled kernels, not the slower torch ops
    (a broken build only warns: this makes it fail)."""
    assert machine.cpu_kernels() is not None


@pytest.mark.skipif(machine.cpu_kernels() is None, reason="no compiled CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (7, 4, 4, 128), (3, 6, 2, 24)]
)
def test_decode_attention_kernel_is_the_torch_ops(dtype, rows, heads, kv_heads, dim):
    """The compiled decode attention (RoPE, cache write, attention) gives the torch ops' output
    and cache: GQA groups, rows at different positions over a cache holding other values past
    them. (The engine tests compare whole forwards, kernels on, with transformers.)"""
    torch.manual_seed(0)
    model = _llama.LeanLlama.__new__(_llama.LeanLlama)
    torch.nn.Module.__init__(model)
    model.num_heads, model.num_kv_heads, model.head_dim, model.scale = (
        heads,
        kv_heads,
        dim,
        dim**-0.5,
    )
    positions = torch.randint(0, 39, (rows,)).tolist()
    step = _llama.Step.decoding(list(range(rows)), positions)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    cos, sin = torch.randn(2, rows, 1, dim).to(dtype)
    cache = torch.randn(1, 2, 8, kv_heads, 64, dim).to(dtype)
    outs, caches = [], []
    for kernels in (machine.cpu_kernels(), None):
        model.kernels = kernels
        model.cache = _llama.SlotCache(1, kv_heads, dim, 8, 512, dtype)
        model.cache._use(cache.clone())
        where = None if kernels else model.cache.index(step.write_rows, step.positions)
        window = None if kernels else model._decode_window(step)
        outs.append(model._attention(0, qkv, cos, sin, step, where, window).float())
        caches.append(model.cache.kv.float())
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(caches[0], caches[1], **tol)
    torch.testing.assert_close(outs[0], outs[1], **tol)


@pytest.mark.skipif(machine.cpu_kernels() is None, reason="no compiled CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("before", ["norm", "glu", "none"])
def test_the_ops_before_a_matmul_are_the_torch_ops(dtype, rows, before):
    """A layer's matmuls with the compiled kernels (one row: `gemv` with the RMSNorm or SwiGLU
    inside; more rows: `layer_input`, then the matmul) give the torch ops' result, rounded as
    transformers rounds in bf16, the residual added in place."""
    torch.manual_seed(0)
    model = _llama.LeanLlama.__new__(_llama.LeanLlama)
    torch.nn.Module.__init__(model)
    model.eps = 1e-5
    n_in, n_out = 48, 33
    x = (torch.randn(rows, 2 * n_in if before == "glu" else n_in) * 3).to(dtype)
    weight, norm = torch.randn(n_out, n_in).to(dtype), torch.randn(n_in).to(dtype)
    residual = torch.randn(rows, n_out).to(dtype)
    kwargs = {"norm": norm} if before == "norm" else {"glu": True} if before == "glu" else {}
    outs = []
    for kernels in (machine.cpu_kernels(), None):
        model.kernels = kernels
        added = residual.clone()
        assert model._linear(x, weight, added, **kwargs) is added
        outs.append((model._linear(x, weight, **kwargs).float(), added.float()))
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(outs[0], outs[1], **tol)


@pytest.mark.parametrize(
    ("model", "forward", "expect"),
    [
        ("tiny", "auto", "lean"),
        ("untied", "auto", "lean"),
        ("tiny", "transformers", "transformers"),
        ("qwen2", "auto", "transformers"),
    ],
)
async def test_each_forward_matches_hf(
    tiny_model_path, untied_path, qwen2_path, model, forward, expect
):
    path = {"tiny": tiny_model_path, "untied": untied_path, "qwen2": qwen2_path}[model]
    refs = [hf_reference(path, p, 12) for p in PROMPTS]
    async with LocalEngine(path, forward=forward, max_batch_size=2) as eng:
        assert eng.forward == expect
        together = await asyncio.gather(*(eng.generate(p, GREEDY) for p in PROMPTS))
        seqs = [p + o.output_ids for p, o in zip(PROMPTS, together, strict=True)]
        scores = await eng.score(seqs, [3, 2, 5])
    for prompt, (tokens, logp), out, score in zip(PROMPTS, refs, together, scores, strict=True):
        assert out.output_ids == tokens
        torch.testing.assert_close(torch.tensor(out.output_logprobs), logp, atol=1e-4, rtol=0)
        seq = prompt + tokens
        assert len(score) == len(seq) - [3, 2, 5][PROMPTS.index(prompt)]
        torch.testing.assert_close(torch.tensor(score[-len(tokens) :]), logp, atol=1e-4, rtol=0)


async def test_slot_cache_grows_and_compacts_under_load(tiny_model_path, monkeypatch):
    """Rows leave from the middle (the last rows move into their places) while the cache grows
    past its first capacity; every request still equals its run alone."""
    capacities = []
    reserve = _llama.SlotCache.reserve

    def spy(cache, rows, positions):
        reserve(cache, rows, positions)
        capacities.append(cache.kv.shape[4])

    monkeypatch.setattr(_llama.SlotCache, "reserve", spy)
    n_min = _llama.SlotCache.MIN_POSITIONS
    reqs = [
        (PROMPTS[i % 3] * (1 + i % 4), sampled(i, max_tokens=4 + (i * 37) % (2 * n_min)))
        for i in range(10)
    ]
    async with LocalEngine(tiny_model_path, max_batch_size=6) as eng:
        alone = [await eng.generate(p, sp) for p, sp in reqs]
        together = await asyncio.gather(*(eng.generate(p, sp) for p, sp in reqs))
    assert max(capacities) >= 2 * n_min
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("forward", ["auto", "transformers"])
async def test_aborting_a_running_row_moves_the_last_into_its_place(tiny_model_path, forward):
    """An abort is a command between steps, not a decode step; the row it frees is refilled
    from the end (an in-place cache copy) and the other requests go on as if alone."""
    reqs = [(p, sampled(i, max_tokens=16)) for i, p in enumerate(PROMPTS)]
    async with LocalEngine(tiny_model_path, forward=forward) as eng:
        alone = [await eng.generate(p, sp) for p, sp in reqs]
        await eng.pause()
        long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        first = eng.stream(PROMPTS[0], long, request_id="first")
        streams = [first, *(eng.stream(p, sp) for p, sp in reqs)]
        pending = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.05)
        await eng.resume()
        await pending[0]  # row 0 has its first token; it leaves while the others decode
        await eng.pause()
        await eng.abort("first")
        await eng.resume()
        rest = [
            [await chunk, *[c async for c in s]]
            for chunk, s in zip(pending[1:], streams[1:], strict=True)
        ]
        assert eng.load == 0 and await eng.health()
    for want, chunks in zip(alone, rest, strict=True):
        assert [t for c in chunks for t in c.token_ids] == want.output_ids
        got = [x for c in chunks for x in c.logprobs]
        torch.testing.assert_close(got, want.output_logprobs, atol=1e-4, rtol=0)


# --------------------------------------------------------------------- failure isolation


async def run_together(eng: LocalEngine, requests: list[tuple[list[int], SamplingParams]]):
    """Submit while paused, so that every request is prefilled and decoded in one batch."""
    await eng.pause()
    tasks = [asyncio.ensure_future(eng.generate(p, sp)) for p, sp in requests]
    await asyncio.sleep(0.05)
    await eng.resume()
    return await asyncio.gather(*tasks, return_exceptions=True)


# Row order matters: the last (short) bystander moves into the bad request's row when it
# leaves, and the long one keeps the attended width beyond the short one's length there.
BYSTANDERS = [(PROMPTS[2] * 4, GREEDY), (PROMPTS[1], sampled(7, temperature=0.8, top_p=0.9))]


@pytest.mark.parametrize("forward", ["auto", "transformers"])
async def test_a_non_finite_row_ends_only_its_request(untied_path, forward):
    async with LocalEngine(untied_path, forward=forward) as eng:
        probe = await eng.generate(PROMPTS[0], GREEDY)
        alone = [await eng.generate(p, sp) for p, sp in BYSTANDERS]
        used = {t for p, sp in BYSTANDERS for t in p} | {t for a in alone for t in a.output_ids}
        # A token the bad request generates at its 4th step and nobody else ever sees.
        bad = next(t for t in probe.output_ids[3:] if t not in used | set(PROMPTS[0]))
        cut = probe.output_ids.index(bad) + 1
        embed = eng._weights["model.embed_tokens.weight"].clone()
        embed[bad] = float("nan")
        await eng.update_weights({"model.embed_tokens.weight": embed}, version=1)
        # In its prompt: it fails at prefill. Generated: it fails at the decode step feeding it.
        for prompt in ([bad, *PROMPTS[0] * 3], PROMPTS[0]):
            outs = await run_together(eng, [(prompt, GREEDY), *BYSTANDERS])
            assert isinstance(outs[0], EngineError) and "non-finite logits" in str(outs[0])
            for got, want in zip(outs[1:], alone, strict=True):
                assert got.output_ids == want.output_ids
                torch.testing.assert_close(
                    got.output_logprobs, want.output_logprobs, atol=1e-4, rtol=0
                )
        streamed = []
        with pytest.raises(EngineError, match="non-finite"):
            async for chunk in eng.stream(PROMPTS[0], GREEDY):
                streamed += chunk.token_ids
        assert streamed == probe.output_ids[:cut]  # its tokens up to the bad one were delivered
        assert eng.load == 0 and await eng.health()
        # The row it used is clean for the next request placed there.
        for (p, sp), want in zip(BYSTANDERS, alone, strict=True):
            assert (await eng.generate(p, sp)).output_ids == want.output_ids


async def test_an_overflowing_temperature_ends_only_its_request(untied_path):
    async with LocalEngine(untied_path) as eng:
        # Finite logits ~1e35 (a scaled LM head) over the smallest non-greedy temperature: inf.
        head = eng._weights["lm_head.weight"] * 1e36
        await eng.update_weights({"lm_head.weight": head}, version=1)
        alone = [await eng.generate(p, sp) for p, sp in BYSTANDERS]
        outs = await run_together(
            eng, [(PROMPTS[0], sampled(1, temperature=2 * MIN_TEMPERATURE)), *BYSTANDERS]
        )
        assert isinstance(outs[0], ValueError) and "temperature" in str(outs[0])
        for got, want in zip(outs[1:], alone, strict=True):
            assert got.output_ids == want.output_ids
        assert eng.load == 0


async def test_identical_prompts_are_prefilled_once(tiny_model_path, monkeypatch):
    """n samples of one prompt (GRPO groups, `n` > 1): one prefill, each its own sample."""
    packed = []
    real = _llama.Step.packed.__func__

    def spy(cls, seqs, rows, logits_at, cached=None):
        packed.append(len(seqs))
        return real(cls, seqs, rows, logits_at, cached)

    monkeypatch.setattr(_llama.Step, "packed", classmethod(spy))
    group = [(PROMPTS[0], sampled(s, temperature=0.9)) for s in range(4)]
    group += [(PROMPTS[1], GREEDY), (PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY)]
    async with LocalEngine(tiny_model_path) as eng:
        alone = [await eng.generate(p, sp) for p, sp in group]
        packed.clear()
        together = await run_together(eng, group)
    assert packed == [2]  # two distinct prompts in the one prefill of seven requests
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, atol=1e-4, rtol=0)
    assert len({tuple(o.output_ids) for o in together[:4]}) == 4  # different seeds, samples


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_lean_forward_in_half_precision(tiny_model_path, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=getattr(torch, dtype))
    prompt = PROMPTS[0]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8)
    async with LocalEngine(tiny_model_path, dtype=dtype) as eng:
        assert eng.forward == "lean"
        out = await eng.generate(
            prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )
    assert out.output_ids == want[0, len(prompt) :].tolist()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.output_ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    ref = ref.gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=2e-2, rtol=0)


async def test_cached_prefixes_give_hfs_tokens_and_logprobs(tiny_model_path, tmp_path, monkeypatch):
    """A newcomer that starts with tokens prefilled before (a system prompt every request
    shares, an agent's earlier turn) computes only the rest, with transformers' tokens and
    logprobs; a weight swap forgets every cached prefix."""
    computed = []
    real = _llama.Step.packed.__func__

    def spy(cls, seqs, rows, logits_at, cached=None):
        if rows is not None:  # prefill, not scoring
            computed.append(sum(len(s) for s in seqs) - sum(cached or []))
        return real(cls, seqs, rows, logits_at, cached)

    monkeypatch.setattr(_llama.Step, "packed", classmethod(spy))
    system = PROMPTS[2] * 3  # 21 tokens every prompt starts with
    prompts = [system + p for p in PROMPTS]
    async with LocalEngine(tiny_model_path) as eng:
        outs = await run_together(eng, [(p, GREEDY) for p in prompts])
        # The first prompt in full, then the others after the 22 tokens they share with it
        # (the system's 21 and the 1 every one of PROMPTS starts with).
        assert computed == [len(prompts[0]), sum(len(p) - 22 for p in prompts[1:])]
        computed.clear()
        turn = prompts[0] + outs[0].output_ids + [9, 10, 11]  # an agent's next turn
        outs.append(await eng.generate(turn, GREEDY))
        assert computed == [len(outs[0].output_ids) + 3]  # its last prompt was cached
        for prompt, out in zip([*prompts, turn], outs, strict=True):
            tokens, logp = hf_reference(tiny_model_path, prompt, 12)
            assert out.output_ids == tokens
            torch.testing.assert_close(torch.tensor(out.output_logprobs), logp, atol=1e-4, rtol=0)
        other = tiny_variant(tiny_model_path, tmp_path / "other")  # other weights, same shapes
        state = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict()
        await eng.update_weights(state, version=1)
        computed.clear()
        out = await eng.generate(prompts[1], GREEDY)
        assert computed == [len(prompts[1])]
        tokens, logp = hf_reference(other, prompts[1], 12)
        assert out.output_ids == tokens
        torch.testing.assert_close(torch.tensor(out.output_logprobs), logp, atol=1e-4, rtol=0)


def test_prefix_cache_finds_the_longest_prefix_within_its_budget():
    def kv(n):  # 32 bytes a token
        return torch.zeros(1, 2, 1, n, 4)

    cache = _llama.PrefixCache(max_bytes=32 * 50)
    a, b = list(range(20)), list(range(18)) + [0, 0]
    cache.add(a, kv(20))
    cache.add(b, kv(20))
    cache.add(list(range(100, 110)), kv(10))  # under MIN_TOKENS: not kept
    assert cache.longest(list(range(19)) + [7])[0] == 19  # a's
    assert cache.longest(b + [5])[0] == 20  # all of b
    assert cache.longest(list(range(15)) + [0] * 9) == (0, None)  # 15 shared: too few
    cache.add(list(range(50, 70)), kv(20))  # 60 tokens > 50: the least recently used goes
    assert cache.longest(a)[0] == 18  # a went (b was used last); b's 18 remain
    cache.clear()
    assert cache.longest(b) == (0, None)
