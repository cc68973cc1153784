"""How a teacher's engine enters and leaves memory, one kind per engine kind (`RESIDENCY`).

- `local`: the embedded engine is built from the model folder on swap-in and closed on
  swap-out, so an evicted teacher waits on disk and holds no memory (the model folder is its
  copy; safetensors load in about a second for SmolLM2);
- `sglang`: the servers keep running; swap-out is `/release_memory_occupation` (weights and KV
  cache), swap-in `/resume_memory_occupation`. The servers must run with `--enable-memory-saver`,
  and with `--enable-weights-cpu-backup` or their weights come back as garbage: the manager
  verifies every swap-in against the logprobs the teacher gave when it was first loaded.

A kind is registered by engine kind, so a new engine kind that can teach is one class here and
one `register` line. `weight_bytes` reads the safetensors headers of the model folder (no
weights are loaded) and counts every tensor at the engine's dtype.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import struct
from pathlib import Path
from typing import Protocol

import torch

from gateway.engines import EngineConfig, make_engine
from gateway.engines.base import Engine
from gateway.registry import Registry

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Residency(Protocol):
    resident_at_start: bool
    """Whether the engine holds its memory before the first `load` (servers already up)."""

    async def load(self) -> Engine:
        """Make the teacher resident; the engine to score with."""
        ...

    async def unload(self) -> None:
        """Give its memory back; the teacher can be loaded again later."""
        ...

    async def close(self) -> None:
        """Stop using the engine, leaving it as it was found (servers keep their memory)."""
        ...


RESIDENCY: Registry[Residency] = Registry("teachers.<name>.engine.kind")
RESIDENCY.register("local", "trainer.teachers.residency:Rebuild")
RESIDENCY.register("sglang", "trainer.teachers.residency:ReleaseResume")


class Rebuild:
    """`local`: build the engine from the folder on load, close it on unload."""

    resident_at_start = False

    def __init__(self, engine: EngineConfig, model_path: Path) -> None:
        self.cfg = engine
        self.model_path = model_path
        self.engine: Engine | None = None

    async def load(self) -> Engine:
        if self.engine is None:
            self.engine = await asyncio.to_thread(make_engine, self.cfg, self.model_path)
        return self.engine

    async def unload(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.close()
            del engine
            release_freed_memory()

    async def close(self) -> None:
        await self.unload()


class ReleaseResume:
    """`sglang`: release and resume the servers' memory; the client stays."""

    resident_at_start = True

    def __init__(self, engine: EngineConfig, model_path: Path | None) -> None:
        self.engine = make_engine(engine, model_path or "")
        self.servers = getattr(self.engine, "engines", [self.engine])
        self.released = False

    async def load(self) -> Engine:
        if self.released:
            await asyncio.gather(*(s.resume_memory_occupation() for s in self.servers))
            self.released = False
        return self.engine

    async def unload(self) -> None:
        await asyncio.gather(*(s.release_memory_occupation() for s in self.servers))
        self.released = True

    async def close(self) -> None:
        try:
            await self.load()
        finally:
            await self.engine.close()


def weight_bytes(model_path: Path, dtype: str) -> int:
    """Bytes of every tensor in the folder's safetensors files, stored at `dtype`."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path}: no *.safetensors files to size the teacher from")
    numel = 0
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                numel += int(torch.Size(info["shape"]).numel())
    return numel * DTYPE_BYTES.get(dtype, 4)


def release_freed_memory() -> None:
    """Collect the closed engine and hand freed heap pages back to the OS (glibc keeps them
    otherwise, and the process's resident size would not show the swap-out)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
