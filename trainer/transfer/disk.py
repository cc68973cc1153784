"""The `disk` route: safetensors files in a folder every receiver can read; it reaches anything.

The sender writes one `model-0000k-of-0000n.safetensors` per bucket (HF names, so an SGLang
server loads the folder with `/update_weights_from_disk` like a checkpoint), into
`<dir>.partial`, then renames the folder: a receiver never sees a version half written. Engines
of ours load the files and apply them; SGLang servers are paused, load the folder and continue.
The folder is removed once every receiver is done. `transfer.disk_dir` must be a folder the
receivers can read (a shared filesystem for other hosts); by default the system temporary
folder, which reaches the trainer's own host only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid

import torch

from trainer.transfer.buckets import Bucket, pipeline
from trainer.transfer.endpoints import Placement, Receiver
from trainer.transfer.mesh import Delivery, Push, TransferConfig, apply_weights, guarded
from trainer.transfer.sglang import sglang_update


def _file(bucket: Bucket, count: int) -> str:
    return f"model-{bucket.index + 1:05d}-of-{count:05d}.safetensors"


def write_folder(source, folder: str, buckets: list[Bucket], overlap: bool) -> None:
    """Sender side: the version as safetensors files in `folder` (complete, or absent)."""
    from safetensors.torch import save_file

    partial = folder + ".partial"
    os.makedirs(partial)
    try:
        pipeline(
            buckets,
            lambda b: {n: t.detach().to("cpu").contiguous() for n, t in source.hf_tensors(b.names)},
            lambda b, tensors: save_file(tensors, os.path.join(partial, _file(b, len(buckets)))),
            overlap,
        )
        os.rename(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def remove_folder(source, folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


async def read_folder(engine, folder: str, buckets: list[Bucket], version: int, mode: str) -> float:
    """Receiver side (our engines): load every file, then apply them together."""
    from safetensors.torch import load_file

    def load() -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for b in buckets:
            tensors |= load_file(os.path.join(folder, _file(b, len(buckets))))
        return tensors

    tensors = await asyncio.to_thread(load)
    return await apply_weights(engine, tensors, version, mode)


class DiskRoute:
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self.root = cfg.disk_dir or tempfile.gettempdir()
        self.prefix = f"loongsage-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def reaches(self, sender: Placement, receiver: Placement) -> str:
        if self.cfg.disk_dir:
            return f"safetensors in {self.cfg.disk_dir} (a folder every receiver reads)"
        if sender.same_node(receiver):
            return f"same host: safetensors in {self.root}"
        return ""

    async def push(self, push: Push, receivers: list[Receiver]) -> dict[str, Delivery]:
        folder = os.path.join(self.root, f"{self.prefix}-v{push.version}")
        try:
            await push.sender.run(
                write_folder, folder, push.buckets, push.cfg.pipeline, reads=push.reads
            )
        except Exception as exc:  # noqa: BLE001 - nobody gets this version
            failed = Delivery(False, error=f"writing {folder} failed: {exc!r}")
            return {r.name: failed for r in receivers}
        try:
            done = await asyncio.gather(
                *(guarded(self._receive(r, folder, push), self.cfg.timeout_s) for r in receivers)
            )
        finally:
            await push.sender.run(remove_folder, folder)
        return {r.name: d for r, d in zip(receivers, done, strict=True)}

    async def _receive(self, receiver: Receiver, folder: str, push: Push) -> float:
        if receiver.placement.api == "sglang":
            engine = receiver.engine
            return await sglang_update(
                engine,
                push.mode,
                lambda flush: engine.update_weights_from_disk(
                    folder, push.version, flush_cache=flush
                ),
                session=False,
            )
        return await receiver.run(read_folder, folder, push.buckets, push.version, push.mode)

    async def close(self) -> None:
        pass
