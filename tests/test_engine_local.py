"""The embedded engine against transformers itself: same tokens, same logprobs, any batching."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway import machine
from gateway.engines import local
from gateway.engines.base import Chunk, Engine, EngineError, SamplingParams
from gateway.engines.local import LocalEngine

PROMPTS = [
    [1, 504, 3458, 282, 4799, 314],
    [1, 28, 17, 9, 355],
    [1, 8396, 2, 7, 1306, 52, 52, 801, 25, 9000, 11, 12],
    [1, 42],
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
GREEDY_EOS = SamplingParams(max_tokens=12, temperature=0)


def sampled(seed: int, max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture
async def engine(tiny_model_path):
    eng = LocalEngine(tiny_model_path)
    yield eng
    await eng.close()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation: up to n tokens, ending early on the model's EOS."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def forward_logprobs(model, seq: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(seq[i] | seq[:i]) for i >= start, teacher-forced in one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp[start - 1 : len(seq) - 1].gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]


async def test_is_an_engine(engine):
    assert isinstance(engine, Engine)
    assert engine.max_context == 4096 and engine.weight_version == 0
    assert await engine.health() and engine.load == 0


async def test_greedy_matches_hf_generate(engine, hf_tiny):
    for prompt in PROMPTS:
        out = await engine.generate(prompt, GREEDY_EOS)
        assert out.output_ids == hf_greedy(hf_tiny, prompt, 12)
        assert out.output_versions == [0] * len(out.output_ids)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "top_k": 50}, {"top_p": 0.9}])
async def test_logprobs_match_teacher_forcing(engine, hf_tiny, kw):
    prompt = PROMPTS[0]
    out = await engine.generate(prompt, sampled(3, max_tokens=20, **kw))
    ref = forward_logprobs(hf_tiny, prompt + out.output_ids, len(prompt), kw.get("temperature", 1))
    torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)
    greedy = await engine.generate(prompt, GREEDY)
    ref = forward_logprobs(hf_tiny, prompt + greedy.output_ids, len(prompt))
    torch.testing.assert_close(torch.tensor(greedy.output_logprobs), ref, atol=1e-4, rtol=0)


async def test_top_logprobs_are_the_k_most_likely_of_the_same_distribution(engine, hf_tiny):
    prompt = PROMPTS[1]
    params = sampled(5, max_tokens=10, temperature=0.7, top_logprobs=4)
    plain = sampled(5, max_tokens=10, temperature=0.7)
    out, without = await asyncio.gather(
        engine.generate(prompt, params), engine.generate(prompt, plain)
    )
    assert out.output_ids == without.output_ids and without.output_top_logprobs == []
    seq = prompt + out.output_ids
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([seq])).logits[0].float()
    ref = torch.log_softmax(logits / 0.7, dim=-1)[len(prompt) - 1 : len(seq) - 1].topk(4)
    assert len(out.output_top_logprobs) == len(out.output_ids)
    for i, top in enumerate(out.output_top_logprobs):
        assert [t for t, _ in top] == ref.indices[i].tolist()
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in top]), ref.values[i], atol=1e-4, rtol=0
        )
        if out.output_ids[i] in ref.indices[i]:
            assert dict(top)[out.output_ids[i]] == pytest.approx(out.output_logprobs[i])
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)


async def test_top_k_1_and_tiny_top_p_are_greedy(engine, hf_tiny):
    greedy = await engine.generate(PROMPTS[2], GREEDY)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        out = await engine.generate(PROMPTS[2], sampled(0, max_tokens=12, temperature=2.0, **kw))
        assert out.output_ids == greedy.output_ids
        # The logprob is of the temperature-scaled distribution, not renormalized by top-k/p.
        ref = forward_logprobs(hf_tiny, PROMPTS[2] + out.output_ids, len(PROMPTS[2]), 2.0)
        torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)
        assert max(out.output_logprobs) < -1


async def test_batched_equals_unbatched(engine):
    params = [GREEDY, sampled(1), sampled(2, temperature=0.8, top_p=0.9), sampled(4, top_k=20)]
    alone = [await engine.generate(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    together = await asyncio.gather(
        *(engine.generate(p, sp) for p, sp in zip(PROMPTS, params, strict=True))
    )
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, atol=1e-4, rtol=0)


async def test_requests_joining_midway_equal_unbatched(engine):
    long = sampled(9, max_tokens=60)
    alone_long = await engine.generate(PROMPTS[2], long)
    # Joiners narrower and wider than the running cache, finishing at different steps.
    joiners = [*PROMPTS, PROMPTS[0] * 9]
    params = [sampled(i, max_tokens=8 + 4 * i) for i in range(len(joiners))]
    alone_short = [await engine.generate(p, sp) for p, sp in zip(joiners, params, strict=True)]
    stream = engine.stream(PROMPTS[2], long)
    first = await anext(stream)  # the long request is running before the others join
    joined = asyncio.gather(
        *(engine.generate(p, sp) for p, sp in zip(joiners, params, strict=True))
    )
    rest = [c async for c in stream]
    assert first.token_ids + [t for c in rest for t in c.token_ids] == alone_long.output_ids
    for a, b in zip(alone_short, await joined, strict=True):
        assert a.output_ids == b.output_ids


async def test_many_requests_through_a_small_batch(tiny_model_path):
    """40 requests of random shapes through 8 slots: each equals its run alone."""
    rng = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(40):
        prompt = torch.randint(
            3, 40000, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng
        )
        n = int(torch.randint(1, 20, (1,), generator=rng))
        params = GREEDY if i % 5 == 0 else sampled(i, max_tokens=n, top_k=(i % 3) * 20)
        reqs.append(([1, *prompt.tolist()], params))
    async with LocalEngine(tiny_model_path, max_batch_size=8) as eng:
        alone = [await eng.generate(p, sp) for p, sp in reqs]
        together = await asyncio.gather(*(eng.generate(p, sp) for p, sp in reqs))
        assert eng.load == 0
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, atol=1e-4, rtol=0)


async def test_seeded_sampling_independent_of_neighbours(engine):
    target = sampled(1234, max_tokens=24, temperature=1.1)
    alone = await engine.generate(PROMPTS[1], target)
    for neighbours in ([sampled(5)], [GREEDY, sampled(6, top_k=3), sampled(1234)] * 3):
        outs = await asyncio.gather(
            engine.generate(PROMPTS[1], target),
            *(engine.generate(PROMPTS[i % 4], sp) for i, sp in enumerate(neighbours)),
        )
        assert outs[0].output_ids == alone.output_ids
    assert len(set(alone.output_ids)) > 5  # really sampled, not a degenerate repeat
    other = await engine.generate(PROMPTS[1], sampled(4321, max_tokens=24, temperature=1.1))
    assert other.output_ids != alone.output_ids


async def test_finish_reasons(engine, tiny_model_path):
    # Requests done after their prefill token never join the batch (and never break it).
    running = asyncio.ensure_future(engine.generate(PROMPTS[2], sampled(3, max_tokens=200)))
    ones = await asyncio.gather(*(engine.generate(p, sampled(1, max_tokens=1)) for p in PROMPTS))
    assert all(len(o.output_ids) == 1 and o.finish_reason == "length" for o in ones)
    assert len((await running).output_ids) == 200
    base = await engine.generate(PROMPTS[0], sampled(11, max_tokens=30))
    assert base.finish_reason == "length" and len(base.output_ids) == 30
    stop_id = base.output_ids[7]
    cut = base.output_ids.index(stop_id) + 1
    out = await engine.generate(PROMPTS[0], sampled(11, max_tokens=30, stop_token_ids=(stop_id,)))
    assert out.finish_reason == "stop" and out.output_ids == base.output_ids[:cut]
    # A stop string spanning several tokens: generation ends on the token that completes it.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tokenizer.decode(base.output_ids)
    stop = text[len(tokenizer.decode(base.output_ids[:10])) - 2 :][:5]
    expect = next(n for n in range(1, 31) if stop in tokenizer.decode(base.output_ids[:n]))
    out = await engine.generate(PROMPTS[0], sampled(11, max_tokens=30, stop=(stop,)))
    assert out.finish_reason == "stop" and out.output_ids == base.output_ids[:expect]


async def test_eos_stops_unless_ignored(tiny_model_path):
    eng = LocalEngine(tiny_model_path)
    try:
        probe = await eng.generate(PROMPTS[3], GREEDY)
        eos = probe.output_ids[2]
        eng.eos_token_ids = frozenset({eos})  # pretend the model's EOS is that token
        stopped = await eng.generate(PROMPTS[3], SamplingParams(max_tokens=12, temperature=0))
        cut = probe.output_ids.index(eos) + 1
        assert stopped.finish_reason == "stop" and stopped.output_ids == probe.output_ids[:cut]
        ignored = await eng.generate(PROMPTS[3], GREEDY)
        assert ignored.output_ids == probe.output_ids
    finally:
        await eng.close()


async def test_abort_frees_the_slot(tiny_model_path):
    eng = LocalEngine(tiny_model_path, max_batch_size=1)
    try:
        endless = SamplingParams(max_tokens=4000, ignore_eos=True, seed=0)
        running = eng.stream(PROMPTS[0], endless, request_id="a")
        first = await anext(running)
        queued = asyncio.ensure_future(eng.generate(PROMPTS[1], endless, request_id="b"))
        waiter = asyncio.ensure_future(eng.generate(PROMPTS[2], GREEDY, request_id="c"))
        await asyncio.sleep(0.05)
        assert eng.load == 3
        await eng.abort("b")  # queued: ends without a token
        await eng.abort("a")  # running: its slot goes to "c"
        await eng.abort("unknown")
        rest = [c async for c in running]
        assert rest[-1].finish_reason == "abort"
        assert len(first.token_ids + [t for c in rest for t in c.token_ids]) < 4000
        assert (await queued).finish_reason == "abort" and (await queued).output_ids == []
        assert (await waiter).output_ids == (await eng.generate(PROMPTS[2], GREEDY)).output_ids
        assert eng.load == 0, eng._active
    finally:
        await eng.close()


async def test_the_engine_shares_its_cores(engine, monkeypatch):
    """On a CoreBoard the engine is busy while it has a request and idle (lending its threads)
    as soon as it has none, paused included; closing it takes its slot off the board. With
    `borrow`, its forwards run with the idle others' cores too, re-read before each step."""
    board = machine.CoreBoard.create(2)
    own = torch.get_num_threads()
    set_threads = torch.set_num_threads
    engine_threads: list[int] = []

    def spy(n: int) -> None:
        if threading.current_thread().name == "loongsage-engine":
            engine_threads.append(n)
        set_threads(n)

    monkeypatch.setattr(torch, "set_num_threads", spy)

    async def until(check) -> None:
        for _ in range(200):  # the loop marks at its next iteration
            if check():
                return
            await asyncio.sleep(0.01)
        assert check()

    try:
        board.mark(busy=False, cores=3)  # the trainer, waiting
        engine.share_cores(machine.CoreBoard(board.path, 1), borrow=True)
        await until(lambda: board.idle_cores() == own)
        stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True))
        await anext(stream)
        assert board.idle_cores() == 0 and engine_threads == [own + 3]
        board.mark(busy=True, cores=3)  # the trainer's step begins: the engine gives it back
        await until(lambda: engine_threads == [own + 3, own])
        await engine.pause("in_place")
        await until(lambda: board.idle_cores() == own)
        await engine.resume()
        await until(lambda: board.idle_cores() == 0)
        await stream.aclose()
        await until(lambda: board.idle_cores() == own)
        await engine.close()
        assert board.idle_cores() == 0
    finally:
        board.close()


