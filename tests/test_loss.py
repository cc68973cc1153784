"""Advantages and the policy loss against numbers worked out by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from gateway.trajectory import Trajectory, Turn
from trainer.algorithms import (
    group_advantages,
    k3,
    overlong_penalty,
    policy_loss,
    reduce_metrics,
    subtract_overlong,
    trajectory_advantages,
)
from trainer.buffer import Group
from trainer.config import AlgorithmConfig

LOG4 = math.log(4.0)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_grpo_advantages_by_hand():
    # mean 0.25; unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages(t([1, 0, 0, 0], [2, 2, 2, 2]), "grpo", eps=0.0)
    assert adv[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # zero-variance group: all zeros (0 / (0 + eps)), never NaN
    assert torch.equal(group_advantages(t([2, 2]), "grpo"), torch.zeros(1, 2))


def test_drgrpo_advantages_skip_std():
    adv = group_advantages(t([1, 0, 0, 0]), "drgrpo")
    assert adv[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def _reply(*lengths: int, cap: int | None = 64, delivered: bool = True) -> Trajectory:
    turns = [
        Turn([1], [7] * n, [0.0] * n, [0] * n, "stop", delivered=delivered, max_tokens=cap)
        for n in lengths
    ]
    return Trajectory("s", turns=turns)


def test_overlong_penalty_by_hand():
    # cap 64, buffer 16: free up to 48 tokens, then 1/16 per token, 1 at the cap
    assert [overlong_penalty(_reply(n), 16) for n in (20, 48, 52, 60, 64)] == [0, 0, 0.25, 0.75, 1]
    assert overlong_penalty(_reply(10, 56), 16) == 0.5  # the worst turn counts
    assert overlong_penalty(_reply(64, cap=None), 16) == 0  # no cap, nothing to exceed
    assert overlong_penalty(_reply(64, delivered=False), 16) == 0  # never seen, never trained
    assert overlong_penalty(_reply(64), 0) == 0  # off


@pytest.mark.parametrize("kind", ["grpo", "opd"])
def test_overlong_penalty_is_taken_from_the_advantage(kind):
    trajs = [_reply(20), _reply(60), _reply(64), _reply(30)]
    trajs[0].reward, trajs[1].reward = 1.0, 1.0
    group = Group(0, prompt=0, admitted_version=0, expected=4, trajectories=trajs)
    advantages = trajectory_advantages([group.rewards], kind)
    before = [list(a) for a in advantages]
    metrics = subtract_overlong([group], advantages, buffer=16, penalty=0.5)
    # penalties 0, 0.75, 1, 0, times 0.5
    cut = [0.0, 0.375, 0.5, 0.0]
    assert advantages[0] == pytest.approx([b - c for b, c in zip(before[0], cut, strict=True)])
    assert metrics == {"overlong/frac": 0.5, "overlong/penalty_mean": pytest.approx(0.875 / 4)}


def test_advantages_reject_bad_shape():
    with pytest.raises(ValueError, match="groups, samples"):
        group_advantages(torch.ones(4), "grpo")
    with pytest.raises(ValueError, match="grpo or drgrpo"):
        group_advantages(torch.ones(1, 2), "ppo")


def test_ppo_clip_values_and_gradient():
    # proximal = behaviour = 0; ratios 1.5, 0.5, 1.1; advantages +1, -1, +1; eps 0.2
    # tok1: max(-1.5, -1.2) = -1.2 (clipped, no grad)
    # tok2: max(0.5, 0.8) = 0.8 (clipped, no grad)
    # tok3: max(-1.1, -1.1) = -1.1 (grad -1.1)
    # token mean: (-1.2 + 0.8 - 1.1) / 3 = -0.5
    cfg = AlgorithmConfig(importance_sampling="none")
    cur = torch.log(t([1.5, 0.5, 1.1])).requires_grad_()
    zeros = torch.zeros(1, 3)
    out = policy_loss(cfg, cur, zeros, zeros, t([1, -1, 1]), torch.ones(1, 3))
    assert out.loss.item() == pytest.approx(-0.5)
    out.loss.backward()
    assert cur.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1 / 3])
    assert out.metrics["train/ppo_clip_frac"] == pytest.approx(2 / 3)
    assert out.metrics["mismatch/logprob_abs_diff"] == 0.0
    assert out.metrics["mismatch/ratio_max"] == 1.0 and out.metrics["mismatch/ratio_min"] == 1.0
    assert out.num_tokens == 3


def test_the_gap_is_split_into_fresh_mismatch_and_stale_drift():
    # IS log-ratios p - b: 0.1 on the fresh token, log4 at lag 1, -log4 and 0 at lag 2
    cfg = AlgorithmConfig(importance_sampling="none", is_threshold=2.0)
    zeros = torch.zeros(1, 5)
    behaviour = t([-0.1, -LOG4, LOG4, 0.0, 0.0])
    mask = t([1, 1, 1, 1, 0])
    lag = torch.tensor([[0, 1, 2, 2, 5]])  # the last token is not trained: never counted
    m = policy_loss(cfg, zeros.clone(), zeros, behaviour, torch.ones(1, 5), mask, lag=lag).metrics
    assert m["mismatch/tokens"] == 1 and m["off_policy/tokens"] == 3
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(0.1)
    assert m["mismatch/ratio_max"] == m["mismatch/ratio_min"] == pytest.approx(math.exp(0.1))
    assert m["mismatch/clip_frac"] == 0.0
    assert m["off_policy/logprob_abs_diff"] == pytest.approx(2 * LOG4 / 3)
    assert m["off_policy/ratio_max"] == pytest.approx(4.0)
    assert m["off_policy/ratio_min"] == pytest.approx(0.25)
    assert m["off_policy/clip_frac"] == pytest.approx(2 / 3)
    assert m["off_policy/lag1/logprob_abs_diff"] == pytest.approx(LOG4)
    assert m["off_policy/lag2/logprob_abs_diff"] == pytest.approx(LOG4 / 2)
    assert m["off_policy/lag2/tokens"] == 2 and "off_policy/lag5/tokens" not in m
    # all stale: no numerical gap to report, only its (zero) token count
    m = policy_loss(cfg, zeros.clone(), zeros, behaviour, torch.ones(1, 5), mask, lag=lag + 1)
    assert m.metrics["mismatch/tokens"] == 0 and "mismatch/logprob_abs_diff" not in m.metrics


@pytest.mark.parametrize(
    ("mode", "expected_loss", "expected_clip_frac"),
    [
        # pg = -1 per token (A = 1, current = proximal); IS ratios exp(p - b) = 1, 4, 0.25; C = 2
        ("none", -3 / 3, 2 / 3),  # weights 1, 1, 1 (clip_frac reports what MIS would mask)
        ("tis", -(1 + 2 + 0.25) / 3, 1 / 3),  # weights 1, min(4, 2), 0.25
        ("mis", -1 / 3, 2 / 3),  # weights 1, 0 (4 > 2), 0 (0.25 < 1/2)
    ],
)
def test_importance_sampling_modes(mode, expected_loss, expected_clip_frac):
    cfg = AlgorithmConfig(importance_sampling=mode, is_threshold=2.0)
    zeros = torch.zeros(1, 3)
    behaviour = t([0.0, -LOG4, LOG4])
    out = policy_loss(cfg, zeros.clone(), zeros, behaviour, torch.ones(1, 3), torch.ones(1, 3))
    assert out.loss.item() == pytest.approx(expected_loss)
    m = out.metrics
    assert m["mismatch/clip_frac"] == pytest.approx(expected_clip_frac)
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(2 * LOG4 / 3)
    # k3 = e^x - x - 1: 0, 4 - log4 - 1, 1/4 + log4 - 1 -> sum 2.25, mean 0.75
    assert m["mismatch/k3_kl"] == pytest.approx(0.75)
    assert m["mismatch/ratio_max"] == pytest.approx(4.0)
    assert m["mismatch/ratio_min"] == pytest.approx(0.25)


def test_token_mean_vs_seq_mean():
    # seq 1: one token, A = 2 -> pg -2; seq 2: three tokens, A = -1 -> pg 1, 1, 1
    # token_mean (-2 + 3) / 4 = 0.25; seq_mean (-2 + 1) / 2 = -0.5
    zeros = torch.zeros(2, 3)
    adv = t([2, 2, 2], [-1, -1, -1])
    mask = t([1, 0, 0], [1, 1, 1])
    tok = policy_loss(AlgorithmConfig(aggregation="token_mean"), zeros, zeros, zeros, adv, mask)
    seq = policy_loss(AlgorithmConfig(aggregation="seq_mean"), zeros, zeros, zeros, adv, mask)
    assert tok.loss.item() == pytest.approx(0.25)
    assert seq.loss.item() == pytest.approx(-0.5)


def test_kl_and_entropy_terms():
    # A = 0 so only the extra terms count. k3(log 2) = 2 - log 2 - 1 = 0.30685; x 0.1
    zeros = torch.zeros(1, 1)
    kl = policy_loss(
        AlgorithmConfig(kl_coef=0.1),
        zeros,
        zeros,
        zeros,
        zeros,
        torch.ones(1, 1),
        ref_logprobs=t([math.log(2)]),
    )
    assert kl.loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    ent = policy_loss(
        AlgorithmConfig(entropy_coef=0.5),
        zeros,
        zeros,
        zeros,
        zeros,
        torch.ones(1, 1),
        entropy=t([1.0]),
    )
    assert ent.loss.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(AlgorithmConfig(kl_coef=0.1), zeros, zeros, zeros, zeros, torch.ones(1, 1))


def test_k3_is_non_negative_and_zero_at_zero():
    x = torch.linspace(-3, 3, 13)
    assert (k3(x) >= 0).all() and k3(torch.zeros(1)).item() == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_add_up_to_the_whole(aggregation):
    cfg = AlgorithmConfig(aggregation=aggregation, importance_sampling="tis")
    g = torch.Generator().manual_seed(0)
    cur = torch.randn(4, 5, generator=g) * 0.1
    prox = cur + torch.randn(4, 5, generator=g) * 0.1
    beh = prox + torch.randn(4, 5, generator=g) * 0.5
    adv = torch.randn(4, 1, generator=g).expand(4, 5)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    lag = torch.randint(0, 3, (4, 5), generator=g)
    whole = policy_loss(cfg, cur, prox, beh, adv, mask, lag=lag)
    n_tok, n_seq = mask.sum().item(), 4
    parts = [
        policy_loss(
            cfg,
            cur[s],
            prox[s],
            beh[s],
            adv[s],
            mask[s],
            lag=lag[s],
            num_tokens=n_tok,
            num_seqs=n_seq,
        )  # fmt: skip
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p.loss for p in parts).item() == pytest.approx(whole.loss.item(), abs=1e-6)
    merged = reduce_metrics([(p.metrics, p.num_tokens) for p in parts])
    for key in (
        "mismatch/logprob_abs_diff",
        "mismatch/k3_kl",
        "mismatch/ratio_max",
        "mismatch/ratio_min",
        "mismatch/clip_frac",
        "mismatch/tokens",
        "off_policy/logprob_abs_diff",
        "off_policy/k3_kl",
        "off_policy/clip_frac",
        "off_policy/tokens",
        "off_policy/lag2/logprob_abs_diff",
        "off_policy/lag2/tokens",
    ):
        assert merged[key] == pytest.approx(whole.metrics[key], rel=1e-5), key
