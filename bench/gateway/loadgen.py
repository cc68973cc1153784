"""A small, fast HTTP/1.1 load generator (asyncio streams, keep-alive, chunked/SSE bodies).

httpx costs several hundred microseconds of client CPU per request, which on a 2-core machine
would be measured as server latency; this client does only what the benchmark needs: one
keep-alive connection per worker, a fixed request, the status, the time to the first body byte
and to the end of the body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.reader = self.writer = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, float, bytes]:
        """Returns (status, seconds to the first body byte, body)."""
        if self.writer is None:
            await self._open()
        assert self.reader is not None and self.writer is not None
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        for key, value in (headers or {}).items():
            head.append(f"{key}: {value}")
        head.append(f"Content-Length: {len(body)}")
        start = time.perf_counter()
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                fields[k.strip().lower()] = v.strip()
        first = None
        if fields.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if first is None:
                    first = time.perf_counter() - start
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            data = b"".join(parts)
        else:
            data = await self.reader.readexactly(int(fields.get("content-length", 0)))
            first = time.perf_counter() - start
        if fields.get("connection", "").lower() == "close":
            await self.close()
        return status, first or 0.0, data


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall_s if self.wall_s else 0.0

    def pct(self, q: float, which: str = "latencies") -> float:
        values = sorted(getattr(self, which))
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


async def run_load(
    host: str,
    port: int,
    make_request: Callable[[int, int], tuple[str, str, bytes, dict[str, str]]],
    check: Callable[[int, bytes], str | None],
    concurrency: int,
    duration_s: float,
    warmup: int = 2,
) -> Result:
    """`concurrency` workers, each on its own keep-alive connection, send requests back to back
    for `duration_s` (after `warmup` unrecorded requests each). `make_request(worker, n)` ->
    (method, path, body, headers); `check(status, body)` -> an error description or None."""
    result = Result()
    conns = [Connection(host, port) for _ in range(concurrency)]

    async def one(w: int, n: int, record: bool) -> None:
        method, path, body, headers = make_request(w, n)
        start = time.perf_counter()
        try:
            status, first, data = await conns[w].request(method, path, body, headers)
            error = check(status, data)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            await conns[w].close()
            error, first = repr(exc), 0.0
        if not record:
            return
        if error is None:
            result.latencies.append(time.perf_counter() - start)
            result.first_bytes.append(first)
        else:
            result.errors += 1
            if len(result.error_samples) < 3:
                result.error_samples.append(error[:300])

    async def worker(w: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            await one(w, n, True)
            n += 1

    async def warm(w: int) -> None:
        for i in range(warmup):
            await one(w, -1 - i, False)

    await asyncio.gather(*(warm(w) for w in range(concurrency)))
    started = time.perf_counter()
    deadline = started + duration_s
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    for conn in conns:
        await conn.close()
    return result
