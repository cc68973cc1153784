"""asyncio helpers of the generation core: merging choice streams, and cleanup that a
cancellation cannot cut short (so every turn is logged however a request ends)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any


async def close_all(tasks: list[asyncio.Future], gens: list[AsyncIterator[Any]]) -> None:
    """Cancel `tasks` and close `gens`, so every choice's turn is logged before this returns."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:
        with contextlib.suppress(Exception):
            await g.aclose()  # type: ignore[attr-defined]


async def shielded(cleanup: Awaitable[None]) -> None:
    """Run `cleanup` to the end even when the caller is being cancelled (Starlette cancels a
    streaming response's task group when the client goes away, and AnyIO cancellation raises
    again at every await, which would skip logging the turns)."""
    task = asyncio.ensure_future(cleanup)
    try:
        await asyncio.shield(task)
    except BaseException:
        await asyncio.wait({task})
        raise


async def merge(
    gens: list[AsyncIterator[Any]], firsts: list[Any]
) -> AsyncIterator[tuple[int, Any]]:
    """Events of several choices as they come, tagged with the choice index."""
    live = [i for i, ev in enumerate(firsts) if ev.finish is None]
    if len(live) == 1:
        i = live[0]
        async for ev in gens[i]:
            yield i, ev
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for ev in gens[i]:
                await queue.put((i, ev))
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        await shielded(close_all(tasks, []))
