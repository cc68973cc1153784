"""The `shm` route: the trainer's weights live in a /dev/shm segment, every engine on the host
copies them from there.

The segment is a file in /dev/shm, mapped in both processes and kept mapped across pushes, so no
push pays page faults. The first push writes the version into it, bucket by bucket (the next
bucket gathered while the current one is copied), and then, where the sender's weights are
tensors it may move (a `StateDictSource` over the trainer's own parameters), moves them into it:
the trainer's optimizer then updates the segment in place, and later pushes copy nothing on the
sender's side. Each receiver hands views of the segment to its engine's `update_weights`, which
copies them into its weights: one copy per push (two for a sender whose tensors cannot move, such
as a sharded trainer's gathered ones), and the reads of several receivers run in parallel.

Consistency without a stop-the-world: the segment's header holds the version it contains (-1
while it may change). Readers hold a shared `flock` on the segment while they read and apply;
the sender holds it exclusively at every other time: while it writes, and between pushes, while
the trainer changes its weights in place (`seal`, run once the receivers have answered). A
reader that is still busy with an older version (it timed out, and the mesh moved on) keeps its
lock, so the sender moves its weights back to private memory, unlinks the segment and writes a
new file at the same path: the slow reader finishes on the old, complete inode, and nobody ever
reads a half-written or mixed version. A reader that finds another version in the header fails
and keeps its old weights.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import uuid
import warnings
import weakref
from dataclasses import dataclass

import torch

from trainer.transfer.buckets import Bucket, pack, pipeline, total_bytes, views
from trainer.transfer.endpoints import Placement, Receiver, ScriptedReads, StateDictSource
from trainer.transfer.mesh import Delivery, Push, TransferConfig, apply_weights, guarded

log = logging.getLogger("loongsage.transfer")

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
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping ends with it
            pass
        os.close(self.fd)

    def holds(self, tensor: torch.Tensor) -> bool:
        start = self.data.data_ptr()
        return tensor.device.type == "cpu" and start <= tensor.data_ptr() < start + len(self.mm)


_MAPPED: dict[tuple[str, bool], _Mapped] = {}
"""(path, writable) -> this process's mappings of the segment: the sender's and a reader's are
two (two open files, two locks), even in one process."""


def _map(path: str, size: int, writable: bool) -> _Mapped:
    """This process's mapping of the file at `path` (reused while it is the same inode)."""
    flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    inode = os.fstat(fd).st_ino
    key = (path, writable)
    old = _MAPPED.get(key)
    if old is not None and old.inode == inode and old.mm.size() >= size:
        os.close(fd)
        return old
    if old is not None:
        old.close()
        del _MAPPED[key]
    if writable and os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)
    size = os.fstat(fd).st_size
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only for readers: they only copy
        data = torch.frombuffer(mm, dtype=torch.uint8)
    _MAPPED[key] = _Mapped(fd, inode, mm, data)
    return _MAPPED[key]


def write_segment(source, path: str, buckets: list[Bucket], version: int, overlap: bool) -> None:
    """Sender side: make the segment at `path` hold `version` (written, unless the sender's
    weights already live in it), then unlock it for the readers."""
    size = HEADER + total_bytes(buckets)
    seg = _exclusive(source, path, size)
    try:
        own = _movable(source)
        if own is None or not _lives_in(own, seg, buckets):
            seg.header[:3] = torch.tensor([MAGIC, -1, size - HEADER])
            body = seg.data[HEADER:]
            pipeline(
                buckets,
                lambda b: list(source.hf_tensors(b.names)),
                lambda b, tensors: pack(tensors, b, body[b.start : b.start + b.nbytes]),
                overlap,
            )
            if own is not None:
                _move_into(own, seg, buckets)
        seg.header[1] = version
    finally:
        fcntl.flock(seg.fd, fcntl.LOCK_UN)


def seal(source, path: str, buckets: list[Bucket]) -> None:
    """Sender side, once the readers have answered: lock the segment until the next push, since
    the trainer may now change the weights that live in it."""
    seg = _exclusive(source, path, HEADER + total_bytes(buckets))
    seg.header[1] = -1


def _exclusive(source, path: str, size: int) -> _Mapped:
    """The sender's mapping of the segment, locked exclusively. A reader still holding an older
    version keeps that file as it is: the weights leave it and a new file takes the path."""
    seg = _map(path, size, writable=True)
    try:
        fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        own = _movable(source)
        if own is not None:
            _move_out(own, seg)
        os.unlink(path)
        seg = _map(path, size, writable=True)
        fcntl.flock(seg.fd, fcntl.LOCK_EX)
    return seg


def _movable(source) -> StateDictSource | None:
    """The sender's tensors, if they are ones it may move into the segment (a state dict of the
    trainer's own parameters; a sharded trainer gathers copies, which it may not)."""
    if isinstance(source, ScriptedReads):
        source = source.source
    return source if isinstance(source, StateDictSource) else None


def _lives_in(own: StateDictSource, seg: _Mapped, buckets: list[Bucket]) -> bool:
    base = seg.data.data_ptr() + HEADER
    for b in buckets:
        for spec, offset in zip(b.specs, b.offsets, strict=True):
            t = own.tensors[spec.name]
            if t.data_ptr() != base + b.start + offset or not t.is_contiguous():
                return False
    return True


def _move_into(own: StateDictSource, seg: _Mapped, buckets: list[Bucket]) -> None:
    """The sender's tensors become views of the segment (which holds their values)."""
    body = seg.data[HEADER:]
    with torch.no_grad():
        for b in buckets:
            for name, view in views(body[b.start : b.start + b.nbytes], b).items():
                if seg.holds(view):
                    own.tensors[name].set_(view)


def _move_out(own: StateDictSource, seg: _Mapped) -> None:
    """The sender's tensors that live in `seg` move to private memory (with their values)."""
    with torch.no_grad():
        for t in own.tensors.values():
            if seg.holds(t):
                t.set_(t.clone())


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
    """Drop this process's mapping of `path` (the sender's, when the mesh closes); the sender's
    weights that live in it move back to private memory first."""
    seg = _MAPPED.pop((path, True), None)
    if seg is not None:
        own = _movable(source)
        if own is not None:
            _move_out(own, seg)
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
            return "same host, CPU: the weights live in /dev/shm, each engine copies them"
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
        try:
            await push.sender.run(seal, self.path, push.buckets)
        except Exception:  # noqa: BLE001 - the sender is gone: the next push reports it
            log.warning("shm: sealing the segment after version %d failed", push.version)
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
