"""The `in_process` route: an engine in the trainer's process gets the trainer's tensors.

Nothing is staged or packed: the engine's `update_weights` copies the source tensors into its
own weights (the one copy any route ends with), between two decoding steps.
"""

from __future__ import annotations

import asyncio

from trainer.transfer.endpoints import Placement, Receiver
from trainer.transfer.mesh import Delivery, Push, TransferConfig, apply_weights, guarded


class InProcessRoute:
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg

    def reaches(self, sender: Placement, receiver: Placement) -> str:
        if sender.same_process(receiver) and receiver.api == "engine":
            return "same process: the engine copies the trainer's tensors, nothing staged"
        return ""

    async def push(self, push: Push, receivers: list[Receiver]) -> dict[str, Delivery]:
        source = push.sender.local
        assert source is not None, "in_process needs the weights in this process"
        names = [s.name for b in push.buckets for s in b.specs]
        tensors = dict(source.hf_tensors(names))
        done = await asyncio.gather(
            *(
                guarded(r.run(apply_weights, tensors, push.version, push.mode), self.cfg.timeout_s)
                for r in receivers
            )
        )
        return {r.name: d for r, d in zip(receivers, done, strict=True)}

    async def close(self) -> None:
        pass
