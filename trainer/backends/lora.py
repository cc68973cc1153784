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
        modules = {
            f"{name}.weight": module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
        if not modules:
            raise ValueError("train.lora_rank: the model has no linear layers besides its LM head")
        self.targets = {name: i for i, name in enumerate(modules)}
        """The adapted weights' names, each with its adapter's index in `a` and `b`."""
        self.a, self.b = torch.nn.ParameterList(), torch.nn.ParameterList()
        for i, module in enumerate(modules.values()):
            w = module.weight
            a = torch.empty(rank, w.shape[1], device=w.device)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear initialises
            self.a.append(torch.nn.Parameter(a))
            self.b.append(torch.nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device)))
            module.register_forward_hook(self._adapt(i))
        self.flops_per_token = 2 * sum(p.numel() for p in self.parameters())
        """FLOPs of the adapters' forward for one token (`B (A x)`: rank x (in + out) MACs)."""

    def _adapt(self, i: int):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            low = torch.nn.functional.linear(args[0], self.a[i])
            return out + torch.nn.functional.linear(low, self.b[i]) * self.scale

        return hook

    @torch.no_grad()
    def merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` (the model's tensor `name`) as the engines get it: `W + scale * B A` if
        adapted, else itself (detached)."""
        i = self.targets.get(name)
        if i is None:
            return weight.detach()
        return torch.addmm(weight, self.b[i], self.a[i], alpha=self.scale)

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (the model's state dict) with every adapted weight merged."""
        return {name: self.merge(name, t) for name, t in state.items()}


class MergedSource:
    """The push's `WeightSource` for a LoRA model: the base weights, each adapted one merged
    with its adapter as it is read (one tensor at a time; nothing the shm route may move)."""

    def __init__(self, state: dict[str, torch.Tensor], lora: Lora) -> None:
        self.base, self.lora = StateDictSource(state), lora

    def hf_specs(self) -> list[TensorSpec]:
        return self.base.hf_specs()

    def hf_tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.base.hf_tensors(names):
            yield name, self.lora.merge(name, t)