async def test_generate_delivers_once_and_stream_every_token(engine, monkeypatch):
    """A whole generation reaches `generate`'s caller in one chunk at its end (no wake-up of
    its event loop per token), with every token, logprob and version; `stream` gets each."""
    sent: list[int] = []
    send = engine._send
    monkeypatch.setattr(
        engine, "_send", lambda req, *a: (sent.append(len(req.output)), send(req, *a))
    )
    whole = await engine.generate(PROMPTS[0], GREEDY)
    assert sent == [12] and len(whole.output_ids) == len(whole.output_logprobs) == 12
    assert whole.output_versions == [0] * 12 and whole.finish_reason == "length"
    sent.clear()
    chunks = [c async for c in engine.stream(PROMPTS[0], GREEDY)]
    assert (
        sent == list(range(1, 13)) and [t for c in chunks for t in c.token_ids] == whole.output_ids
    )


async def test_closing_a_stream_aborts_it(engine):
    stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True))
    await anext(stream)
    await stream.aclose()
    for _ in range(500):
        if engine.load == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.load == 0


async def test_cancelled_caller_frees_the_slot(engine):
    task = asyncio.ensure_future(
        engine.generate(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True))
    )
    while engine.load == 0:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(500):
        if engine.load == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.load == 0
    assert len((await engine.generate(PROMPTS[1], GREEDY)).output_ids) == 12


