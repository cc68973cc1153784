"""Weight push: new trainer weights to every engine after each train step.

`WeightPush` is the interface the controller calls; `InProcessPush` is the first route (engines
in the trainer's process, handed the tensors directly: the engine copies them into its own
model). TransferMesh (shared memory, CUDA IPC, NCCL, HTTP/disk) will be further
implementations of the same interface.

What happens to requests in flight is `rollout.partial_rollout`:
- `continue`: the engine swaps weights between two decoding steps; requests go on with the new
  weights and their later tokens carry the new version (partial rollouts);
- `abort_resubmit`: the engine is paused with `retract` (running requests go back to its queue
  with prompt + partial output), updated, and resumed, so they are recomputed on the new weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gateway.engines.base import Engine


@dataclass
class PushReport:
    version: int
    bytes: int
    """Bytes of weights delivered to each receiver."""
    seconds: float
    receivers: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes * self.receivers / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "weights/bytes": float(self.bytes),
            "weights/seconds": self.seconds,
            "weights/gb_per_s": self.gb_per_s,
        }


class WeightPush(Protocol):
    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Deliver `state_dict` as weight version `version` to every receiver; all or nothing
        per receiver; returns when every receiver serves the new version."""
        ...


def state_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    # Tied weights appear under two names but are one tensor: count storage once.
    seen: set[int] = set()
    total = 0
    for t in state_dict.values():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class InProcessPush:
    """Hands the tensors to engines living in this process (the embedded local engine)."""

    def __init__(self, engines: Sequence[Engine], mode: str = "continue") -> None:
        if mode not in ("continue", "abort_resubmit"):
            raise ValueError(
                f"rollout.partial_rollout: {mode!r} is not one of 'continue', 'abort_resubmit'"
            )
        self.engines = list(engines)
        self.mode = mode

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushReport:
        start = time.perf_counter()
        await asyncio.gather(*(self._one(e, state_dict, version) for e in self.engines))
        return PushReport(
            version=version,
            bytes=state_bytes(state_dict),
            seconds=time.perf_counter() - start,
            receivers=len(self.engines),
        )

    async def _one(self, engine: Engine, state: Mapping[str, torch.Tensor], version: int) -> None:
        if self.mode == "continue":
            await engine.update_weights(state, version)
            return
        await engine.pause("retract")
        try:
            await engine.update_weights(state, version)
        finally:
            await engine.resume()
