"""The torch train backend on the tiny random model: log-probs, learning, micro-batching,
checkpoint/resume and HF export."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.algorithms import policy_loss
from trainer.backends import TrainSample, make_backend
from trainer.backends.torch_backend import TorchBackend, VocabLogprobs, lr_factor
from trainer.config import AlgorithmConfig, TrainBackendConfig, TrainerConfig


def make(path, algorithm=None, **train):
    train.setdefault("lr", 1e-3)
    train.setdefault("dtype", "fp32")  # compared with fp32 references, on any CPU
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


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("bias", [False, True])
def test_vocab_logprobs_equal_autograds_chain(softcap, bias):
    """The fused LM-head log-probs and entropy, and their gradients, against the plain chain
    (linear, softcap, temperature, log_softmax), in fp32 and under bf16 autocast. Rows span
    several chunks; logits reach ~15, so a missed max shift or a wrong exp would show."""
    torch.manual_seed(0)
    n, h, v, temperature = 37, 16, 50, 0.7
    hidden, weight = torch.randn(n, h) * 2, torch.randn(v, h)
    b = torch.randn(v) if bias else None
    targets = torch.randint(0, v, (n,))
    g_logp, g_entropy = torch.randn(n), torch.randn(n)

    def grads(fn, autocast):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, entropy = fn(*leaves)
        ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
        return [logp.detach(), entropy.detach()] + [t.grad for t in leaves]

    def chain(hid, w, bb=None):
        z = torch.nn.functional.linear(hid, w, bb).float()
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        logp = torch.log_softmax(z / temperature, -1)
        return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def fused(hid, w, bb=None):
        return VocabLogprobs.apply(hid, w, bb, targets, temperature, softcap, True)

    def ours(autocast):
        with pytest.MonkeyPatch.context() as m:
            m.setattr("trainer.backends.torch_backend.VOCAB_CHUNK_ELEMENTS", 8 * v)
            return grads(fused, autocast)

    truth = grads(chain, False)
    names = ("logp", "entropy", "hidden", "weight", "bias")[: len(truth)]
    for name, a, e in zip(names, ours(False), truth, strict=True):
        assert a.dtype == e.dtype and torch.allclose(a, e, atol=1e-5, rtol=1e-5), name
    # bf16: no further from fp32 than autocast's own chain is
    for name, a, e, t in zip(names, ours(True), grads(chain, True), truth, strict=True):
        assert a.dtype == e.dtype, name
        assert (a - t).abs().max() <= 2 * (e - t).abs().max() + 1e-3, name
    logp, entropy = VocabLogprobs.apply(hidden, weight, b, targets, temperature, softcap, False)
    assert entropy.numel() == 0 and logp.shape == (n,)


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


def test_stale_tokens_report_drift_apart_from_the_numerical_gap(tiny_model_path):
    """Tokens sampled with the weights being trained measure the numerical gap; those sampled
    a version earlier measure a step of policy drift, and are reported as such."""
    backend = make(tiny_model_path, lr=1e-2)
    old = on_policy(backend, BATCH)  # behaviour = version 0's own log-probs
    for s in old:
        s.versions = [0 if m else -1 for m in s.loss_mask]
    backend.train_step(old)
    fresh = on_policy(backend, BATCH)  # version 1's log-probs, at version 1
    for s in fresh:
        s.versions = [1 if m else -1 for m in s.loss_mask]
    m = backend.train_step(old + fresh)
    assert m["mismatch/tokens"] == m["off_policy/tokens"] == sum(sum(s.loss_mask) for s in old)
    assert m["mismatch/logprob_abs_diff"] < 1e-5  # fp32: no numerical gap
    assert m["off_policy/logprob_abs_diff"] > 1e-3  # one step of drift
    assert m["off_policy/lag1/logprob_abs_diff"] == m["off_policy/logprob_abs_diff"]


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


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_gives_the_same_step(tiny_model_path, lora_rank):
    a = make(tiny_model_path, lora_rank=lora_rank)
    b = make(tiny_model_path, gradient_checkpointing=True, lora_rank=lora_rank)
    if lora_rank:  # the same adapters, away from zero (B = 0 gives A no gradient)
        with torch.no_grad():
            for pa, pb in zip(a.params, b.params, strict=True):
                pb.copy_(pa.normal_(0, 0.05))
    batch = on_policy(a, BATCH)
    a.train_step(batch)
    b.train_step(batch)
    for pa, pb in zip(a.params, b.params, strict=True):
        assert pb.grad is not None and pb.grad.abs().max() > 0
        assert (pa.grad - pb.grad).abs().max() <= 1e-5 * pb.grad.abs().max()


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_checkpoint_resume_reproduces_the_next_step(tiny_model_path, tmp_path, lora_rank):
    a = make(tiny_model_path, warmup_steps=3, lr_schedule="cosine", lora_rank=lora_rank)
    batch = on_policy(a, BATCH)
    a.train_step(batch)
    a.save_checkpoint(tmp_path / "ckpt", {"controller": {"next_group": 7}})
    torch.rand(3)  # RNG moves on after the save; the resumed run must not see this
    expected = torch.rand(1)
    ma = a.train_step(batch)

    b = make(tiny_model_path, warmup_steps=3, lr_schedule="cosine", lora_rank=lora_rank)
    extra = b.load_checkpoint(tmp_path / "ckpt")
    assert extra == {"controller": {"next_group": 7}} and b.step == 1
    torch.rand(3)
    assert torch.equal(torch.rand(1), expected)  # RNG restored
    mb = b.train_step(batch)
    timed = ("perf/train_tflops", "perf/mfu")  # FLOPs over wall time: the only clock-dependent ones
    assert {k: v for k, v in ma.items() if k not in timed} == {
        k: v for k, v in mb.items() if k not in timed
    }
    for pa, pb in zip(a.params, b.params, strict=True):
        assert torch.equal(pa, pb)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_missing_checkpoint_is_a_clear_error(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="run.resume"):
        make(tiny_model_path).load_checkpoint(tmp_path / "nope")
    make(tiny_model_path).save_checkpoint(tmp_path / "full", {})
    with pytest.raises(ValueError, match="saved without LoRA; resume with the train.lora_rank"):
        make(tiny_model_path, lora_rank=4).load_checkpoint(tmp_path / "full")


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_save_hf_is_loadable_by_transformers(tiny_model_path, tmp_path, lora_rank):
    backend = make(tiny_model_path, lora_rank=lora_rank)
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


async def test_an_agent_that_drops_its_own_reply_is_trained_segment_by_segment(
    tiny_model_path, engine, renderer
):
    """mini-swe-agent drops a malformed reply from the history it re-sends, so its session forks
    into two segments. A real session on the gateway does that here; the trainer then gets one
    sample per segment, every sampled token in exactly one of them (the fork's copy of the
    earlier, kept reply is prompt there: loss mask 0), and on each segment's sampled tokens the
    trainer's log-probs equal the engine's: each is scored in the context it was sampled in."""
    from gateway.server import Gateway, GatewayConfig
    from trainer.algorithms import trajectory_advantages
    from trainer.backends import train_samples
    from trainer.buffer import Batch, Group

    async def call(client, messages):
        r = await client.chat.completions.create(model="tiny-random", messages=messages)
        return r.choices[0].message.content

    gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"), renderer=renderer)
    try:
        trajectories = []
        for reward in (1.0, 0.0):
            sid, key = gw.create_session({}, sampling={"temperature": 0.7, "max_tokens": 8})
            client = gw.openai_client(key)
            history = [{"role": "user", "content": "Count the files."}]
            kept = await call(client, history)  # a good reply: kept, and the agent goes on
            history += [
                {"role": "assistant", "content": kept},
                {"role": "user", "content": "<output>3</output>"},
            ]
            await call(client, history)  # malformed: dropped, a format error in its place
            await call(client, history + [{"role": "user", "content": "Reply with one block."}])
            gw.attach_reward(sid, reward)
            trajectories.append(await gw.close_session(sid))
    finally:
        await gw.aclose()

    assert [(t.forks, len(t.segments)) for t in trajectories] == [(1, 2), (1, 2)]
    group = Group(0, "p", 0, expected=2, trajectories=trajectories)
    batch = Batch(groups=[group], version=0, staleness={})
    samples = train_samples(batch, trajectory_advantages([group.rewards], "grpo"))
    assert len(samples) == 4 and [s.advantage > 0 for s in samples] == [True, True, False, False]
    for t, (seg1, seg2) in zip(trajectories, (samples[:2], samples[2:]), strict=True):
        trained = [
            i for s in (seg1, seg2) for i, m in zip(s.token_ids, s.loss_mask, strict=True) if m
        ]
        assert trained == [i for turn in t.turns for i in turn.output_ids]  # each once, in order
        kept = len(t.turns[0].prompt_ids) + len(t.turns[0].output_ids)
        assert seg2.token_ids[:kept] == seg1.token_ids[:kept]  # the kept reply, in the fork...
        assert (
            seg2.loss_mask[:kept] == [0] * kept and seg1.loss_mask[:kept].count(1) > 0
        )  # ...as prompt

    backend = make(tiny_model_path)  # temperature 0.7, fp32: the engine's log-probs
    for s, lp in zip(samples, backend.logprobs(samples), strict=True):
        gap = [abs(a - b) for a, b, m in zip(lp, s.logprobs, s.loss_mask, strict=True) if m]
        assert gap and max(gap) < 1e-3, max(gap)
    metrics = backend.train_step(samples)
    assert metrics["mismatch/logprob_abs_diff"] < 1e-3 and metrics["mismatch/clip_frac"] == 0.0


def test_make_backend_builds_the_torch_backend(tiny_model_path):
    from trainer.config import load

    backend = make_backend(load(["recipe=tiny", "train.device=cpu"]))
    assert isinstance(backend, TorchBackend) and backend.step == 0


def padded_step_reference(path, samples: list[TrainSample], algo: AlgorithmConfig, state=None):
    """The step as it was before packing: each sample its own padded row, logits everywhere;
    returns (loss, model with its gradients). `state`: weights instead of the folder's."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    width = max(len(s.token_ids) for s in samples)

    def pad(rows, value):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.float32)

    ids = pad([s.token_ids for s in samples], 0).long()
    attn = pad([[1] * len(s.token_ids) for s in samples], 0).long()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / 0.7
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    mask = pad([s.loss_mask for s in samples], 0)
    logp = logp * mask
    out = policy_loss(
        algo,
        logp,
        logp.detach(),
        pad([s.logprobs for s in samples], 0.0),
        torch.tensor([s.advantage for s in samples])[:, None].expand_as(mask),
        mask,
        num_tokens=mask.sum().item(),
        num_seqs=len(samples),
    )
    out.loss.backward()
    return out.loss.item(), model


