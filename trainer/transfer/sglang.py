"""How every route switches an SGLang server to a new version (the receiving half is SGLang's).

SGLang loads each bucket into its live weights as it arrives, so the switch is made atomic from
the outside: the server is paused first (`in_place` for `partial_rollout=continue`: running
requests keep their cache and go on with the new weights; `retract` for `abort_resubmit`: they
are recomputed), tensor and distributed buckets are sent inside `/begin_weight_update` ...
`/end_weight_update` (SGLang refuses them outside such a session), `weight_version` rides on the
last bucket only (SGLang stamps it as soon as a request carrying it succeeds), the cache is
flushed with the last bucket when it can be (not while requests are held in place), and
generation continues. A server that fails after its first bucket holds a mix of versions: it
is paused with `abort` (its running requests end) and stays paused, so it serves nothing until a
later push gives it a whole version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("loongsage.transfer")


async def sglang_update(
    engine: Any, mode: str, load: Callable[[bool], Awaitable[None]], session: bool
) -> float:
    """Pause `engine`, `await load(flush)` (inside a weight-update session if `session`), then
    continue; returns the stall (pause to continue). See the module docstring for failures."""
    start = time.perf_counter()
    pause = "retract" if mode == "abort_resubmit" else "in_place"
    await engine.pause(pause)
    try:
        if session:
            await engine.begin_weight_update()
        try:
            await load(pause == "retract")
        finally:
            if session:
                await engine.end_weight_update()
    except BaseException:
        try:
            await engine.pause("abort")  # a mix of versions must not serve: keep it paused
        except Exception as exc:  # noqa: BLE001 - already failing; the push reports the cause
            log.warning("%r: could not abort its requests after a failed update: %r", engine, exc)
        raise
    await engine.resume()
    return time.perf_counter() - start
