"""`Router` over several fake SGLang servers: stickiness, least-loaded placement, health checks
taking engines out and back in, failover, fan-out of control, and `weight_version`."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from fake_sglang import free_port, serve_fake

from gateway.engines.base import Engine, EngineError, SamplingParams
from gateway.engines.router import Router
from gateway.engines.sglang import SGLangEngine

PROMPT = [1, 2000, 3000, 4000]
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
FAKE_ARGS = ("--tokens-per-s", "2000", "--health-timeout-s", "0.2")


@pytest.fixture(scope="module")
def urls():
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve_fake(*FAKE_ARGS)) for _ in range(3)]


async def make_router(urls: list[str], **kw) -> Router:
    return await Router([SGLangEngine(u, timeout_s=10) for u in urls], **kw).connect()


async def server_requests(url: str) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(url + "/get_server_info")).json()["num_requests"]


async def set_health(url: str, healthy: bool) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(url + "/_fake/health", json={"healthy": healthy})


async def test_router_is_an_engine(urls):
    router = await make_router(urls)
    try:
        assert isinstance(router, Engine)
        assert router.max_context == 4096
        assert await router.health()
        out = await router.generate(PROMPT, SHORT)
        assert len(out.output_ids) == 4
        with pytest.raises(ValueError):  # the caller's mistake: no failover, nobody marked down
            await router.generate([5] * 5000, SHORT)
        assert router.healthy == [True, True, True]
    finally:
        await router.close()


async def test_sessions_stick_to_their_engine(urls):
    router = await make_router(urls)
    try:
        before = [await server_requests(u) for u in urls]
        sessions = [f"s{i}" for i in range(6)]
        for turn in range(3):
            for s in sessions:
                if turn % 2:
                    await router.generate(PROMPT, SHORT, session_id=s)
                else:
                    chunks = [c async for c in router.stream(PROMPT, SHORT, session_id=s)]
                    assert chunks[-1].finish_reason == "length"
        pinned = {s: router.engine_for(s) for s in sessions}
        # Idle engines: ties rotate, so six new sessions spread two per engine.
        assert sorted(pinned.values()) == [0, 0, 1, 1, 2, 2]
        after = [await server_requests(u) for u in urls]
        assert [a - b for a, b in zip(after, before, strict=True)] == [6, 6, 6]
    finally:
        await router.close()


async def test_new_sessions_go_to_the_least_loaded_engine(urls):
    router = await make_router(urls)
    try:
        streams = []
        for s in ("busy-a", "busy-b"):
            stream = router.stream(PROMPT, LONG, session_id=s)
            await stream.__anext__()  # running: its engine now has load 1
            streams.append(stream)
        busy = {router.engine_for("busy-a"), router.engine_for("busy-b")}
        assert len(busy) == 2
        await router.generate(PROMPT, SHORT, session_id="fresh")
        assert router.engine_for("fresh") not in busy
        for stream in streams:
            await stream.aclose()
    finally:
        await router.close()


async def test_health_checks_take_engines_out_and_back(urls):
    router = await make_router(urls, health_interval_s=0.05)
    try:
        await set_health(urls[1], False)
        for _ in range(200):
            if not router.healthy[1]:
                break
            await asyncio.sleep(0.02)
        assert router.healthy == [True, False, True]
        for i in range(6):
            await router.generate(PROMPT, SHORT, session_id=f"h{i}")
            assert router.engine_for(f"h{i}") != 1
        await set_health(urls[1], True)
        for _ in range(200):
            if router.healthy[1]:
                break
            await asyncio.sleep(0.02)
        assert router.healthy == [True, True, True]
        for i in range(3):
            await router.generate(PROMPT, SHORT, session_id=f"after{i}")
        assert 1 in {router.engine_for(f"after{i}") for i in range(3)}  # back in rotation
    finally:
        await set_health(urls[1], True)
        await router.close()


async def test_no_healthy_engine_is_engine_error(urls):
    router = await make_router(urls[:2])
    try:
        for u in urls[:2]:
            await set_health(u, False)
        await router.check_health()
        assert not await router.health()
        with pytest.raises(EngineError, match="no healthy engine"):
            await router.generate(PROMPT, SHORT)
    finally:
        for u in urls[:2]:
            await set_health(u, True)
        await router.close()


async def test_failover_moves_a_session_when_its_engine_dies():
    with contextlib.ExitStack() as keep:
        port = free_port()
        dying = contextlib.ExitStack()
        url0 = dying.enter_context(serve_fake(*FAKE_ARGS, port=port))
        url1 = keep.enter_context(serve_fake(*FAKE_ARGS))
        router = await make_router([url0, url1], health_interval_s=3600)
        try:
            await router.generate(PROMPT, SHORT, session_id="s")
            await router.generate(PROMPT, SHORT, session_id="t")
            victim = router.engine_for("s")
            assert victim == 0 or router.engine_for("t") == 0
            session = "s" if victim == 0 else "t"
            reference = await router.generate(PROMPT, SHORT, session_id=session)
            dying.close()  # the server of engine 0 is gone
            # Streaming and non-streaming both fail over before the first token.
            chunks = [c async for c in router.stream(PROMPT, SHORT, session_id=session)]
            assert [t for c in chunks for t in c.token_ids] == reference.output_ids
            assert router.healthy == [False, True]
            assert router.engine_for(session) == 1
            out = await router.generate(PROMPT, SHORT, session_id=session)
            assert out.output_ids == reference.output_ids
            # The server comes back on the same port: a health check returns it to rotation.
            with serve_fake(*FAKE_ARGS, port=port):
                assert await router.check_health() == [True, True]
                assert router.engine_for(session) == 1  # the session stays where its cache is
        finally:
            dying.close()
            await router.close()


async def test_failure_after_first_token_is_raised_not_replayed():
    servers = [contextlib.ExitStack(), contextlib.ExitStack()]
    urls = [stack.enter_context(serve_fake(*FAKE_ARGS)) for stack in servers]
    router = await make_router(urls)
    try:
        await router.generate(PROMPT, SHORT, session_id="x")
        stream = router.stream(PROMPT, LONG, session_id="x")
        await stream.__anext__()
        servers[router.engine_for("x")].close()  # its server dies mid-stream
        with pytest.raises(EngineError):
            async for _ in stream:
                pass
    finally:
        await router.close()
        for stack in servers:
            stack.close()


async def test_abort_reaches_the_engine_running_the_request(urls):
    router = await make_router(urls)
    try:
        chunks = []
        async for chunk in router.stream(PROMPT, LONG, request_id="r-1", session_id="ab"):
            chunks.append(chunk)
            if len(chunks) == 2:
                await router.abort("r-1")
        assert chunks[-1].finish_reason == "abort"
        await router.abort("unknown")  # ignored
    finally:
        await router.close()


async def test_control_fans_out_and_weight_version_is_the_minimum(urls):
    router = await make_router(urls)
    try:
        await router.pause("in_place")
        async with httpx.AsyncClient() as client:
            infos = [(await client.get(u + "/get_server_info")).json() for u in urls]
        assert all(info["paused"] for info in infos)
        await router.resume()
        assert (await router.generate(PROMPT, SHORT)).output_ids
        # Versions differ when engines were updated one by one (TransferMesh routes do that):
        # those behind the newest leave the rotation, new sessions go to the updated one.
        v = router.weight_version
        await router.engines[0].begin_weight_update()
        await router.engines[0].update_weights_from_tensor(["eA=="], v + 5)
        await router.engines[0].end_weight_update()
        assert router.weight_version == v + 5
        out = await router.generate(PROMPT, SHORT, session_id="newest")
        assert router.engine_for("newest") == 0 and out.output_versions == [v + 5] * 4
        import torch

        await router.update_weights({"w": torch.ones(2)}, v + 10)
        assert [e.weight_version for e in router.engines] == [v + 10] * 3
        assert router.weight_version == v + 10
        seen = set()
        for i in range(3):
            out = await router.generate(PROMPT, SHORT, session_id=f"w{i}")
            seen |= set(out.output_versions)
        assert seen == {v + 10}
    finally:
        await router.close()


async def test_engine_that_missed_a_push_stays_out_until_the_next_one():
    import torch

    port = free_port()
    with serve_fake(*FAKE_ARGS) as url0, serve_fake(*FAKE_ARGS) as url1:
        down = serve_fake(*FAKE_ARGS, port=port)
        url2 = down.__enter__()
        router = await make_router([url0, url1, url2])
        try:
            down.__exit__(None, None, None)
            await router.check_health()
            await router.update_weights({"w": torch.ones(2)}, 1)  # engine 2 misses it
            with serve_fake(*FAKE_ARGS, port=port):
                assert await router.check_health() == [True, True, True]
                assert router.weight_version == 1  # engine 2 (version 0) is not in rotation
                for i in range(6):
                    out = await router.generate(PROMPT, SHORT, session_id=f"m{i}")
                    assert out.output_versions == [1] * 4
                    assert router.engine_for(f"m{i}") != 2
                await router.update_weights({"w": torch.ones(2)}, 2)
                assert [e.weight_version for e in router.engines] == [2, 2, 2]
                await router.generate(PROMPT, SHORT, session_id="back")
                assert router.engine_for("back") == 2
        finally:
            await router.close()


async def test_score_through_router(urls):
    router = await make_router(urls)
    try:
        out = await router.generate(PROMPT, SHORT)
        (scores,) = await router.score([PROMPT + out.output_ids], [len(PROMPT)])
        assert scores == pytest.approx(out.output_logprobs, abs=1e-9)
    finally:
        await router.close()


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one engine"):
        Router([])
    with pytest.raises(ValueError, match="health_interval_s"):
        Router([SGLangEngine("http://127.0.0.1:1")], health_interval_s=0)


async def test_router_connects_on_first_use(urls):
    # The gateway's engine factory only constructs the Router.
    router = Router([SGLangEngine(u) for u in urls])
    try:
        assert router.max_context == 4096  # read synchronously, before any connection
        assert await router.health()
        out = await router.generate(PROMPT, SHORT, session_id="lazy")
        assert len(out.output_ids) == 4
    finally:
        await router.close()


async def test_pause_update_resume_cycle_keeps_every_engine(urls):
    import torch

    router = await make_router(urls)
    try:
        v = router.weight_version
        await router.pause("abort")
        # A paused SGLang server fails its health probe; the router must not count that.
        assert await router.engines[0].health() is False
        assert await router.check_health() == [True, True, True]
        await router.update_weights({"w": torch.ones(2)}, v + 1)
        await router.resume()
        assert await router.check_health() == [True, True, True]
        assert [e.weight_version for e in router.engines] == [v + 1] * 3
        for i in range(3):
            out = await router.generate(PROMPT, SHORT, session_id=f"cycle{i}")
            assert out.output_versions == [v + 1] * 4
    finally:
        await router.close()


async def generated(url: str) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(url + "/get_server_info")).json()["generated_tokens"]


@pytest.mark.parametrize("how", ["generate", "stream"])
async def test_a_request_its_caller_leaves_is_aborted_on_its_engine(how):
    """The gateway cancels a non-streaming call (or closes a stream) when its client goes away;
    the engine running it must stop then, not run on to max_tokens."""
    with serve_fake("--tokens-per-s", "200") as url:  # slow enough to see it run on
        router = await make_router([url])
        try:
            if how == "generate":
                task = asyncio.ensure_future(router.generate(PROMPT, LONG, session_id="gone"))
            else:

                async def consume() -> None:
                    async for _ in router.stream(PROMPT, LONG, session_id="gone"):
                        pass

                task = asyncio.ensure_future(consume())
            while await generated(url) < 10:
                await asyncio.sleep(0.01)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            stopped = await generated(url)
            await asyncio.sleep(0.5)  # ~100 more tokens if it ran on
            assert await generated(url) - stopped < 5
        finally:
            await router.close()