def perturbed(model) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }


async def test_weight_swap_mid_generation(engine, hf_tiny, tiny_model_path):
    new = perturbed(hf_tiny)
    prompt = PROMPTS[2]
    stream = engine.stream(prompt, SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
    got = Chunk([], [], [])
    while len(got.token_ids) < 3:
        chunk = await anext(stream)
        got.token_ids += chunk.token_ids
        got.logprobs += chunk.logprobs
        got.versions += chunk.versions
    await engine.update_weights(new, version=1)
    assert engine.weight_version == 1
    while got.versions.count(1) < 10:
        chunk = await anext(stream)
        got.token_ids += chunk.token_ids
        got.logprobs += chunk.logprobs
        got.versions += chunk.versions
    await stream.aclose()
    k = got.versions.index(1)
    assert k >= 3 and got.versions == [0] * k + [1] * (len(got.versions) - k)
    # After the swap: exactly what a fresh engine with the new weights does from that prefix.
    fresh = LocalEngine(tiny_model_path)
    try:
        await fresh.update_weights(new, version=1)
        ref = await fresh.generate(
            prompt + got.token_ids[:k],
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        )
    finally:
        await fresh.close()
    assert got.token_ids[k : k + 10] == ref.output_ids
    torch.testing.assert_close(got.logprobs[k : k + 10], ref.output_logprobs, atol=1e-4, rtol=0)
    # Both are the new weights' teacher-forced logprobs; the old weights' would differ.
    seq, start = prompt + got.token_ids[: k + 10], len(prompt) + k
    swapped = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    swapped.load_state_dict(new, strict=False)
    expected = forward_logprobs(swapped, seq, start)
    torch.testing.assert_close(torch.tensor(ref.output_logprobs), expected, atol=1e-4, rtol=0)
    old = forward_logprobs(hf_tiny, seq, start)
    assert (old - torch.tensor(ref.output_logprobs)).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_requests(engine, mode):
    params = sampled(21, max_tokens=400)
    expected = await engine.generate(PROMPTS[0], params)
    tokens: list[int] = []

    async def consume() -> str | None:
        async for chunk in engine.stream(PROMPTS[0], params):
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                return chunk.finish_reason

    task = asyncio.ensure_future(consume())
    while not tokens:
        await asyncio.sleep(0.001)
    await engine.pause(mode)
    late = asyncio.ensure_future(engine.generate(PROMPTS[1], GREEDY))
    await asyncio.sleep(0.05)  # chunks sent before the pause arrive
    frozen = len(tokens)
    await asyncio.sleep(0.2)
    assert len(tokens) == frozen < 400 and not late.done() and not task.done()
    await engine.resume()
    assert await task == "length"
    assert tokens == expected.output_ids
    assert (await late).finish_reason == "length"


async def test_pause_abort_ends_requests(engine):
    stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=3000, ignore_eos=True))
    await anext(stream)
    await engine.pause("abort")
    rest = [c async for c in stream]
    assert rest[-1].finish_reason == "abort"
    late = asyncio.ensure_future(engine.generate(PROMPTS[1], GREEDY))
    await asyncio.sleep(0.1)
    assert not late.done()
    await engine.resume()
    assert len((await late).output_ids) == 12


