"""The two ends of a push: where the weights live (the sender) and the engines (receivers).

`Placement` (gateway/engines/placement.py) says where an end is: host, Ray node, process,
device, and (for receivers) the transports it accepts and the API it speaks. The planner
compares placements; routes use the adapters below to run their halves in the right process:

- `Sender.run(fn, *args)` calls `fn(source, *args)` where the weights live, `source` being the
  trainer's `WeightSource` (in this process: in a worker thread; a Ray backend: in its actor);
- `Receiver.run(fn, *args)` calls `await fn(engine, *args)` next to the engine (in this
  process, or in the engine's Ray actor).

An object says where it is with a `placement` attribute and, when it lives elsewhere, a `run`
method (RayEngine, RayBackend, SGLangEngine); anything else is in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from gateway.engines.placement import Placement
from trainer.transfer.buckets import TensorSpec

# ------------------------------------------------------------------------------------ sender


@runtime_checkable
class WeightSource(Protocol):
    """The trainer's weights as the HF folder has them: what every route reads.

    A sharded trainer (Megatron: tensor/pipeline parallel, Megatron names, fused QKV) implements
    this on the process that sends, typically its rank 0, gathering and converting on demand:

    - `hf_specs()`: every tensor's HF name, shape and dtype, in a fixed order, exactly as the
      model's HF folder (`model.safetensors` and `config.json`) has them; no gathering. Tied
      weights appear once, under the name the HF folder keeps.
    - `hf_tensors(names)`: yields `(name, tensor)` for those names, full (TP shards gathered,
      QKV/gate-up split, names converted), on any device. A yielded tensor must stay valid until
      the next one is asked for; the caller copies it into a bucket first, so a sharded trainer
      can free it then. Peak extra memory is therefore one bucket plus one tensor. Every rank
      of the trainer must call it together when gathering is collective.
    """

    def hf_specs(self) -> list[TensorSpec]: ...

    def hf_tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]: ...


class StateDictSource:
    """A `WeightSource` over an HF-named state dict (the torch backend's `state_dict()`).

    Tied weights are one tensor under two names (`lm_head.weight` and
    `model.embed_tokens.weight`); the HF folder keeps the first name only, and so does this."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        seen: set[tuple] = set()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if tensor.numel() and key in seen:
                continue
            seen.add(key)
            self.tensors[name] = tensor

    def hf_specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(name, t) for name, t in self.tensors.items()]

    def hf_tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensors[name]


def weight_source(owner: Any) -> WeightSource:
    """The `WeightSource` of a train backend (its own `weight_source()`, else its
    `state_dict()`), of a state dict, or the object itself if it is one."""
    if isinstance(owner, WeightSource):
        return owner
    if hasattr(owner, "weight_source"):
        return owner.weight_source()
    if isinstance(owner, Mapping):
        return StateDictSource(owner)
    return StateDictSource(owner.state_dict())


def source_device(source: WeightSource) -> str:
    """`cuda` or `cpu`: where the first tensor of `source` lives."""
    specs = source.hf_specs()
    if not specs:
        return "cpu"
    _, tensor = next(iter(source.hf_tensors([specs[0].name])))
    return "cuda" if tensor.is_cuda else "cpu"


class Sender:
    """Runs route code where the weights live; see the module docstring."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        remote = getattr(owner, "run", None)
        self._remote: Callable[..., Awaitable[Any]] | None = remote if callable(remote) else None
        if self._remote is not None:
            self.placement: Placement = owner.placement
            self.local: WeightSource | None = None
        else:
            self.local = weight_source(owner)
            self.placement = Placement.here(source_device(self.local), ())

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._remote is not None:
            return await self._remote(fn, *args)
        return await asyncio.to_thread(fn, weight_source(self.owner), *args)


# --------------------------------------------------------------------------------- receivers


@dataclass
class Receiver:
    """One engine as TransferMesh sees it."""

    name: str
    engine: Any
    placement: Placement
    version: int = field(default=0)
    """The version it acknowledged last (what it serves)."""
    error: str = ""
    """Why its last push failed ('' if it did not)."""

    @classmethod
    def of(cls, engine: Any, name: str) -> Receiver:
        placement = getattr(engine, "placement", None)
        if placement is None:
            placement = Placement.here("cpu", ("in_process",))
        return cls(name, engine, placement, engine.weight_version)

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        remote = getattr(self.engine, "run", None)
        if callable(remote):
            return await remote(fn, *args)
        return await fn(self.engine, *args)
