"""The two ends of a push: where the weights live (the sender) and the engines (receivers).

`Placement` (gateway/engines/placement.py) says where an end is: host, Ray node, process,
device, and (for receivers) the transports it accepts and the API it speaks. The planner
compares placements; routes use the adapters below to run their halves in the right process:

- `Sender.run(fn, *args, reads=...)` calls `fn(source, *args)` where the weights live, `source`
  being the trainer's `WeightSource` (in this process: in a worker thread; a Ray backend: in
  its actor; a backend of several ranks: on rank 0, the others gathering the `reads` with it);
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
    """A `WeightSource` over an HF-named state dict: the torch backend's parameters, or any
    tensors its owner keeps using (the shm route may move them into its segment, in place).

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
            yield name, self.tensors[name].detach()


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
    """`cuda` or `cpu`: where `source` yields its tensors. A source with a `device` attribute
    (None: CPU) says so without gathering anything (a sharded trainer: asking it for a tensor
    is a collective); otherwise its first tensor tells."""
    if hasattr(source, "device"):
        device = source.device
        return "cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"
    specs = source.hf_specs()
    if not specs:
        return "cpu"
    _, tensor = next(iter(source.hf_tensors([specs[0].name])))
    return "cuda" if tensor.is_cuda else "cpu"


class ScriptedReads:
    """A sharded trainer's `WeightSource` on the rank that sends, when its ranks gather
    together: each `hf_tensors` call must be the next one announced in `reads`, a call the
    caller stops iterating early is finished before the next one starts, and `finish()` makes
    the announced calls the caller did not make (it failed half way). The other ranks make
    exactly the announced calls (`follow_reads`), so none of them waits in a collective that
    the sender skipped or reordered."""

    def __init__(self, source: WeightSource, reads: Sequence[Sequence[str]]) -> None:
        self.source = source
        self._reads = iter(reads)
        self._open: Iterator[tuple[str, torch.Tensor]] | None = None

    def hf_specs(self) -> list[TensorSpec]:
        return self.source.hf_specs()

    def hf_tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        self._drain()
        announced = next(self._reads, None)
        if announced is None or list(announced) != list(names):
            raise AssertionError(f"hf_tensors({list(names)[:3]}...) was not announced next")
        self._open = iter(self.source.hf_tensors(names))
        return _Borrowed(self._open)

    def _drain(self) -> None:
        if self._open is not None:
            for _ in self._open:
                pass
            self._open = None

    def finish(self) -> None:
        self._drain()
        follow_reads(self.source, list(self._reads))


class _Borrowed:
    """An iterator the caller may drop half way without closing the one it reads (which
    `ScriptedReads` then finishes)."""

    def __init__(self, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._it = it

    def __iter__(self) -> _Borrowed:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._it)


def follow_reads(source: WeightSource, reads: Sequence[Sequence[str]]) -> None:
    """Make the `hf_tensors` calls `reads` announces, dropping the tensors (a rank that only
    takes part in gathering them)."""
    for names in reads:
        for _ in source.hf_tensors(names):
            pass


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

    async def run(
        self, fn: Callable[..., Any], *args: Any, reads: Sequence[Sequence[str]] | None = None
    ) -> Any:
        """`fn(source, *args)` where the weights live. A `fn` that reads tensors announces the
        names it will ask `hf_tensors` for, call by call (`reads`), so that the other ranks of
        a sharded trainer gather them alongside (`RankGroup.run`)."""
        if self._remote is not None:
            return await self._remote(fn, *args, reads=reads)
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
        if placement is None:  # ours, in this process: every route that runs code next to it
            placement = Placement.here("cpu")
        return cls(name, engine, placement, engine.weight_version)

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        remote = getattr(self.engine, "run", None)
        if callable(remote):
            return await remote(fn, *args)
        return await fn(self.engine, *args)