@pytest.mark.parametrize("budget_rows", [None, 12])
async def test_score_matches_forward(engine, hf_tiny, monkeypatch, budget_rows):
    if budget_rows:  # force several scoring groups (logits memory budget of ~12 positions)
        monkeypatch.setattr(local, "SCORE_LOGITS_BUDGET", budget_rows * engine.vocab_size)
    seqs = [PROMPTS[2] + [5, 6, 7], PROMPTS[3], PROMPTS[0] * 3]
    starts = [4, 1, 10]
    first, second = await asyncio.gather(
        engine.score(seqs, starts), engine.score([PROMPTS[1]], [5])
    )
    assert second == [[]]  # start == len: nothing to score
    for seq, start, got in zip(seqs, starts, first, strict=True):
        assert len(got) == len(seq) - start
        torch.testing.assert_close(
            torch.tensor(got), forward_logprobs(hf_tiny, seq, start), atol=1e-4, rtol=0
        )


BAD_REQUESTS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 100, "temprature": 1}, "temprature"),
]


def test_the_engine_loads_on_its_own_thread_and_load_errors_reach_the_caller(
    tiny_model_path, monkeypatch
):
    """Its thread is the only one of the engine that runs torch (the load included), and a
    bad load is the caller's exception, with no thread left behind."""
    import threading

    loaded_on = []
    real = local.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(local.AutoModelForCausalLM, "from_pretrained", spy)
    eng = LocalEngine(tiny_model_path)
    try:
        assert loaded_on == [eng._thread] and loaded_on[0] is not threading.current_thread()
    finally:
        asyncio.run(eng.close())

    def engine_threads() -> list[threading.Thread]:  # other tests' threads come and go
        return [t for t in threading.enumerate() if t.name == eng._thread.name]

    before = engine_threads()
    with pytest.raises(ValueError, match="max_context must be an integer in"):
        LocalEngine(tiny_model_path, max_context=1)
    assert engine_threads() == before


