"""LoRA for the torch backend: low-rank adapters on every linear layer of the decoder.

`train.lora_rank: r` freezes the model and adds to each decoder linear `y = W x` (attention's
q/k/v/o, the MLP's gate/up/down; not the embedding or the LM head) a trainable
`scale * B (A x)`, `A` [r, in] (Kaiming-uniform), `B` [out, r] (zeros: training starts at the
model itself), `scale = lora_alpha / r`. Only A and B get gradients and AdamW state: a step
skips the weight gradients of the frozen matmuls (a third of their FLOPs) and the LM head's,
and the optimizer touches ~1% of the parameters. The adapters are forward hooks on the
model's own modules, so the model keeps its HF names and shapes.

Everything outside the step sees the merged model, `W + scale * B A`: what the weight push
sends to the engines (`MergedSource`, computed tensor by tensor as the push reads it), what
`save_hf` writes and what `state_dict` returns; so the engines need no adapter support.
Checkpoints hold the base weights and the adapters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from trainer.transfer.buckets import TensorSpec
from trainer.transfer.endpoints import StateDictSource


class Lora(torch.nn.Module):
    """Adapters `A`, `B` for each decoder linear of `model` (which is frozen), as hooks."""

    def __init__(self, model: torch.nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        model.requires_grad_(False)
        self.scale = alpha / rank
        head = model.get_output_embeddings()
        self.targets = {
            f"{name}.weight": module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
        if not self.targets:
            raise ValueError("train.lora_rank: the model has no linear layers besides its LM head")
        self.index = {name: i for i, name in enumerate(self.targets)}
        self.a, self.b = torch.nn.ParameterList(), torch.nn.ParameterList()
        for module in self.targets.values():
            w = module.weight
            a = torch.empty(rank, w.shape[1], device=w.device)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear initialises
            self.a.append(torch.nn.Parameter(a))
            self.b.append(torch.nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device)))
            module.register_forward_hook(self._adapt(len(self.a) - 1))
        self.flops_per_token = 2 * rank * sum(sum(m.weight.shape) for m in self.targets.values())
        """FLOPs of the adapters' forward for one token (`B (A x)` of every adapted linear)."""

    def _adapt(self, i: int):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            low = torch.nn.functional.linear(args[0], self.a[i])
            return out + torch.nn.functional.linear(low, self.b[i]) * self.scale

        return hook

    def delta(self, name: str) -> torch.Tensor:
        """`scale * B A` of the linear whose weight is `name`."""
        i = self.index[name]
        return (self.b[i] @ self.a[i]).mul_(self.scale)

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (the model's state dict) with every adapted weight merged."""
        with torch.no_grad():
            return {
                k: v + self.delta(k) if k in self.targets else v.detach() for k, v in state.items()
            }


class MergedSource:
    """The push's `WeightSource` for a LoRA model: the base weights, each adapted one merged
    with its adapter as it is read (one tensor at a time; nothing the shm route may move)."""

    def __init__(self, state: dict[str, torch.Tensor], lora: Lora) -> None:
        self.base, self.lora = StateDictSource(state), lora

    def hf_specs(self) -> list[TensorSpec]:
        return self.base.hf_specs()

    def hf_tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, t in self.base.hf_tensors(names):
                yield name, t + self.lora.delta(name) if name in self.lora.targets else t
