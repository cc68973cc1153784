"""The SGLang client (`gateway/engines/sglang.py`) against the fake SGLang server, in both
streaming modes, or against a real server when `SGLANG_URL` is set (`scripts/gpu_check_sglang.sh`).

With a real server, fake-only checks (exact logprobs, the fake's EOS id, NCCL-free weight routes)
are skipped and `SGLANG_MODEL_DIR` (the served model's HF folder) enables the disk weight update.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os

import httpx
import pytest
from fake_sglang import serve_fake

from gateway.engines.base import Chunk, Engine, EngineError, SamplingParams
from gateway.engines.sglang import SGLangEngine, _parse_event

REAL_URL = os.environ.get("SGLANG_URL")
REAL_MODEL_DIR = os.environ.get("SGLANG_MODEL_DIR")
fake_only = pytest.mark.skipif(bool(REAL_URL), reason="checks the fake's own model")
# Prefill and decode kernels differ on a GPU; the fake's "model" is exact.
LOGPROB_TOL = 0.05 if REAL_URL else 1e-9
PROMPT = [1, 9038, 2114, 314, 253, 1345, 30, 198]


@pytest.fixture(scope="module", params=["real"] if REAL_URL else ["cumulative", "incremental"])
def server_url(request):
    if REAL_URL:
        yield REAL_URL
        return
    # 2000 tokens/s: fast tests, yet slow enough to abort or pause a request mid-stream.
    args = ["--tokens-per-s", "2000"] + (
        ["--incremental"] if request.param == "incremental" else []
    )
    with serve_fake(*args) as url:
        yield url


@pytest.fixture
async def engine(server_url):
    eng = await SGLangEngine(server_url).connect()
    yield eng
    await eng.close()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


async def collect_chunks(stream) -> list[Chunk]:
    return [chunk async for chunk in stream]


async def test_connect_reads_context_and_version(engine):
    assert isinstance(engine, Engine)
    assert engine.max_context > len(PROMPT)
    info = await engine.get_model_info()
    assert "weight_version" in info
    assert engine.weight_version >= 0
    assert await engine.health()


async def test_generate_exact_length_with_ignore_eos(engine):
    out = await engine.generate(PROMPT, greedy(12, ignore_eos=True))
    assert len(out.output_ids) == 12
    assert out.finish_reason == "length"
    assert len(out.output_logprobs) == len(out.output_versions) == 12
    assert all(lp <= 0 for lp in out.output_logprobs)
    assert out.output_versions == [engine.weight_version] * 12
    assert engine.load == 0


async def test_stream_matches_generate(engine):
    params = greedy(16, ignore_eos=True)
    whole = await engine.generate(PROMPT, params)
    chunks = await collect_chunks(engine.stream(PROMPT, params))
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    ids = [t for c in chunks for t in c.token_ids]
    lps = [lp for c in chunks for lp in c.logprobs]
    assert ids == whole.output_ids  # no token lost or repeated, in either streaming mode
    assert lps == pytest.approx(whole.output_logprobs, abs=LOGPROB_TOL)
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.versions) for c in chunks)


async def test_top_logprobs_line_up_with_tokens_in_both_streaming_modes(engine):
    params = greedy(12, ignore_eos=True, top_logprobs=3)
    whole = await engine.generate(PROMPT, params)
    chunks = await collect_chunks(engine.stream(PROMPT, params))
    assert all(len(c.top_logprobs) == len(c.token_ids) for c in chunks)
    rows = [row for c in chunks for row in c.top_logprobs]
    assert len(rows) == len(whole.output_top_logprobs) == 12
    for row, again in zip(rows, whole.output_top_logprobs, strict=True):
        assert len(row) == 3 and [t for t, _ in row] == [t for t, _ in again]
        assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
    assert (await engine.generate(PROMPT, greedy(4))).output_top_logprobs == []


async def test_stop_token_ids_end_generation_and_are_kept(engine):
    first = await engine.generate(PROMPT, greedy(10))
    ids = first.output_ids if first.finish_reason == "length" else first.output_ids[:-1]
    index = max(i for i, t in enumerate(ids) if t not in ids[:i])
    out = await engine.generate(PROMPT, greedy(10, stop_token_ids=(ids[index],)))
    assert out.finish_reason == "stop"
    assert out.output_ids == first.output_ids[: index + 1]


@fake_only
async def test_eos_is_in_output_ids_not_in_text(server_url):
    # Find a prompt whose greedy continuation ends on EOS (the fake's EOS id is 2).
    async with httpx.AsyncClient(base_url=server_url) as client:
        for seed in range(200):
            body = {
                "input_ids": [seed + 20, 7, 8],
                "sampling_params": {"max_new_tokens": 200, "temperature": 0},
                "return_logprob": True,
            }
            data = (await client.post("/generate", json=body)).json()
            if data["meta_info"]["finish_reason"]["type"] == "stop":
                break
        assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
        assert data["output_ids"][-1] == 2
        assert "t2" not in data["text"].split() and len(data["text"].split()) == (
            len(data["output_ids"]) - 1
        )
    eng = await SGLangEngine(server_url).connect()
    out = await eng.generate([seed + 20, 7, 8], greedy(200))
    await eng.close()
    assert out.output_ids == data["output_ids"] and out.finish_reason == "stop"


async def test_unknown_sampling_key_is_a_400(server_url):
    async with httpx.AsyncClient(base_url=server_url) as client:
        body = {"input_ids": PROMPT, "sampling_params": {"max_tokens": 4}}
        response = await client.post("/generate", json=body)
    assert response.status_code == 400
    assert "max_tokens" in response.text


async def test_server_400_becomes_value_error(server_url, engine):
    too_long = [5] * engine.max_context
    with pytest.raises(ValueError, match="too long|context"):
        await engine.generate(too_long, greedy(4))  # checked client-side
    raw = SGLangEngine(server_url, max_context=10**9)  # the server has to say it
    try:
        with pytest.raises(ValueError, match="context length"):
            await raw.generate(too_long, greedy(4))
        with pytest.raises(ValueError, match="context length"):
            await collect_chunks(raw.stream(too_long, greedy(4)))
    finally:
        await raw.close()


async def test_unreachable_server_is_engine_error():
    from fake_sglang import free_port

    dead = SGLangEngine(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    try:
        assert not await dead.health()
        with pytest.raises(EngineError):
            await dead.generate(PROMPT, greedy(4))
        with pytest.raises(EngineError):
            await collect_chunks(dead.stream(PROMPT, greedy(4)))
        with pytest.raises(EngineError):
            await dead.connect()
    finally:
        await dead.close()


ANSWER = {
    "text": "hi",
    "output_ids": [7, 8],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "length", "length": 2},
        "completion_tokens": 2,
        "weight_version": "3",
        "weight_versions": [
            {"version": "2", "start": 0, "end": 1},
            {"version": "3", "start": 1, "end": 2},
        ],
        "output_token_logprobs": [[-0.5, 7, None], [-1, 8, "x"]],
        "output_top_logprobs": [None, [[-1.0, 8, None]]],
        "some_new_field": {"servers add": "fields"},
    },
}


def _with(path: str, value: object) -> bytes:
    answer = json.loads(json.dumps(ANSWER))
    *parents, last = path.split(".")
    node = answer
    for key in parents:
        node = node[key]
    node[last] = value
    return json.dumps(answer).encode()


def test_answers_are_read_with_their_field_types_checked():

    meta = _parse_event(json.dumps(ANSWER).encode())["meta_info"]
    assert meta["output_token_logprobs"][1] == [-1, 8, "x"]
    cases = {
        "meta_info.completion_tokens": "2",
        "meta_info.finish_reason": {"length": 2},
        "meta_info.weight_versions": [{"version": 1.5, "start": 0, "end": 2}],
        "meta_info.output_token_logprobs": [[-0.5, "7", None]],
        "meta_info.output_top_logprobs": [[[-0.5, 7]]],
        "error": "overloaded",
    }
    for path, value in cases.items():
        with pytest.raises(EngineError, match="cannot read"):
            _parse_event(_with(path, value))
    with pytest.raises(EngineError, match="cannot read"):
        _parse_event(b"<html>502</html>")


async def test_abort_ends_stream_with_abort(engine):
    chunks: list[Chunk] = []
    async for chunk in engine.stream(PROMPT, greedy(4000, ignore_eos=True), request_id="abort-me"):
        chunks.append(chunk)
        if len(chunks) == 3:
            assert engine.load == 1
            await engine.abort("abort-me")
    assert chunks[-1].finish_reason == "abort"
    n = sum(len(c.token_ids) for c in chunks)
    assert 3 <= n < 4000
    await engine.abort("no-such-request")  # unknown ids are ignored


async def test_abort_ends_a_whole_generate_with_what_it_made():
    """What the gateway does when a non-streaming client leaves: abort, and log the tokens made."""
    with contextlib.ExitStack() as stack:
        url = REAL_URL or stack.enter_context(serve_fake("--tokens-per-s", "200"))
        engine = await SGLangEngine(url).connect()
        try:
            params = greedy(4000, ignore_eos=True)
            task = asyncio.ensure_future(engine.generate(PROMPT, params, request_id="abort-all"))
            await asyncio.sleep(0.5)
            await engine.abort("abort-all")
            out = await asyncio.wait_for(task, 10)
            assert out.finish_reason == "abort"
            assert 0 < len(out.output_ids) == len(out.output_logprobs) < 4000
        finally:
            await engine.close()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_then_resume_loses_nothing(engine, mode):
    params = greedy(400, ignore_eos=True)
    reference = await engine.generate(PROMPT, params)
    stream = engine.stream(PROMPT, params)
    ids = []
    async for chunk in stream:
        ids += chunk.token_ids
        if len(ids) >= 3:
            break
    await engine.pause(mode)
    try:
        # Events already on the wire still arrive; then nothing comes while paused.
        while True:
            pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait([pending], timeout=0.5)
            if not done:
                break
            chunk = pending.result()
            assert chunk.finish_reason is None, f"a request paused ({mode}) must not finish"
            ids += chunk.token_ids
        assert len(ids) < len(reference.output_ids)
    finally:
        await engine.resume()
    last = await pending
    ids += last.token_ids
    finish = last.finish_reason
    async for chunk in stream:
        ids += chunk.token_ids
        finish = chunk.finish_reason
    assert finish == "length"
    assert ids == reference.output_ids


async def test_pause_abort_ends_running_and_holds_new_requests(engine):
    chunks: list[Chunk] = []

    async def consume():
        async for chunk in engine.stream(PROMPT, greedy(4000, ignore_eos=True)):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    while not chunks:
        await asyncio.sleep(0.01)
    await engine.pause("abort")
    try:
        await asyncio.wait_for(task, 10)
        assert chunks[-1].finish_reason == "abort"
        held = asyncio.create_task(engine.generate(PROMPT, greedy(4)))
        await asyncio.sleep(0.3)
        assert not held.done()  # new requests wait while paused
    finally:
        await engine.resume()
    out = await asyncio.wait_for(held, 10)
    assert len(out.output_ids) >= 1


async def test_score_matches_generation_logprobs(engine):
    out = await engine.generate(PROMPT, greedy(8, ignore_eos=True))
    seq = PROMPT + out.output_ids
    scores = await engine.score([seq, PROMPT], [len(PROMPT), 1])
    assert scores[0] == pytest.approx(out.output_logprobs, abs=LOGPROB_TOL)
    assert len(scores[1]) == len(PROMPT) - 1 and all(s <= 0 for s in scores[1])
    with pytest.raises(ValueError, match="start"):
        await engine.score([PROMPT], [0])
    with pytest.raises(ValueError, match="start positions"):
        await engine.score([PROMPT], [1, 2])


async def test_flush_cache_and_memory_occupation(engine):
    await engine.flush_cache()
    await engine.release_memory_occupation(["kv_cache"])
    await engine.resume_memory_occupation(["kv_cache"])
    out = await engine.generate(PROMPT, greedy(3, ignore_eos=True))
    assert len(out.output_ids) == 3


async def test_failed_weight_update_is_engine_error(engine):
    before = engine.weight_version
    with pytest.raises(EngineError, match="update_weights_from_disk"):
        await engine.update_weights_from_disk("/nonexistent/loongsage-weights", before + 7)
    assert engine.weight_version == before


@pytest.mark.skipif(bool(REAL_URL) and not REAL_MODEL_DIR, reason="set SGLANG_MODEL_DIR")
async def test_update_weights_over_disk_sets_version(engine):
    from safetensors.torch import load_file

    if REAL_URL:
        state = {}
        for f in sorted(glob.glob(os.path.join(REAL_MODEL_DIR, "*.safetensors"))):
            state.update(load_file(f))
    else:
        import torch

        state = {"model.embed_tokens.weight": torch.zeros(4, 2)}
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: shares memory
    version = engine.weight_version + 1
    await engine.update_weights(state, version)
    assert engine.weight_version == version
    out = await engine.generate(PROMPT, greedy(4, ignore_eos=True))
    assert out.output_versions == [version] * 4
    info = await engine.get_model_info()
    assert info["weight_version"] == str(version)
    # A fresh client reads the version back from the server.
    again = await SGLangEngine(engine.url).connect()
    assert again.weight_version == version
    await again.close()


@fake_only
async def test_tensor_and_distributed_updates_need_a_weight_update_session(engine):
    # SGLang refuses them outside /begin_weight_update ... /end_weight_update.
    with pytest.raises(EngineError, match="requires an open begin_weight_update session"):
        await engine.update_weights_from_tensor(["c2VyaWFsaXplZA=="], 50)
    with pytest.raises(EngineError, match="requires an open begin_weight_update session"):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 50)
    with pytest.raises(EngineError, match="without begin_weight_update"):
        await engine.end_weight_update()
    before = engine.weight_version
    await engine.begin_weight_update()
    with pytest.raises(EngineError, match="already open"):
        await engine.begin_weight_update()
    with pytest.raises(EngineError, match="not in process groups"):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 50)
    await engine.init_weights_update_group("127.0.0.1", 29500, 1, 2)
    # A bucket without a version leaves the server's version alone; the last one sets it.
    kw = {"load_format": "flattened_bucket"}
    await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], None, **kw)
    assert engine.weight_version == before
    assert (await engine.get_model_info())["weight_version"] == str(before or "default")
    await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 51, **kw)
    assert engine.weight_version == 51
    await engine.destroy_weights_update_group()
    with pytest.raises(ValueError, match="base64"):
        await engine.update_weights_from_tensor(["not base64!"], 52, **kw)
    await engine.update_weights_from_tensor(["c2VyaWFsaXplZA=="], 52, **kw)
    assert engine.weight_version == 52
    await engine.end_weight_update()
    out = await engine.generate(PROMPT, greedy(2, ignore_eos=True))
    assert out.output_versions == [52, 52]


@fake_only
@pytest.mark.parametrize("streamed", [True, False])
async def test_tokens_carry_the_version_that_sampled_them(streamed):
    """An update while a request runs (paused in place, as TransferMesh does): the tokens
    before it carry the old version, those after it the new one, from SGLang's spans."""
    n = 300  # 1.5 s at 200 tokens/s: still running when the update comes
    params = greedy(n, ignore_eos=True)
    with serve_fake("--tokens-per-s", "200") as url:
        engine = await SGLangEngine(url).connect()
        if streamed:
            stream = engine.stream(PROMPT, params)
            first = await anext(stream)
            rest = asyncio.ensure_future(collect_chunks(stream))
        else:
            done = asyncio.ensure_future(engine.generate(PROMPT, params))
            await asyncio.sleep(0.3)
        await engine.pause("in_place")
        await engine.begin_weight_update()
        await engine.update_weights_from_tensor(["c2VyaWFsaXplZA=="], 1)
        await engine.end_weight_update()
        await engine.resume()
        if streamed:
            versions = first.versions + [v for c in await rest for v in c.versions]
        else:
            versions = (await done).output_versions
        await engine.close()
    assert len(versions) == n
    switch = versions.index(1)
    assert 0 < switch < n
    assert versions == [0] * switch + [1] * (n - switch)


