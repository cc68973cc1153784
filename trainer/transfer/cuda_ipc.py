"""The `cuda_ipc` route: an SGLang server on the trainer's GPU node maps the trainer's buckets.

For each bucket the sending process packs the tensors into one GPU buffer (SGLang's
`FlattenedTensorBucket` layout, which is our bucket layout), serializes
`{"flattened_tensor", "metadata"}` with SGLang's `MultiprocessingSerializer` (CUDA IPC handles,
not bytes) and the server loads it with `/update_weights_from_tensor`,
`load_format="flattened_bucket"`, one payload per TP rank, inside a weight-update session (see
`trainer/transfer/sglang.py`). Bucket k+1 is packed into the other of two buffers while the
server loads bucket k; a buffer is reused only after the server answered for it. Servers are
updated one after another.

GPU only, and the sending process needs SGLang installed (its serializer and metadata class are
what SGLang's safe unpickler accepts). `scripts/gpu_check_transfermesh.sh` runs it against a
real server; CPU tests cover the HTTP request path against the fake server.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable

import torch

from trainer.transfer.buckets import Bucket, pack
from trainer.transfer.endpoints import Placement, Receiver
from trainer.transfer.mesh import Delivery, Push, TransferConfig, guarded
from trainer.transfer.sglang import sglang_update

_BUFFERS: dict[int, torch.Tensor] = {}
"""Sender side: the two GPU buffers buckets are packed into (slot -> buffer)."""


def ipc_payload(source, bucket: Bucket, size: int) -> str:
    """Sender side: pack `bucket` into buffer `bucket.index % 2` and serialize it for SGLang."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    slot = bucket.index % 2
    if slot not in _BUFFERS or _BUFFERS[slot].numel() < size:
        _BUFFERS[slot] = torch.empty(size, dtype=torch.uint8, device="cuda")
    flat = _BUFFERS[slot][: bucket.nbytes]
    pack(source.hf_tensors(bucket.names), bucket, flat)
    torch.cuda.current_stream().synchronize()
    metadata = [
        FlattenedTensorMetadata(
            name=s.name,
            shape=torch.Size(s.shape),
            dtype=s.torch_dtype,
            start_idx=o,
            end_idx=o + s.nbytes,
            numel=s.nbytes // s.torch_dtype.itemsize,
        )
        for s, o in zip(bucket.specs, bucket.offsets, strict=True)
    ]
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": flat, "metadata": metadata}, output_str=True
    )


def release(source) -> None:
    _BUFFERS.clear()
    torch.cuda.empty_cache()


class CudaIpcRoute:
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self._sender = None

    def reaches(self, sender: Placement, receiver: Placement) -> str:
        if (
            sender.same_node(receiver)
            and sender.gpu
            and receiver.gpu
            and receiver.api == "sglang"
            and importlib.util.find_spec("sglang") is not None
        ):
            return "same GPU node: SGLang maps each bucket by CUDA IPC, nothing is copied twice"
        return ""

    async def push(self, push: Push, receivers: list[Receiver]) -> dict[str, Delivery]:
        self._sender = push.sender
        out = {}
        for r in receivers:  # one at a time: the two GPU buffers are shared
            out[r.name] = await guarded(self._update(r, push), self.cfg.timeout_s)
        return out

    async def _update(self, receiver: Receiver, push: Push) -> float:
        engine = receiver.engine
        ranks = int((await engine.get_server_info()).get("tp_size") or 1)
        size = max(b.nbytes for b in push.buckets)
        buckets = push.buckets

        def pack_next(bucket: Bucket) -> Awaitable[str]:
            return push.sender.run(ipc_payload, bucket, size, reads=[bucket.names])

        async def load(flush: bool) -> None:
            pending = asyncio.ensure_future(pack_next(buckets[0]))
            for b in buckets:
                payload = await pending
                last = b.index == len(buckets) - 1
                if not last and push.cfg.pipeline:
                    pending = asyncio.ensure_future(pack_next(buckets[b.index + 1]))
                await engine.update_weights_from_tensor(
                    [payload] * ranks,
                    push.version if last else None,
                    load_format="flattened_bucket",
                    flush_cache=flush and last,
                )
                if not last and not push.cfg.pipeline:
                    pending = asyncio.ensure_future(pack_next(buckets[b.index + 1]))

        return await sglang_update(engine, push.mode, load, session=True)

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.run(release)
