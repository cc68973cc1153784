"""The torch train backend on the tiny random model: log-probs, learning, micro-batching,
checkpoint/resume and HF export."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.backends import TrainSample, make_backend
from trainer.backends.torch_backend import TorchBackend, lr_factor
from trainer.config import AlgorithmConfig, TrainBackendConfig


def make(path, algorithm=None, **train):
    train.setdefault("lr", 1e-3)
    return TorchBackend(
        path,
        TrainBackendConfig(device="cpu", **train),
        algorithm or AlgorithmConfig(),
        temperature=0.7,
        total_steps=10,
        seed=0,
    )


def sample(ids: list[int], prompt_len: int, advantage: float) -> TrainSample:
    mask = [0] * prompt_len + [1] * (len(ids) - prompt_len)
    return TrainSample(ids, mask, [-5.0 * m for m in mask], advantage)


def on_policy(backend: TorchBackend, samples: list[TrainSample]) -> list[TrainSample]:
    """Give samples behaviour log-probs equal to the backend's own (no mismatch)."""
    lps = backend.logprobs(samples)
    return [
        TrainSample(
            s.token_ids,
            s.loss_mask,
            [lp * m for lp, m in zip(lp, s.loss_mask, strict=True)],
            s.advantage,
        )
        for s, lp in zip(samples, lps, strict=True)
    ]


BATCH = [
    sample([1, 15, 27, 300, 301, 302, 2], 3, +1.0),
    sample([1, 15, 27, 400, 2], 3, -1.0),
    sample([1, 99, 500, 501, 502, 503, 504, 2], 2, +0.5),
    sample([1, 99, 600, 2], 2, -0.5),
]


def test_logprobs_match_a_plain_forward_pass(tiny_model_path):
    backend = make(tiny_model_path, micro_batch_tokens=16)  # forces several padded micro-batches
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    got = backend.logprobs(BATCH)
    for s, lp in zip(BATCH, got, strict=True):
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1] / 0.7
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert lp[0] == 0.0 and len(lp) == len(s.token_ids)
        assert torch.allclose(torch.tensor(lp[1:]), want, atol=1e-5)


def test_training_moves_logprobs_along_the_advantage(tiny_model_path):
    backend = make(tiny_model_path)
    batch = on_policy(backend, BATCH)
    before = backend.logprobs(batch)
    for _ in range(5):
        metrics = backend.train_step(batch)
    after = backend.logprobs(batch)
    for s, b, a in zip(batch, before, after, strict=True):
        delta = sum((x - y) * m for x, y, m in zip(a, b, s.loss_mask, strict=True))
        assert delta * s.advantage > 0, (s.advantage, delta)
    for key in (
        "train/grad_norm",
        "train/lr",
        "mismatch/logprob_abs_diff",
        "mismatch/k3_kl",
        "mismatch/ratio_max",
        "mismatch/ratio_min",
        "mismatch/clip_frac",
        "train/loss",
    ):
        assert math.isfinite(metrics[key]), key
    assert backend.step == 5


def test_first_step_sees_no_mismatch_on_policy_and_a_gap_off_policy(tiny_model_path):
    backend = make(tiny_model_path)
    m = backend.train_step(on_policy(backend, BATCH))
    assert m["mismatch/logprob_abs_diff"] < 1e-5 and m["mismatch/clip_frac"] == 0.0
    m = backend.train_step(BATCH)  # behaviour log-probs of -5: a big gap
    assert m["mismatch/logprob_abs_diff"] > 0.5 and m["mismatch/ratio_min"] < 0.1


def test_micro_batching_does_not_change_the_step(tiny_model_path):
    a, b = (
        make(tiny_model_path, micro_batch_tokens=8),
        make(tiny_model_path, micro_batch_tokens=4096),
    )
    batch = on_policy(a, BATCH)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-4)
    # compare gradients: Adam's first step is ~lr * sign(grad), which amplifies rounding
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert (pa.grad - pb.grad).abs().max() <= 1e-5 * pb.grad.abs().max(), name


def test_gradient_checkpointing_gives_the_same_step(tiny_model_path):
    a, b = make(tiny_model_path), make(tiny_model_path, gradient_checkpointing=True)
    batch = on_policy(a, BATCH)
    a.train_step(batch)
    b.train_step(batch)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert (pa.grad - pb.grad).abs().max() <= 1e-5 * pb.grad.abs().max()


