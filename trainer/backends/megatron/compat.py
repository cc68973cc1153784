"""megatron-core on a machine without CUDA: what the tests and CPU runs need, and nothing else.

megatron-core 0.16 is written for GPUs; its modules run on CPU under gloo once six assumptions
are met. `install()` meets them and is called by the backend only when `torch.cuda.is_available()`
is False; on a GPU machine nothing here is touched (`install` refuses to run there), so a GPU run
never silently takes a CPU path.

1. `torch.cuda.current_device()` returns `"cpu"`. Megatron allocates on that device in many places
   (RoPE frequencies, the global memory buffer behind tensor-parallel gathers, DDP's gradient
   buffers, pipeline shape exchange); on a CPU-only torch the call raises. Likewise
   `Tensor.cuda()` returns the tensor itself (under pipeline parallelism the tied output layer
   is moved to "cuda" for its first sync with the embedding), and `torch.cuda.synchronize()`
   does nothing (the pipeline's point-to-point exchange calls it; there is no stream to wait
   for).
2. `megatron.core.pipeline_parallel.schedules` creates its token counter with `device="cuda"`;
   that one module is given a `torch` whose `zeros` puts such tensors on the CPU.
3. The RNG tracker is the inference one (`model_parallel_cuda_manual_seed(...,
   inference_rng_tracker=True)`): the default tracker forks CUDA RNG states. The models trained
   here have no dropout, so the tracker's streams are never drawn from.
4. The optimizer is `CpuOptimizer` (torch AdamW on DDP's gradient buffers, with the gradient
   norm clipped across tensor- and pipeline-parallel ranks as Megatron's own optimizer does):
   `get_megatron_optimizer` hard-codes `'cuda'` tensors.
5. Attention gets an explicit causal mask (`causal_mask`): without one, Megatron builds its
   default mask on `"cuda"`. (Fusions are off on CPU through the TransformerConfig, model.py.)
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

_installed = False


def install() -> None:
    """Patch what is listed in the module docstring (once per process; CPU only)."""
    global _installed
    if torch.cuda.is_available():
        raise RuntimeError(
            "trainer.backends.megatron.compat is for machines without CUDA; on a GPU the "
            "backend runs megatron-core unpatched"
        )
    if _installed:
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()  # type: ignore[attr-defined]
    _installed = True


class _TorchOnCpu(types.ModuleType):
    """`torch`, except that `zeros(..., device="cuda")` lands on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def seed(seed: int) -> None:
    """Megatron's model-parallel RNG tracker, without CUDA RNG states."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def causal_mask(length: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is masked (a later position)."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)[None, None]


class CpuOptimizer:
    """AdamW over a Megatron-DDP model's parameters, stepping on DDP's reduced `main_grad`s.

    Exposes what the backend uses of Megatron's optimizer: `param_groups`, `zero_grad`,
    `step() -> (ok, grad_norm, zeros)`, `state_dict`, `load_state_dict`. The gradient norm counts
    each parameter once: tensor-parallel duplicates (norms, on TP ranks > 0) and the output layer
    that shares the embedding's weights on the last pipeline stage are left out, and the squares
    are summed over the model-parallel group, exactly as `megatron.core.optimizer` does.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], lr: float, weight_decay: float, clip_grad: float
    ) -> None:
        self.params = params
        self.clip_grad = clip_grad
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_norm(self) -> float:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.module import param_is_not_shared

        squares = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p):
                squares += p.main_grad.double().pow(2).sum()
        group = parallel_state.get_model_parallel_group()
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(squares, group=group)
        return math.sqrt(squares.item())

    def step(self) -> tuple[bool, float, None]:
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        norm = self.grad_norm()
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for p in self.params:
                    p.grad.mul_(coeff)
        self.optimizer.step()
        self.zero_grad()
        return True, norm, None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