async def test_bad_input_names_the_field(tiny_model_path):
    eng = LocalEngine(tiny_model_path, max_context=64)
    try:
        for fields, name in BAD_REQUESTS:
            with pytest.raises(ValueError, match=name):
                eng.stream(PROMPTS[0], SamplingParams.from_dict(fields))
        with pytest.raises(ValueError, match=r"max_tokens.*context limit of 64"):
            eng.stream(PROMPTS[0], SamplingParams(max_tokens=60))
        with pytest.raises(ValueError, match="input_ids"):
            await eng.generate([], GREEDY)
        with pytest.raises(ValueError, match=r"input_ids.*position 1.*vocabulary"):
            await eng.generate([1, 10**7], GREEDY)
        with pytest.raises(ValueError, match="input_ids"):
            await eng.generate([1, -3], GREEDY)
        with pytest.raises(ValueError, match="params"):
            await eng.generate([1, 2], {"max_tokens": 3})
        with pytest.raises(ValueError, match=r"start\[0\]"):
            await eng.score([[1, 2, 3]], [0])
        with pytest.raises(ValueError, match=r"sequences\[1\]"):
            await eng.score([[1, 2], []], [1, 1])
        with pytest.raises(ValueError, match="mode"):
            await eng.pause("sideways")
        with pytest.raises(ValueError, match="model.norm.weight"):
            await eng.update_weights({"model.norm.weight": torch.zeros(3)}, 1)
        with pytest.raises(ValueError, match="not.a.weight"):
            await eng.update_weights({"not.a.weight": torch.zeros(3)}, 1)
        with pytest.raises(ValueError, match="dtype"):
            LocalEngine(tiny_model_path, dtype="fp7")
        running = eng.stream(PROMPTS[0], GREEDY, request_id="x")
        await anext(running)
        with pytest.raises(ValueError, match="request_id"):
            eng.stream(PROMPTS[0], GREEDY, request_id="x")
        await running.aclose()
        assert eng.load <= 1 and await eng.health() and eng.weight_version == 0
        assert len((await eng.generate(PROMPTS[1], GREEDY)).output_ids) == 12
    finally:
        await eng.close()