def test_checkpoint_resume_reproduces_the_next_step(tiny_model_path, tmp_path):
    a = make(tiny_model_path, warmup_steps=3, lr_schedule="cosine")
    batch = on_policy(a, BATCH)
    a.train_step(batch)
    a.save_checkpoint(tmp_path / "ckpt", {"controller": {"next_group": 7}})
    torch.rand(3)  # RNG moves on after the save; the resumed run must not see this
    expected = torch.rand(1)
    ma = a.train_step(batch)

    b = make(tiny_model_path, warmup_steps=3, lr_schedule="cosine")
    extra = b.load_checkpoint(tmp_path / "ckpt")
    assert extra == {"controller": {"next_group": 7}} and b.step == 1
    torch.rand(3)
    assert torch.equal(torch.rand(1), expected)  # RNG restored
    mb = b.train_step(batch)
    assert ma == mb
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_missing_checkpoint_is_a_clear_error(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="run.resume"):
        make(tiny_model_path).load_checkpoint(tmp_path / "nope")


def test_save_hf_is_loadable_by_transformers(tiny_model_path, tmp_path):
    backend = make(tiny_model_path)
    backend.train_step(on_policy(backend, BATCH))
    backend.save_hf(tmp_path / "final")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    state = backend.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, state[name]), name


def test_bf16_kl_and_entropy_paths(tiny_model_path):
    algo = AlgorithmConfig(
        kl_coef=0.1, entropy_coef=0.01, num_minibatches=2, aggregation="seq_mean"
    )
    backend = make(tiny_model_path, algorithm=algo, dtype="bf16")
    batch = on_policy(backend, BATCH)
    backend.train_step(batch)
    m = backend.train_step(batch)
    assert m["train/ref_kl"] > 0 and m["train/entropy"] > 0
    assert all(math.isfinite(v) for v in m.values())
    assert next(backend.model.parameters()).dtype == torch.float32  # fp32 master weights


def test_lr_schedule():
    assert [lr_factor(s, 2, 10, "constant") for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, 2, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 2, 10, "cosine") == pytest.approx(0.0)


def test_bad_samples_are_rejected(tiny_model_path):
    backend = make(tiny_model_path)
    with pytest.raises(ValueError, match="at least one sample"):
        backend.train_step([])
    with pytest.raises(ValueError, match="differ in length"):
        backend.train_step([TrainSample([1, 2, 3], [0, 1], [0.0, 0.0, 0.0], 1.0)])


@pytest.mark.gpu
def test_cuda_bf16_step(tiny_model_path, tmp_path):
    backend = make(tiny_model_path, device="cuda", dtype="bf16")
    assert next(backend.model.parameters()).device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for s, lp in zip(BATCH, backend.logprobs(BATCH), strict=True):
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            want = torch.log_softmax(model(ids).logits[0, :-1] / 0.7, -1).gather(
                -1, ids[0, 1:, None]
            )
        assert torch.allclose(torch.tensor(lp[1:]), want[:, 0], atol=0.05)  # bf16 autocast
    m = backend.train_step(on_policy(backend, BATCH))
    assert all(math.isfinite(v) for v in m.values())
    backend.save_checkpoint(tmp_path / "ckpt", {})
    assert backend.load_checkpoint(tmp_path / "ckpt") == {}


def test_train_samples_broadcast_group_advantages_to_segments():
    from gateway.trajectory import Segment, Trajectory
    from trainer.algorithms import trajectory_advantages
    from trainer.backends import train_samples
    from trainer.buffer import Batch, Group

    def traj(reward, segments):
        return Trajectory("s", reward=reward, segments=segments)

    two_segments = [
        Segment([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.6], [-1, 0, 0]),
        Segment([1, 9, 4], [0, 0, 1], [0.0, 0.0, -0.7], [-1, -1, 0]),
    ]
    prompt_only = Segment([1, 2], [0, 0], [0.0, 0.0], [-1, -1])  # nothing to train on
    group = Group(0, "p", 0, expected=3)
    group.trajectories = [
        traj(1.0, two_segments),
        traj(0.0, [Segment([1, 5], [0, 1], [0.0, -0.1], [-1, 0]), prompt_only]),
    ]
    group.dropped = [Trajectory("x", status="aborted", reward=1.0)]
    batch = Batch(groups=[group], version=0, staleness={})
    advantages = trajectory_advantages([g.rewards for g in batch.groups], "drgrpo")
    samples = train_samples(batch, advantages)  # mean 0.5 -> +0.5, -0.5
    assert [(s.token_ids, s.advantage) for s in samples] == [
        ([1, 2, 3], 0.5),
        ([1, 9, 4], 0.5),
        ([1, 5], -0.5),
    ]
    assert samples[0].logprobs == [0.0, -0.5, -0.6] and samples[1].loss_mask == [0, 0, 1]


def test_make_backend_builds_the_torch_backend(tiny_model_path):
    from trainer.config import load

    backend = make_backend(load(["recipe=tiny", "train.device=cpu"]))
    assert isinstance(backend, TorchBackend) and backend.step == 0