TEMPLATE = list(range(1000, 1020))  # a 20-token chat template every prompt opens with
SHARED = [
    sample(TEMPLATE + [15, 27, 300, 301, 302, 2], 22, +1.0),
    sample(TEMPLATE + [15, 27, 400, 2], 22, -1.0),
    sample(TEMPLATE + [99, 500, 501, 502, 503, 504, 2], 21, +0.5),
    sample(TEMPLATE + [99, 600, 2], 21, -0.5),
]


@pytest.mark.parametrize(
    ("batch", "prefix", "tokens"),
    [
        # one row per prompt: [1, 15, 27] + two continuations, [1, 99] + two continuations
        (BATCH, 0, (3 + 4 + 2) + (2 + 6 + 2)),
        # the template once (>= SHARED_PREFIX_MIN tokens), then [15, 27] + two continuations
        # and [99] + two continuations as rows whose past it is
        (SHARED, 20, 20 + (2 + 4 + 2) + (1 + 6 + 2)),
    ],
)
def test_packed_prompts_give_the_padded_steps_loss_and_gradients(
    tiny_model_path, batch, prefix, tokens
):
    backend = make(tiny_model_path, grad_clip=0.0)  # gradients as computed
    batch = on_policy(backend, batch)  # all positions: no shared prefix
    (packed,) = backend._packs(list(range(len(batch))), batch)
    assert packed.input_ids.shape[0] == 2 and packed.prefix.shape == (1, prefix)
    assert packed.tokens == tokens
    metrics = backend.train_step(batch)
    loss, reference = padded_step_reference(tiny_model_path, batch, backend.algorithm)
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for (name, pa), pb in zip(
        backend.model.named_parameters(), reference.parameters(), strict=True
    ):
        assert (pa.grad - pb.grad).abs().max() <= 1e-5 * pb.grad.abs().max(), name


