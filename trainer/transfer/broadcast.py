"""The `broadcast` route: one collective broadcast per bucket reaches every receiver of a group.

gloo between CPU processes, NCCL between GPUs. The trainer's sending process is rank 0 of a
process group of its own (not the trainer's default group), created the way SGLang's
`/init_weights_update_group` creates its side (`init_group`: a TCP store at the trainer, a
prefixed store per group name, torch's group helper), so the same code joins our engine actors
and SGLang servers. Rank 0 packs bucket k+1 while bucket k is broadcast (double-buffered).

Receivers of ours receive every bucket of a version into a buffer of their own and apply the
version only when the last bucket is in: all of it or nothing. SGLang servers join with
`/init_weights_update_group` (rank offset and world size counting each server's TP ranks) and
receive each bucket with `/update_weights_from_distributed` (`load_format="flattened_bucket"`:
one broadcast per bucket, our bucket layout is theirs), as `trainer/transfer/sglang.py` says.

A group lives across pushes and is rebuilt when its members change or a push on it failed (a
dead member breaks a collective for everyone; the mesh then retries the live ones on a new
group within the same push).
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.transfer.buckets import Bucket, pack, pipeline, total_bytes, views
from trainer.transfer.endpoints import Placement, Receiver
from trainer.transfer.mesh import Delivery, Push, TransferConfig, apply_weights, guarded
from trainer.transfer.sglang import sglang_update


@dataclass(frozen=True)
class Group:
    name: str
    backend: str
    """gloo or nccl."""
    device: str
    """Where the sender's buckets are: cuda (a GPU trainer) or cpu."""
    host: str
    port: int
    world_size: int
    timeout_s: float


def init_group(group: Group, rank: int) -> Any:
    """Join `group` as `rank` (blocks until every rank has joined); what SGLang's
    `init_custom_process_group` does on the server side."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=group.timeout_s)
    url = f"tcp://{group.host}:{group.port}"
    store, rank, world_size = next(rendezvous(url, rank, group.world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group.name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(group.backend), store, group_name=group.name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


_JOINED: dict[str, Any] = {}
"""This process's weight groups: name -> process group."""


def _join(group: Group, rank: int) -> Any:
    # Older groups are left by the thread that saw them fail (destroying a group another
    # thread still waits in is not safe); a group that stops being used costs a few sockets.
    if group.name not in _JOINED:
        _JOINED[group.name] = init_group(group, rank)
    return _JOINED[group.name]


def _leave(name: str) -> None:
    pg = _JOINED.pop(name, None)
    if pg is not None:
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
            pass


def address(source) -> tuple[str, int]:
    """Sender side: an address of this host the receivers reach, and a free port on it."""
    try:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:  # pragma: no cover
        host = "127.0.0.1"
    with socket.socket() as sock:
        sock.bind(("", 0))
        return host, sock.getsockname()[1]


def send(source, group: Group, buckets: list[Bucket], overlap: bool) -> None:
    """Sender side (rank 0): broadcast every bucket, packing the next one meanwhile."""
    pg = _join(group, 0)
    device = group.device
    size = max(b.nbytes for b in buckets)
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]

    def prepare(b: Bucket) -> torch.Tensor:
        out = buffers[b.index % 2][: b.nbytes]
        pack(source.hf_tensors(b.names), b, out)
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        return out

    def broadcast(b: Bucket, flat: torch.Tensor) -> None:
        dist.broadcast(flat, src=0, group=pg)
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        pipeline(buckets, prepare, broadcast, overlap)
    except BaseException:
        _leave(group.name)
        raise


