"""Log-probs and entropy from vocabulary-parallel logits (each TP rank holds a slice of the vocab).

The same quantities as `torch_backend.token_logprobs`, `log_softmax(logits / T)` of the target
token and the entropy of that distribution, computed without gathering the vocabulary: the
max, the sum of exponentials and the target's logit are reduced across the tensor-parallel
group. Sums go through Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce
forward, identity backward), which is the right gradient for a sum of per-rank partials whose
consumer is the same on every rank. Padded vocabulary rows (`convert.py`) are masked out.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N] log-prob of each target under `logits` [N, V/tp] (this rank's slice), and its entropy.

    `vocab_size` is the real (unpadded) vocabulary; ids at or above it get no probability."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    width = logits.shape[-1]
    start = tp_rank * width
    logits = logits.float() / temperature
    if start + width > vocab_size:  # this slice holds padding rows
        pad = torch.arange(start, start + width, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))

    with torch.no_grad():
        peak = logits.max(dim=-1).values
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    lse = sum_exp.log()

    local = targets - start
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(torch.where(mine, picked, 0.0))
    logp = picked - lse

    entropy = None
    if with_entropy:
        # H = lse - E_p[shifted]; masked (-inf) entries have p = 0 and contribute nothing.
        weighted = torch.where(exp > 0, exp * shifted, 0.0).sum(dim=-1)
        entropy = lse - reduce_from_tensor_model_parallel_region(weighted) / sum_exp
    return logp, entropy
