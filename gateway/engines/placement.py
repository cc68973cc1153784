"""Where an engine (or the trainer's weights) lives, as TransferMesh's planner sees it.

Engines that run elsewhere say so with a `placement` attribute: `RayEngine` (its actor's Ray
node, process and device), `SGLangEngine` (the server's host, a GPU, SGLang's HTTP weight API);
an engine without one is in the caller's process. `transports` are the weight routes it accepts
(trainer/transfer); `api` is `engine` when code of ours can run next to it (our engines, in this
process or in a Ray actor) and `sglang` when only SGLang's weight endpoints reach it.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

ENGINE_TRANSPORTS = ("in_process", "shm", "broadcast", "disk")
"""What an engine running our code accepts (routes that run a receiving half next to it)."""


@dataclass(frozen=True)
class Placement:
    host: str
    """Host name (for people: `node` decides what is the same machine)."""
    node: str
    """The Ray node id, or `host:<hostname>` outside Ray: one shared-memory domain."""
    pid: int
    device: str = "cpu"
    """Where the weights are: cpu, cuda, cuda:N."""
    transports: tuple[str, ...] = ()
    """Routes a receiver accepts (unused for the sender)."""
    api: str = "engine"
    """`engine`: our code runs next to it; `sglang`: only SGLang's HTTP weight API."""

    @classmethod
    def here(cls, device: str = "cpu", transports: Sequence[str] = ENGINE_TRANSPORTS) -> Placement:
        """This process."""
        host = socket.gethostname()
        node = f"host:{host}"
        ray = sys.modules.get("ray")  # not imported: not initialized either
        if ray is not None and ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
        return cls(host, node, os.getpid(), device, tuple(transports))

    def same_process(self, other: Placement) -> bool:
        return self.node == other.node and self.pid == other.pid

    def same_node(self, other: Placement) -> bool:
        return self.node == other.node

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    def short(self) -> str:
        node = self.node if self.node.startswith("host:") else f"node {self.node[:8]}"
        return f"{node} pid {self.pid} {self.device}"


SGLANG_TRANSPORTS = ("cuda_ipc", "broadcast", "disk")
"""What an SGLang server accepts: CUDA IPC tensors, an NCCL group, a checkpoint folder."""