def test_lora_trains_adapters_and_the_engines_get_the_merged_model(tiny_model_path):
    """The adapters' gradients are the full model's weight gradients through W + s B A (the
    padded reference at the merged weights, by the chain rule); the base model and its LM head
    stay as they were; the push, `state_dict` and a plain model loaded from it agree."""
    backend = make(tiny_model_path, lora_rank=4, lora_alpha=8.0, grad_clip=0.0)
    lora, base = backend.lora, {k: v.clone() for k, v in backend.model.state_dict().items()}
    assert lora.scale == 2.0 and len(lora.targets) == 2 * 7  # q k v o gate up down per layer
    assert all(torch.equal(v, base[k]) for k, v in backend.state_dict().items())  # B = 0
    assert backend.params == [*lora.parameters()]
    with torch.no_grad():  # B = 0 would give A no gradient: start away from the model
        for b in lora.b:
            b.normal_(0, 0.05)
    a0, b0 = [a.clone() for a in lora.a], [b.clone() for b in lora.b]
    merged = backend.state_dict()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base[
        "model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    batch = on_policy(backend, BATCH)
    metrics = backend.train_step(batch)

    loss, reference = padded_step_reference(tiny_model_path, batch, backend.algorithm, merged)
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    grads = {k: p.grad for k, p in reference.named_parameters()}
    for i, name in enumerate(lora.targets):
        g = grads[name]  # dL/dW at W + s B A;  dL/dB = s g A^T,  dL/dA = s B^T g
        want_b, want_a = 2.0 * g @ a0[i].T, 2.0 * b0[i].T @ g
        assert (lora.b[i].grad - want_b).abs().max() <= 1e-5 * want_b.abs().max(), name
        assert (lora.a[i].grad - want_a).abs().max() <= 1e-5 * want_a.abs().max(), name
    for name, p in backend.model.named_parameters():
        assert p.grad is None and torch.equal(p, base[name]), name  # frozen, head included

    state = backend.state_dict()
    for i, name in enumerate(lora.targets):  # the step moved the adapters: merged anew
        assert torch.allclose(state[name], base[name] + 2.0 * lora.b[i] @ lora.a[i], atol=1e-6)
    source = backend.weight_source()
    names = [spec.name for spec in source.hf_specs()]
    assert names == [n for n in state if n != "lm_head.weight"]  # tied: once
    assert all(torch.equal(t, state[n]) for n, t in source.hf_tensors(names))
    plain = make(tiny_model_path)
    plain.model.load_state_dict(state)
    for x, y in zip(plain.logprobs(batch), backend.logprobs(batch), strict=True):
        assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < 1e-5


def test_lora_needs_the_torch_backend():
    with pytest.raises(ValueError, match="train.lora_rank needs train.kind=torch"):
        TrainBackendConfig(kind="megatron", lora_rank=8)


def test_mfu_is_counted_flops_over_time_and_the_measured_peak(tiny_model_path, monkeypatch):
    from types import SimpleNamespace

    from trainer.backends import torch_backend

    monkeypatch.setattr(torch_backend.machine, "matmul_gflops", lambda *a, **k: 50.0)
    backend = make(tiny_model_path)
    clock = iter([10.0, 12.0])  # the step takes 2 s
    monkeypatch.setattr(torch_backend, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    m = backend.train_step(BATCH[:2])
    # Tiny model: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 49152.
    # Linear MACs per token: qkv 64*128 + o 64*64 + gate_up 64*256 + down 128*64 = 36864.
    # One packed row: prompt [1, 15, 27] once, then 4 + 2 continuation tokens = 9 tokens.
    # Attended keys: prompt 1+2+3, first continuation 4+5+6+7, second 4+5 = 37.
    # LM head on the 6 loss positions. Forward: 2 * (2 * (9*36864 + 2*64*37) + 6*64*49152).
    forward = 2 * (2 * (9 * 36864 + 2 * 64 * 37) + 6 * 64 * 49152)
    assert forward == 39_094_784
    assert m["perf/train_tflops"] == pytest.approx(3 * forward / 2.0 / 1e12)
    assert m["perf/mfu"] == pytest.approx(3 * forward / 2.0 / 50e9)
    # LoRA rank 4: the frozen matmuls' weight gradients are not computed (attention's 2 * 2 *
    # 64 * 37 a layer still 3x), the adapters' (in + out per linear: q 128, k 96, v 96, o 128,
    # gate 192, up 192, down 192 = 1024 a layer) 3 x 2 x 4 x 2048 a token, 9 tokens.
    clock = iter([10.0, 12.0])
    m = make(tiny_model_path, lora_rank=4).train_step(BATCH[:2])
    flops = 2 * forward + 2 * 2 * (2 * 64 * 37) + 3 * 9 * (2 * 4 * 2048)
    assert m["perf/train_tflops"] == pytest.approx(flops / 2.0 / 1e12)


@pytest.mark.parametrize(("native", "want"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_the_probe_in_backend_and_run(
    tiny_model_path, monkeypatch, native, want
):
    from gateway import machine
    from trainer.run import resolve_dtype

    # The probe's result injected: bf16 is native here or not, and measures 4x faster.
    monkeypatch.setattr(machine, "native_bf16", lambda device="cpu": native)
    monkeypatch.setattr(
        machine,
        "matmul_gflops",
        lambda m, k, n, dtype=torch.float32, device="cpu": (
            100.0 if dtype == torch.bfloat16 else 25.0
        ),
    )
    backend = make(tiny_model_path, dtype="auto")
    assert backend.dtype == want
    with backend._autocast():
        out = backend.model.get_output_embeddings()(torch.ones(1, 64))
    assert out.dtype == want
    assert make(tiny_model_path, dtype="fp32").dtype == torch.float32  # asked, not probed

    cfg = TrainerConfig()
    assert cfg.train.dtype == "auto" and cfg.engine.dtype == "float32"
    header = resolve_dtype(cfg)
    name = "bf16" if native else "fp32"
    assert cfg.train.dtype == name and cfg.engine.dtype == str(want).removeprefix("torch.")
    assert f"train.dtype=auto -> {name}, engine {cfg.engine.dtype}" in header

    cfg = TrainerConfig()  # megatron-core on CPU is fp32 only: auto never picks bf16 for it
    cfg.train.kind = "megatron"
    assert "train.dtype=auto -> fp32" in resolve_dtype(cfg) and cfg.train.dtype == "fp32"


def test_the_trainer_computes_with_the_idle_engines_cores(tiny_model_path):
    """Borrowing: each decoder layer's forward and backward runs with this process's threads
    plus the idle lenders' cores, re-read from the board at each layer (the engine here turns
    busy after the first layer's forward, then idle before the last layer's backward); after
    the step the process has its own threads again."""
    from gateway import machine

    own = torch.get_num_threads()
    backend = make(tiny_model_path)
    board = machine.CoreBoard.create(2)
    engine = machine.CoreBoard(board.path, 1)
    seen: list[tuple[str, int]] = []
    first, last = backend.model.model.layers[0], backend.model.model.layers[-1]
    try:
        backend.share_cores(board)
        first.register_forward_pre_hook(lambda *_: seen.append(("forward", threads())))
        first.register_full_backward_pre_hook(lambda *_: seen.append(("backward", threads())))
        threads = torch.get_num_threads
        engine.mark(busy=False, cores=3)
        hook = first.register_forward_hook(lambda *_: engine.mark(busy=True, cores=3))
        m = backend.train_step(BATCH)
        assert seen == [("forward", own + 3), ("backward", own)]
        assert own < m["perf/threads"] < own + 3 and torch.get_num_threads() == own
        peak = backend.peak_gflops * 1e9 * m["perf/threads"] / own  # the cores it had
        assert m["perf/mfu"] == pytest.approx(m["perf/train_tflops"] * 1e12 / peak)
        hook.remove()
        seen.clear()
        last.register_full_backward_pre_hook(lambda *_: engine.mark(busy=False, cores=3))
        backend.train_step(BATCH)
        assert seen == [("forward", own), ("backward", own + 3)]
        assert torch.get_num_threads() == own
        with pytest.raises(ValueError, match="train.device=cpu"):
            backend.device = torch.device("cuda")
            backend.share_cores(board)
    finally:
        torch.set_num_threads(own)
        engine.close()
        board.close()
