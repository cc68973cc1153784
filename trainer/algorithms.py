"""The RL math: group-normalized advantages and the one policy loss every train backend uses.

The controller's train step reads: rewards per group -> `trajectory_advantages` (->
`subtract_overlong` with a length penalty) -> samples
(-> `add_distill_advantages` with teachers) -> the backend's step, which calls `policy_loss` ->
weight push.

On-policy distillation (Thinking Machines' recipe, as in tinker-cookbook): a teacher scored
every sampled token, and the token's advantage gains `coef * -(logp_student - logp_teacher)`,
the negated per-token reverse KL, undiscounted; with `advantage=opd` the reward contributes
nothing. `logp_student` is the behaviour log-prob the engine reported when it sampled the token
(the distribution the KL is estimated on; no extra forward pass), at the rollout temperature,
while teachers score at T = 1: keep the rollout temperature at 1 for exact distillation.

Three log-probabilities meet in the loss (decoupled PPO, as in AReaL):

- behaviour `b`: what the engine reported when it sampled the token (Segment.logprobs);
- proximal `p`: the trainer's log-prob at the start of the train step (no-grad forward);
- current `c`: the trainer's log-prob now, with grad.

PPO clips the ratio exp(c - p) to [1 - eps_low, 1 + eps_high]; the engine/trainer mismatch
exp(p - b) (different kernels, precision, stale weights) is corrected by importance sampling:
`tis` truncates it at C, `mis` masks tokens whose ratio is outside [1/C, C], `none` ignores it.
Optional terms: k3 KL to a reference model and an entropy bonus.

The gap p - b is reported in two parts that mean different things. `mismatch/*` is measured on
fresh tokens only, sampled with the very weights being trained: there p and b are the same
policy, and any gap is numerical (kernels, precision, a bug) — ~1e-6 with both sides in fp32.
`off_policy/*` is measured on stale tokens (sampled with weights 1..max_staleness versions
older): there the gap is policy drift, expected and corrected by the importance weights, with
`off_policy/lag{k}/logprob_abs_diff` per staleness k. Mixed, one step of drift (~0.1) would
hide a numerical bug of the same size. Each part has `tokens`, its token count; a step with no
fresh (or no stale) tokens reports only that count, 0.

Backends call `policy_loss` once per micro-batch with the normalizers of the whole minibatch,
so summing the micro-batch losses gives the minibatch loss; `reduce_metrics` merges the
micro-batch metrics (token-weighted means, max of maxes, min of mins).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.trajectory import Trajectory
from trainer.backends.base import TrainSample
from trainer.buffer import Batch, Group
from trainer.config import AlgorithmConfig


def group_advantages(rewards: torch.Tensor, kind: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages for rewards of shape [groups, samples]: r - group mean (`drgrpo`), divided by
    the group's (unbiased) std + eps for `grpo`. A zero-variance group gets all zeros."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must have shape [groups, samples>=2], got {tuple(rewards.shape)}"
        )
    rewards = rewards.to(torch.float32)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if kind == "drgrpo":
        return centered
    if kind == "grpo":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    raise ValueError(f"algorithm.advantage: unknown kind {kind!r}; use grpo or drgrpo")


def trajectory_advantages(
    rewards_by_group: Sequence[Sequence[float]], kind: str = "grpo"
) -> list[list[float]]:
    """One advantage per trajectory: `group_advantages` of each group's rewards (groups may
    differ in size when samples were aborted); all zeros for `opd` (the teachers' alone)."""
    if kind == "opd":
        return [[0.0] * len(r) for r in rewards_by_group]
    return [group_advantages(torch.tensor([r]), kind)[0].tolist() for r in rewards_by_group]


def overlong_penalty(traj: Trajectory, buffer: int) -> float:
    """DAPO's soft overlong punishment, in [0, 1]: 0 while every delivered turn stays `buffer`
    or more tokens under its cap (`Turn.max_tokens`), rising linearly to 1 at the cap; the
    trajectory's worst turn counts. 0 when `buffer` is 0 or no turn had a cap."""
    if buffer <= 0:
        return 0.0
    excess = [
        len(t.output_ids) - (t.max_tokens - buffer)
        for t in traj.turns
        if t.delivered and t.max_tokens
    ]
    return min(1.0, max([0, *excess]) / buffer)


def subtract_overlong(
    groups: Sequence[Group], advantages: list[list[float]], buffer: int, penalty: float
) -> dict[str, float]:
    """Each trajectory's advantage loses `penalty * overlong_penalty(traj, buffer)`, in place;
    returns `overlong/frac` (share of trajectories penalized) and `overlong/penalty_mean`.

    Unlike DAPO, which adds the punishment to the reward before group normalization, it is
    taken from the advantage after: its scale is then the same under grpo, drgrpo and opd (where
    rewards count for nothing), and a group of near-equal rewards cannot inflate it."""
    cuts = []
    for group, adv in zip(groups, advantages, strict=True):
        for i, traj in enumerate(group.trajectories):
            cuts.append(penalty * overlong_penalty(traj, buffer))
            adv[i] -= cuts[-1]
    n = max(len(cuts), 1)
    return {
        "overlong/frac": sum(c > 0 for c in cuts) / n,
        "overlong/penalty_mean": sum(cuts) / n,
    }


def reverse_kl_advantages(
    logprobs: Sequence[float], teacher_logprobs: Sequence[float], mask: Sequence[int]
) -> list[float]:
    """-(logp_student - logp_teacher) on sampled tokens (mask 1), 0 elsewhere: the negated
    per-token reverse KL, no discounting."""
    return [(t - s) if m else 0.0 for s, t, m in zip(logprobs, teacher_logprobs, mask, strict=True)]


def add_distill_advantages(samples: list[TrainSample], coef: float) -> None:
    """Per-token advantages for the samples a teacher scored: the sample's advantage plus
    `coef` times `reverse_kl_advantages`, on sampled tokens (other tokens are not trained)."""
    for s in samples:
        if s.teacher_logprobs is None:
            continue
        kl = reverse_kl_advantages(s.logprobs, s.teacher_logprobs, s.loss_mask)
        base = s.token_advantages()
        s.advantage = [
            a + coef * k if m else 0.0 for a, k, m in zip(base, kl, s.loss_mask, strict=True)
        ]


def distill_metrics(batch: Batch) -> dict[str, float]:
    """`distill/reverse_kl`: mean of logp_student - logp_teacher over the sampled tokens a
    teacher scored, overall and per teacher (`distill/reverse_kl/<teacher>`), and the fraction
    of sampled tokens scored."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    total = 0
    for traj in batch.trajectories:
        for seg in traj.segments:
            n = sum(seg.loss_mask)
            total += n
            if seg.teacher_logprobs is None or not n:
                continue
            kl = reverse_kl_advantages(seg.logprobs, seg.teacher_logprobs, seg.loss_mask)
            for key in ("", "/" + traj.metadata.get("teacher", "?")):
                sums[key] = sums.get(key, 0.0) - sum(kl)
                counts[key] = counts.get(key, 0) + n
    out = {f"distill/reverse_kl{key}": sums[key] / counts[key] for key in sums}
    out["distill/scored_frac"] = counts.get("", 0) / total if total else 0.0
    return out


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(q || p) from log(p/q) on samples of q: e^x - x - 1 >= 0."""
    return torch.expm1(log_ratio) - log_ratio


def _gap(prefix: str, log_ratio: torch.Tensor, corrected: torch.Tensor, sel: torch.Tensor):
    """Trainer-vs-engine log-prob gap over the tokens `sel`: `{prefix}/logprob_abs_diff`,
    `k3_kl`, `ratio_max`/`ratio_min` (of exp(proximal - behaviour)), `clip_frac` (the share the
    importance correction truncated or masked) and `tokens`; only `tokens` when `sel` is empty."""
    n = int(sel.sum().item())
    if not n:
        return {f"{prefix}/tokens": 0.0}
    x = log_ratio[sel]
    return {
        f"{prefix}/logprob_abs_diff": x.abs().mean().item(),
        f"{prefix}/k3_kl": k3(x).mean().item(),
        f"{prefix}/ratio_max": x.exp().max().item(),
        f"{prefix}/ratio_min": x.exp().min().item(),
        f"{prefix}/clip_frac": corrected.float()[sel].mean().item(),
        f"{prefix}/tokens": float(n),
    }


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate (this micro-batch's share of the minibatch loss)."""
    metrics: dict[str, float]
    num_tokens: int
    """Loss tokens in this micro-batch (weights the metric means in reduce_metrics)."""


def policy_loss(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    lag: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> LossOutput:
    """PPO-clipped policy gradient with decoupled behaviour/proximal log-probs.

    All tensors are [sequences, tokens] (padded; `mask` is 1 on tokens to train). `advantages`
    is per token (a sequence's advantage broadcast over its tokens). `num_tokens`/`num_seqs`
    are the minibatch totals the loss is normalized by (default: this call's own), so that
    micro-batch losses add up. A token masked by MIS contributes 0 but stays in the normalizer.
    `lag` (long, [sequences, tokens]): how many versions each token's sampling weights lag the
    weights being trained; None: all fresh. It splits the gap metrics (module docstring).
    """
    mask = mask.to(logprobs.dtype)
    n_tok = int(mask.sum().item())
    proximal = proximal_logprobs.detach()
    behaviour = behaviour_logprobs.detach()

    # PPO clip on current / proximal.
    ratio = torch.exp(logprobs - proximal)
    clipped = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped)

    # Importance weight of the proximal policy against the behaviour (engine) policy.
    is_log_ratio = (proximal - behaviour) * mask
    is_ratio = torch.exp(is_log_ratio)
    c = cfg.is_threshold
    outside = ((is_ratio > c) | (is_ratio < 1 / c)) & (mask > 0)
    if cfg.importance_sampling == "tis":
        weight = is_ratio.clamp(max=c)
        corrected = (is_ratio > c) & (mask > 0)
    elif cfg.importance_sampling == "mis":
        weight = is_ratio * (~outside)
        corrected = outside
    else:
        weight = torch.ones_like(is_ratio)
        corrected = outside  # reported only: the fraction MIS would have masked
    per_token = weight * pg

    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs ref_logprobs (a reference model)")
        per_token = per_token + cfg.kl_coef * k3(ref_logprobs.detach() - logprobs)
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("algorithm.entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - cfg.entropy_coef * entropy

    if cfg.aggregation == "token_mean":
        denom = num_tokens if num_tokens is not None else max(n_tok, 1)
        loss = (per_token * mask).sum() / denom
    else:
        seq_tokens = mask.sum(dim=1).clamp(min=1)
        denom = num_seqs if num_seqs is not None else max(int((mask.sum(1) > 0).sum()), 1)
        loss = ((per_token * mask).sum(dim=1) / seq_tokens).sum() / denom

    m = mask > 0
    with torch.no_grad():
        if n_tok:
            ppo_clipped = (-advantages * clipped > -advantages * ratio) & m
            metrics = {
                "train/ppo_clip_frac": ppo_clipped.float()[m].mean().item(),
                "train/ratio_mean": ratio.detach()[m].mean().item(),
            }
            lag = torch.zeros_like(mask, dtype=torch.long) if lag is None else lag
            fresh = m & (lag == 0)
            metrics |= _gap("mismatch", is_log_ratio, corrected, fresh)
            metrics |= _gap("off_policy", is_log_ratio, corrected, m & (lag > 0))
            for k in sorted(set(lag[m & (lag > 0)].tolist())):
                at_k = m & (lag == k)
                metrics[f"off_policy/lag{k}/logprob_abs_diff"] = (
                    is_log_ratio.abs()[at_k].mean().item()
                )
                metrics[f"off_policy/lag{k}/tokens"] = float(at_k.sum().item())
            if ref_logprobs is not None:
                metrics["train/ref_kl"] = (
                    k3(ref_logprobs.detach() - logprobs.detach())[m].mean().item()
                )
            if entropy is not None:
                metrics["train/entropy"] = entropy.detach()[m].mean().item()
        else:
            metrics = {}
    return LossOutput(loss=loss, metrics=metrics, num_tokens=n_tok)


def reduce_metrics(outputs: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Merge per-micro-batch (metrics, num_tokens): keys ending in `_max`/`_min` take the
    max/min, `tokens` counts add up, the others are means weighted by their group's `tokens`
    (`mismatch/tokens` for `mismatch/k3_kl`) when the micro-batch reports one, else by
    num_tokens."""
    merged: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, n in outputs:
        for key, value in metrics.items():
            group = key.rsplit("/", 1)[0]
            if key.endswith("_max"):
                merged[key] = max(merged.get(key, -math.inf), value)
            elif key.endswith("_min"):
                merged[key] = min(merged.get(key, math.inf), value)
            elif key.endswith("/tokens"):
                merged[key] = merged.get(key, 0.0) + value
            else:
                w = metrics.get(f"{group}/tokens", n)
                merged[key] = merged.get(key, 0.0) + value * w
                weights[key] = weights.get(key, 0) + w
    for key, w in weights.items():
        merged[key] = merged[key] / w if w else 0.0
    return merged