async def test_sampling_params_reach_the_server(engine):
    # Seeded sampling is reproducible; top_k=0 (ours: disabled) must not become SGLang's 400.
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=0, seed=7)
    a = await engine.generate(PROMPT, params)
    b = await engine.generate(PROMPT, params)
    assert len(a.output_ids) >= 1
    if not REAL_URL:  # a GPU needs --enable-deterministic-inference for this
        assert a.output_ids == b.output_ids
    stopped = await engine.generate(PROMPT, greedy(6, stop=("never-generated-xyz",)))
    assert stopped.finish_reason in ("stop", "length")


async def test_concurrent_requests_are_isolated(engine):
    prompts = [[1, 100 + i, 200 + i] for i in range(16)]
    singles = [await engine.generate(p, greedy(8, ignore_eos=True)) for p in prompts[:4]]
    together = await asyncio.gather(
        *(engine.generate(p, greedy(8, ignore_eos=True)) for p in prompts)
    )
    assert all(len(g.output_ids) == 8 and g.finish_reason == "length" for g in together)
    if not REAL_URL:  # GPU kernels are not batch-invariant by default
        for one, many in zip(singles, together, strict=False):
            assert one.output_ids == many.output_ids
    assert engine.load == 0


async def test_connections_are_reused_and_abandoned_streams_closed(engine):
    for _ in range(3):
        await engine.generate(PROMPT, greedy(4, ignore_eos=True))
        async for chunk in engine.stream(PROMPT, greedy(4, ignore_eos=True)):
            if chunk.finish_reason is not None:
                break  # the gateway stops at the finishing chunk
    assert len(engine._pool._idle) == 1  # one keep-alive connection served all six
    stream = engine.stream(PROMPT, greedy(4000, ignore_eos=True))
    await stream.__anext__()
    await stream.aclose()  # abandoned mid-generation: its connection must not be reused
    assert len(engine._pool._idle) == 0 and engine.load == 0
    out = await engine.generate(PROMPT, greedy(4, ignore_eos=True))
    assert len(out.output_ids) == 4


@fake_only
async def test_silent_server_times_out():
    with serve_fake("--latency-ms", "3000") as url:
        slow = await SGLangEngine(url, timeout_s=0.4).connect()
        try:
            with pytest.raises(EngineError, match="TimeoutError"):
                await slow.generate(PROMPT, greedy(4))
            with pytest.raises(EngineError, match="TimeoutError"):
                await collect_chunks(slow.stream(PROMPT, greedy(4)))
            assert slow.load == 0
        finally:
            await slow.close()