async def receive(
    engine, group: Group, rank: int, buckets: list[Bucket], version: int, mode: str
) -> float:
    """Receiver side (our engines): every bucket into a fresh buffer, then apply them all."""

    def recv() -> torch.Tensor:
        pg = _join(group, rank)
        buffer = torch.empty(total_bytes(buckets), dtype=torch.uint8)
        try:
            for b in buckets:
                dist.broadcast(buffer[b.start : b.start + b.nbytes], src=0, group=pg)
        except BaseException:
            _leave(group.name)
            raise
        return buffer

    buffer = await asyncio.to_thread(recv)
    tensors: dict[str, torch.Tensor] = {}
    for b in buckets:
        tensors |= views(buffer[b.start : b.start + b.nbytes], b)
    return await apply_weights(engine, tensors, version, mode)


class BroadcastRoute:
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self.group: Group | None = None
        self.members: tuple[str, ...] = ()

    def reaches(self, sender: Placement, receiver: Placement) -> str:
        if sender.gpu != receiver.gpu or (receiver.api == "sglang" and not sender.gpu):
            return ""  # our engines are on CPU; SGLang receives onto its GPU
        backend = self.cfg.broadcast_backend or ("nccl" if sender.gpu else "gloo")
        return f"{backend} broadcast group: one broadcast per bucket reaches all its members"

    async def push(self, push: Push, receivers: list[Receiver]) -> dict[str, Delivery]:
        ranks = [await _ranks(r) for r in receivers]
        members = tuple(r.name for r in receivers)
        fresh = self.group is None or members != self.members
        if fresh:
            host, port = await push.sender.run(address)
            gpu = push.sender.placement.gpu
            self.group = Group(
                f"loongsage-weights-{uuid.uuid4().hex[:8]}",
                self.cfg.broadcast_backend or ("nccl" if gpu else "gloo"),
                "cuda" if gpu else "cpu",
                host,
                port,
                1 + sum(ranks),
                self.cfg.timeout_s,
            )
            self.members = members
        group = self.group
        offsets = [1 + sum(ranks[:i]) for i in range(len(receivers))]
        sending = asyncio.ensure_future(
            push.sender.run(send, group, push.buckets, push.cfg.pipeline, reads=push.reads)
        )
        done = await asyncio.gather(
            *(
                guarded(self._receive(r, group, offset, fresh, push), self.cfg.timeout_s)
                for r, offset in zip(receivers, offsets, strict=True)
            )
        )
        sent = await guarded(_done(sending), self.cfg.timeout_s)
        out = {r.name: d for r, d in zip(receivers, done, strict=True)}
        if not sent.ok or not all(d.ok for d in done):
            self.group = None  # a failed collective leaves the group unusable: rebuild it
            if not sent.ok:
                failed = Delivery(False, error=f"the broadcast failed: {sent.error}")
                out = {name: d if not d.ok else failed for name, d in out.items()}
        return out

    async def _receive(
        self, receiver: Receiver, group: Group, rank: int, fresh: bool, push: Push
    ) -> float:
        if receiver.placement.api != "sglang":
            return await receiver.run(receive, group, rank, push.buckets, push.version, push.mode)
        engine = receiver.engine
        if fresh:
            await engine.init_weights_update_group(
                group.host,
                group.port,
                rank,
                group.world_size,
                group_name=group.name,
                backend=group.backend,
            )

        async def load(flush: bool) -> None:
            for b in push.buckets:
                last = b.index == len(push.buckets) - 1
                await engine.update_weights_from_distributed(
                    b.names,
                    [s.dtype for s in b.specs],
                    [list(s.shape) for s in b.specs],
                    push.version if last else None,
                    group_name=group.name,
                    flush_cache=flush and last,
                    load_format="flattened_bucket",
                )

        return await sglang_update(engine, push.mode, load, session=True)

    async def close(self) -> None:
        self.group = None


async def _ranks(receiver: Receiver) -> int:
    """How many ranks a receiver takes in the group (an SGLang server: its TP size)."""
    if receiver.placement.api == "sglang":
        return int((await receiver.engine.get_server_info()).get("tp_size") or 1)
    return 1


async def _done(work) -> float:
    await work
    return 0.0  # the sender does not stall generation
