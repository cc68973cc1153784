"""Buckets: a version of the weights cut into contiguous byte ranges that travel one at a time.

A push describes the weights once as `TensorSpec`s (HF name, shape, dtype), cuts them into
`Bucket`s of at most `bucket_bytes` (a bigger tensor gets a bucket of its own), so that each side
computes the same layout from the same specs without sending it. Inside a bucket the tensors'
bytes follow each other without padding, which is SGLang's `FlattenedTensorBucket` layout (what
`load_format="flattened_bucket"` receives); buckets start 64-byte aligned in a buffer that holds
a whole version. A bucket is packed into (or received into) a flat uint8 buffer; `views` turns
such a buffer back into named tensors without a copy.

`pipeline` overlaps the two halves of sending: bucket k+1 is prepared (gathered from the trainer
and packed) in a worker thread while bucket k is sent in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

ALIGN = 64
T = TypeVar("T")
P = TypeVar("P")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """One HF-named tensor: what both ends need to lay it out and rebuild it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name: float32, bfloat16, ..."""

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    index: int
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    """Byte offset of each tensor inside the bucket."""
    nbytes: int
    start: int
    """Byte offset of the bucket inside the whole version (receivers keep all buckets)."""

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def make_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Cut `specs`, in order, into buckets of at most `bucket_bytes` (one tensor may exceed it)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    group: list[TensorSpec] = []
    offsets: list[int] = []
    size = start = 0

    def close() -> None:
        nonlocal group, offsets, size, start
        if group:
            buckets.append(Bucket(len(buckets), tuple(group), tuple(offsets), size, start))
            start += _aligned(size)
        group, offsets, size = [], [], 0

    for spec in specs:
        offset = size
        if group and offset + spec.nbytes > bucket_bytes:
            close()
            offset = 0
        group.append(spec)
        offsets.append(offset)
        size = offset + spec.nbytes
    close()
    return buckets


def total_bytes(buckets: list[Bucket]) -> int:
    """Bytes of a buffer that holds every bucket at its `start`."""
    return buckets[-1].start + _aligned(buckets[-1].nbytes) if buckets else 0


def pack(tensors: Iterable[tuple[str, torch.Tensor]], bucket: Bucket, out: torch.Tensor) -> None:
    """Copy a bucket's tensors (any device) into the uint8 `out`, as their raw bytes."""
    where = {s.name: (s, o) for s, o in zip(bucket.specs, bucket.offsets, strict=True)}
    for name, tensor in tensors:
        spec, offset = where.pop(name)
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"{name}: {dtype_name(tensor.dtype)} {tuple(tensor.shape)} differs from the "
                f"layout's {spec.dtype} {spec.shape}"
            )
        out[offset : offset + spec.nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
    if where:
        raise ValueError(f"bucket {bucket.index}: tensors missing from the source: {list(where)}")


def views(buffer: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """The bucket's tensors as views of the uint8 `buffer` that holds it (no copy; a tensor
    whose offset does not fit its dtype's alignment, after an odd-sized smaller dtype, is copied)."""
    out = {}
    for s, o in zip(bucket.specs, bucket.offsets, strict=True):
        raw = buffer[o : o + s.nbytes]
        if raw.storage_offset() % s.torch_dtype.itemsize:
            raw = raw.clone()
        out[s.name] = raw.view(s.torch_dtype).view(s.shape)
    return out


def pipeline(
    items: Iterable[T], prepare: Callable[[T], P], send: Callable[[T, P], None], overlap: bool
) -> None:
    """`send(item, prepare(item))` for every item; with `overlap`, the next item is prepared in a
    worker thread while the current one is sent (prepare must then not reuse what send holds:
    callers double-buffer)."""
    items = list(items)
    if not overlap or len(items) < 2:
        for item in items:
            send(item, prepare(item))
        return
    with ThreadPoolExecutor(1, thread_name_prefix="loongsage-pack") as pool:
        pending = pool.submit(prepare, items[0])
        for i, item in enumerate(items):
            ready = pending.result()
            if i + 1 < len(items):
                pending = pool.submit(prepare, items[i + 1])
            send(item, ready)
