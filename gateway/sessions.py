"""Sessions: one per rollout (or per interactive agent), each with its own key and token log.

A session holds the calls' turns (the trajectory being built), the token-in-token-out history
used to render the next prompt, the reward the controller attaches, and its in-flight requests
(for the per-session concurrency limit and for aborting them on close). `SessionStore` finds
sessions by id and by API key and forgets the oldest closed ones beyond a bound, so a long
training run does not grow without limit. A closed open-mode session (closed by the admin, or idle
for `idle_session_s`) moves to `<id>~1` (then `~2`, ...), where it stays exportable; its key's
next request starts a fresh session under the id.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gateway.render import TokenHistory
from gateway.trajectory import Status, Trajectory, Turn


@dataclass(eq=False)
class Session:
    id: str
    api_key: str
    trajectory: Trajectory
    history: TokenHistory = field(default_factory=TokenHistory)
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    """When the last request began or ended (monotonic), for closing idle open-mode sessions."""
    closed: bool = False
    requests: int = 0
    """Requests in flight (a request with `n > 1` counts once)."""
    request_ids: set[str] = field(default_factory=set)
    """Engine request ids in flight, for abort on close."""
    forks: int = 0
    """Requests that extended none of the session's earlier calls (re-rendered from scratch)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling fields forced on every call (training: the rollout temperature the trainer
    scales its logits by), whatever a black-box agent asks for."""
    max_tokens: int | None = None
    """A cap on every call's output, applied when the agent asks for more or for nothing
    (black-box agents that send no max_tokens)."""
    open_mode: bool = False
    """Opened by its key in auth=open: closing it frees the key for a fresh session."""
    _idle: asyncio.Event | None = None

    def add_turn(self, turn: Turn) -> None:
        self.trajectory.turns.append(turn)

    def begin(self) -> None:
        self.requests += 1
        self.last_used = time.monotonic()
        if self._idle is not None:
            self._idle.clear()

    def end(self) -> None:
        self.requests -= 1
        self.last_used = time.monotonic()
        if self.requests == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        if self.requests == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def export(self) -> Trajectory:
        """The trajectory so far, segments rebuilt from the turns."""
        self.trajectory.rebuild_segments()
        return self.trajectory

    def summary(self) -> dict[str, Any]:
        t = self.trajectory
        return {
            "id": self.id,
            "status": t.status if self.closed else "open",
            "reward": t.reward,
            "metadata": t.metadata,
            "turns": len(t.turns),
            "output_tokens": t.num_output_tokens,
            "requests_in_flight": self.requests,
            "forks": self.forks,
            "created_at": self.created_at,
        }


class SessionStore:
    def __init__(self, max_closed: int = 10_000) -> None:
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._by_key: dict[str, Session] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self.max_closed = max_closed

    def create(
        self,
        metadata: dict[str, Any] | None = None,
        session_id: str | None = None,
        api_key: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Session:
        sid = session_id or "s-" + secrets.token_hex(8)
        if sid in self._by_id:
            raise ValueError(f"session id {sid!r} already exists; pick another id or omit it")
        key = api_key or "sk-ls-" + secrets.token_urlsafe(24)
        session = Session(sid, key, Trajectory(session_id=sid, metadata=dict(metadata or {})))
        session.sampling = {k: v for k, v in (sampling or {}).items() if v is not None}
        self._by_id[sid] = session
        self._by_key[key] = session
        return session

    def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def by_key(self, api_key: str) -> Session | None:
        return self._by_key.get(api_key)

    def mark_closed(self, session: Session, status: Status, reason: str) -> None:
        session.closed = True
        session.trajectory.status = status
        session.trajectory.reason = reason
        self._closed[session.id] = None
        while len(self._closed) > self.max_closed:
            old, _ = self._closed.popitem(last=False)
            gone = self._by_id.pop(old, None)
            if gone is not None and self._by_key.get(gone.api_key) is gone:
                del self._by_key[gone.api_key]

    def discard(self, session: Session) -> None:
        """Forget a session that never served a request (opened by a request that failed)."""
        if self._by_id.get(session.id) is session:
            del self._by_id[session.id]
        if self._by_key.get(session.api_key) is session:
            del self._by_key[session.api_key]
        self._closed.pop(session.id, None)

    def archive(self, session: Session) -> None:
        """Move a closed session to a free id `<id>~<n>`, so its id can start a new session."""
        n = 1
        while f"{session.id}~{n}" in self._by_id:
            n += 1
        new_id = f"{session.id}~{n}"
        del self._by_id[session.id], self._closed[session.id]
        if self._by_key.get(session.api_key) is session:
            del self._by_key[session.api_key]
        session.id = session.trajectory.session_id = new_id
        self._by_id[new_id] = session
        self._closed[new_id] = None

    def all(self) -> list[Session]:
        return list(self._by_id.values())

    @property
    def num_open(self) -> int:
        return len(self._by_id) - len(self._closed)