async def test_failure_inside_the_loop_fails_only_that_batch(engine, monkeypatch):
    real = engine.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", flaky)
    with pytest.raises(EngineError, match="injected fault"):
        await engine.generate(PROMPTS[0], GREEDY)
    assert await engine.health() and engine.load == 0
    assert len((await engine.generate(PROMPTS[0], GREEDY)).output_ids) == 12


async def test_closed_engine_refuses(tiny_model_path):
    eng = LocalEngine(tiny_model_path)
    stream = eng.stream(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True))
    await anext(stream)
    await eng.close()
    with pytest.raises(EngineError):
        async for _ in stream:
            pass
    assert not await eng.health()
    with pytest.raises(EngineError):
        eng.stream(PROMPTS[0], GREEDY)


@pytest.mark.slow
async def test_smollm2_greedy_and_logprobs_match_hf(smollm2_path):
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in ("What is the capital of France?", "Write a haiku about rain.")
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    async with LocalEngine(smollm2_path) as eng:
        outs = await asyncio.gather(*(eng.generate(p, GREEDY_EOS) for p in prompts))
        scores = await eng.score(
            [p + o.output_ids for p, o in zip(prompts, outs, strict=True)],
            [len(p) for p in prompts],
        )
    assert outs[0].finish_reason == "stop"  # answered within 12 tokens: ends on EOS, like HF
    for prompt, out, score in zip(prompts, outs, scores, strict=True):
        assert out.output_ids == hf_greedy(hf, prompt, 12)
        ref = forward_logprobs(hf, prompt + out.output_ids, len(prompt))
        torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(score), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
async def test_smollm2_samples_follow_the_distribution_it_reports(smollm2_path):
    """The log-probs the trainer corrects against are only right if the engine samples from
    the distribution it reports: with a forced temperature of 0.7, the first token's frequencies
    over many seeds match softmax(logits / 0.7), and not the T = 1 distribution."""
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name one color."}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    n, temperature = 800, 0.7
    async with LocalEngine(smollm2_path) as eng:
        params = [SamplingParams(max_tokens=1, temperature=temperature, seed=s) for s in range(n)]
        outs = await asyncio.gather(*(eng.generate(prompt, p) for p in params))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    want = torch.softmax(logits / temperature, -1)
    for out in outs:  # each reported log-prob is that of the distribution it came from
        assert math.isclose(out.output_logprobs[0], want[out.output_ids[0]].log(), abs_tol=1e-4)
    seen = torch.zeros_like(want)
    for out in outs:
        seen[out.output_ids[0]] += 1 / n
    # total variation over the 20 likeliest tokens and the rest as one bucket
    top = torch.topk(want, 20).indices

    def tv(p: torch.Tensor, q: torch.Tensor) -> float:
        return 0.5 * ((p[top] - q[top]).abs().sum() + abs(p[top].sum() - q[top].sum())).item()

    assert want[top[0]] < 0.8  # a spread distribution, so a wrong one would show
    assert tv(seen, want) < 0.1  # sampling noise: ~0.05 at n = 800
    assert tv(seen, torch.softmax(logits, -1)) > 0.2  # ~0.3
