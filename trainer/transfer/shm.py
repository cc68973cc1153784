"""The `shm` route: one write into a /dev/shm segment, every engine on the host reads it.

The sender copies the version into one segment (a file in /dev/shm, mapped in both processes
and kept mapped across pushes, so no push pays page faults), bucket by bucket, the next bucket
gathered while the current one is copied; each receiver then hands views of the segment to its
engine's `update_weights`, which copies them into its weights. Two copies in all, whatever the
number of receivers: the write happens once and the reads run in parallel.

Consistency without a stop-the-world: the segment's header holds the version it contains (-1
while it is written). Readers hold a shared `flock` on the segment while they read and apply; the
writer takes it exclusively to write. A reader that is still busy with an older version (it
timed out, and the mesh moved on) keeps its lock, so the writer unlinks the segment and writes a
new file at the same path: the slow reader finishes on the old, complete inode, and nobody ever
reads a half-written or mixed version. A reader that finds another version in the header fails
and keeps its old weights.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import uuid
import warnings
import weakref
from dataclasses import dataclass

import torch

from trainer.transfer.buckets import Bucket, pack, pipeline, total_bytes, views
from trainer.transfer.endpoints import Placement, Receiver
from trainer.transfer.mesh import Delivery, Push, TransferConfig, apply_weights, guarded

SHM_DIR = "/dev/shm"
HEADER = 4096
"""Header bytes before the data (a page): [magic, version, data bytes] as int64."""
MAGIC = 0x4C6F6F6E53484D31  # "LoonSHM1"


@dataclass
class _Mapped:
    fd: int
    inode: int
    mm: mmap.mmap
    data: torch.Tensor
    """uint8 view of the whole file (header included)."""

    @property
    def header(self) -> torch.Tensor:
        return self.data[:24].view(torch.int64)

    def close(self) -> None:
        del self.data
        self.mm.close()
        os.close(self.fd)


_MAPPED: dict[str, _Mapped] = {}
"""path -> this process's mapping of the segment (writer and readers both keep theirs)."""


def _map(path: str, size: int, writable: bool) -> _Mapped:
    """This process's mapping of the file at `path` (reused while it is the same inode)."""
    flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    inode = os.fstat(fd).st_ino
    old = _MAPPED.get(path)
    if old is not None and old.inode == inode and old.mm.size() >= size:
        os.close(fd)
        return old
    if old is not None:
        old.close()
        del _MAPPED[path]
    if writable and os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)
    size = os.fstat(fd).st_size
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only for readers: they only copy
        data = torch.frombuffer(mm, dtype=torch.uint8)
    _MAPPED[path] = _Mapped(fd, inode, mm, data)
    return _MAPPED[path]


def write_segment(source, path: str, buckets: list[Bucket], version: int, overlap: bool) -> None:
    """Sender side: write `version` into the segment at `path`."""
    size = HEADER + total_bytes(buckets)
    seg = _map(path, size, writable=True)
    try:
        fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a late reader still holds the old version: leave it that inode
        os.unlink(path)
        seg = _map(path, size, writable=True)
        fcntl.flock(seg.fd, fcntl.LOCK_EX)
    try:
        seg.header[:3] = torch.tensor([MAGIC, -1, size - HEADER])
        body = seg.data[HEADER:]
        pipeline(
            buckets,
            lambda b: list(source.hf_tensors(b.names)),
            lambda b, tensors: pack(tensors, b, body[b.start : b.start + b.nbytes]),
            overlap,
        )
        seg.header[1] = version
    finally:
        fcntl.flock(seg.fd, fcntl.LOCK_UN)


async def read_segment(engine, path: str, buckets: list[Bucket], version: int, mode: str) -> float:
    """Receiver side: apply the segment's `version` to `engine`; returns the stall."""
    size = HEADER + total_bytes(buckets)
    seg = await asyncio.to_thread(_map, path, size, False)
    await asyncio.to_thread(fcntl.flock, seg.fd, fcntl.LOCK_SH)
    try:
        magic, found, nbytes = seg.header.tolist()
        if magic != MAGIC or found != version or nbytes != size - HEADER:
            raise RuntimeError(f"the segment holds version {found}, not {version}")
        body = seg.data[HEADER:]
        tensors: dict[str, torch.Tensor] = {}
        for b in buckets:
            tensors |= views(body[b.start : b.start + b.nbytes], b)
        return await apply_weights(engine, tensors, version, mode)
    finally:
        fcntl.flock(seg.fd, fcntl.LOCK_UN)


def forget(source, path: str) -> None:
    """Drop this process's mapping of `path` (the sender's, when the mesh closes)."""
    seg = _MAPPED.pop(path, None)
    if seg is not None:
        seg.close()


class ShmRoute:
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self.path = os.path.join(SHM_DIR, f"loongsage-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._sender = None
        # The segment goes with the route even if nobody closes it (a crashed run leaves it).
        self._unlink = weakref.finalize(self, _unlink, self.path)

    def reaches(self, sender: Placement, receiver: Placement) -> str:
        if (
            sender.same_node(receiver)
            and receiver.api == "engine"
            and not receiver.gpu
            and os.path.isdir(SHM_DIR)
        ):
            return "same host, CPU: one write into /dev/shm, each engine reads it"
        return ""

    async def push(self, push: Push, receivers: list[Receiver]) -> dict[str, Delivery]:
        self._sender = push.sender
        try:
            await push.sender.run(
                write_segment,
                self.path,
                push.buckets,
                push.version,
                push.cfg.pipeline,
                reads=push.reads,
            )
        except Exception as exc:  # noqa: BLE001 - nobody gets this version
            failed = Delivery(False, error=f"writing the segment failed: {exc!r}")
            return {r.name: failed for r in receivers}
        args = (self.path, push.buckets, push.version, push.mode)
        done = await asyncio.gather(
            *(guarded(r.run(read_segment, *args), self.cfg.timeout_s) for r in receivers)
        )
        return {r.name: d for r, d in zip(receivers, done, strict=True)}

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.run(forget, self.path)
        self._unlink()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
