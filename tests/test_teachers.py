"""The Teacher Manager with real local engines on small random teachers: scores equal a
teacher-forced forward pass, routing, the memory budget (measured: open engines and RSS), LRU
swaps, verification of uniform or changed weights, failures that name the teacher, and the
SGLang release/resume path against the protocol-faithful fake server."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import random
import shutil
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import pytest
import torch
import yaml
from fake_sglang import serve_fake, step, token_logprob
from transformers import AutoConfig, AutoModelForCausalLM

from gateway.config import ConfigError
from gateway.engines import EngineConfig
from gateway.models import loongsage_home
from gateway.trajectory import Trajectory, Turn
from trainer.algorithms import add_distill_advantages, trajectory_advantages
from trainer.backends.base import TrainSample
from trainer.config import RECIPE_DIR, load
from trainer.controller import StopRun
from trainer.metrics import read_metrics
from trainer.run import train
from trainer.teachers.config import DistillConfig, TeacherConfig, parse_bytes
from trainer.teachers.make import made_teacher
from trainer.teachers.manager import TeacherError, TeacherManager, check_not_uniform
from trainer.teachers.residency import release_freed_memory, weight_bytes


def make_teacher(base, out, seed: int, hidden: int = 64, zero: bool = False):
    """A random Llama with the tiny model's tokenizer, in folder `out`."""
    config = AutoConfig.from_pretrained(base)
    config.hidden_size, config.intermediate_size = hidden, 2 * hidden
    config.head_dim = hidden // config.num_attention_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if zero:  # every logit 0: the uniform distribution
        for p in model.parameters():
            p.data.zero_()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("teachers")
    return [make_teacher(tiny_model_path, root / f"t{i}", seed=i) for i in range(3)]


def distill(paths, route=None, **kw) -> tuple[DistillConfig, dict]:
    names = {f"t{i}": p for i, p in enumerate(paths)}
    cfg = DistillConfig(
        teachers={n: TeacherConfig(model=str(p)) for n, p in names.items()},
        route=route or {f"env{i}": f"t{i}" for i in range(len(paths))},
        **kw,
    )
    return cfg, names


def trajectory(rng: random.Random, tag: str, turns: int = 1) -> Trajectory:
    """Sampled tokens after a prompt; with 2 turns, the second starts a new segment."""
    traj = Trajectory(f"s{rng.random()}", metadata={"env": "loongsage/X-v0", "env_tag": tag})
    for _ in range(turns):
        prompt = [1] + [rng.randrange(20, 5000) for _ in range(rng.randint(2, 6))]
        out = [rng.randrange(20, 5000) for _ in range(rng.randint(3, 8))]
        traj.turns.append(Turn(prompt, out, [-1.0] * len(out), [0] * len(out), "stop"))
    traj.rebuild_segments()
    return traj


def forward_logprobs(path, ids: list[int]) -> list[float]:
    """Teacher-forced: log p(ids[i] | ids[:i]) for i >= 1, with transformers directly."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return [0.0] + logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def assert_scored_by(traj: Trajectory, path) -> None:
    for seg in traj.segments:
        expected = forward_logprobs(path, seg.token_ids)
        for got, want, m in zip(seg.teacher_logprobs, expected, seg.loss_mask, strict=True):
            assert got == (pytest.approx(want, abs=1e-5) if m else 0.0)


async def test_scores_equal_a_teacher_forced_forward_pass(teachers):
    cfg, paths = distill(teachers[:1])
    traj = trajectory(random.Random(0), "env0", turns=2)
    assert len(traj.segments) == 2
    async with TeacherManager(cfg, paths) as manager:
        await manager.score(traj)
    assert traj.metadata["teacher"] == "t0"
    assert_scored_by(traj, teachers[0])


async def test_routing_sends_each_sample_to_its_envs_teacher(teachers):
    route = {"env0": "t0", "env1": "t1", "loongsage/Other-v0": "t0"}
    cfg, paths = distill(teachers[:2], route=route)
    rng = random.Random(1)
    trajs = [trajectory(rng, tag) for tag in ["env0", "env1", "env1", "env0", "unrouted"]]
    by_id = trajectory(rng, "untagged")
    by_id.metadata["env"] = "loongsage/Other-v0"  # no route for its tag: its env id decides
    async with TeacherManager(cfg, paths) as manager:
        await asyncio.gather(*(manager.score(t) for t in [*trajs, by_id]))
    assert [t.metadata.get("teacher") for t in trajs] == ["t0", "t1", "t1", "t0", None]
    assert trajs[-1].segments[0].teacher_logprobs is None  # not routed: not scored
    for traj in trajs[:4]:
        assert_scored_by(traj, paths[traj.metadata["teacher"]])
    assert by_id.metadata["teacher"] == "t0"
    assert_scored_by(by_id, teachers[0])
    # the two teachers really differ, so the check above tells them apart
    seg = trajs[1].segments[0]
    assert forward_logprobs(teachers[0], seg.token_ids) != pytest.approx(seg.teacher_logprobs)


def open_engines() -> int:
    """Local engines alive in this process (each runs one engine thread while open)."""
    return sum(t.name == "loongsage-engine" and t.is_alive() for t in threading.enumerate())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Samples open engines and resident memory every millisecond in a thread."""

    def __init__(self) -> None:
        self.max_engines = 0
        self.max_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_engines = max(self.max_engines, open_engines())
            self.max_rss = max(self.max_rss, rss())
            time.sleep(0.001)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def big_teachers(tmp_path_factory, tiny_model_path):
    """Three ~50 MB teachers: big enough for RSS to tell one resident from three."""
    root = tmp_path_factory.mktemp("big")
    return [
        make_teacher(tiny_model_path, root / f"b{i}", seed=10 + i, hidden=256) for i in range(3)
    ]


async def peak_rss_of(coroutine) -> tuple[int, int]:
    """(peak RSS - RSS before, most local engines open at once) while `coroutine` runs. The
    heap is trimmed first: free pages left by earlier tests would otherwise take some of the
    load unseen, in one measurement and not in another."""
    release_freed_memory()
    baseline, before = rss(), open_engines()
    with Sampler() as sampler:
        await coroutine
    assert open_engines() == before  # everything it opened is closed again
    return sampler.max_rss - baseline, sampler.max_engines - before


def measure_budget(teachers: list) -> dict:
    """One teacher's peak RSS (the reference) and a budget of one teacher over three (the
    mixed run), in the process that calls it. Run in a fresh process: the heap of one that ran
    other tests first holds their freed pages and fragments, which took a varying part of
    either load unseen (in one clean-clone CI run the mixed peak was 1.5x a teacher's weights
    over the reference, with nothing but one teacher open at a time)."""
    size = weight_bytes(teachers[0], "float32")
    budget = int(1.9 * size)  # one teacher fits, two do not
    cfg, paths = distill(teachers, memory_budget=str(budget), linger_s=0.05,
                         max_batch_sequences=4)  # fmt: skip

    def waves(tags: list[str]) -> list[list[Trajectory]]:
        """Four waves of six rollouts; the same token shapes whatever the tags."""
        rng = random.Random(2)
        trajs = [trajectory(rng, tag) for tag in tags]
        return [trajs[w * 6 : w * 6 + 6] for w in range(4)]

    async def score(batches: list[list[Trajectory]]) -> dict[str, float]:
        async with TeacherManager(cfg, paths) as manager:
            for wave in batches:  # rollouts finish in waves
                await asyncio.gather(*(manager.score(t) for t in wave))
            return manager.metrics()

    async def main() -> dict:
        await score(waves(["env0"] * 24))  # warm-up: imports, allocator arenas
        # the reference: one teacher doing the same work (weights, the mapped safetensors file
        # while loading, the activations of the same batches)
        one_rss, _ = await peak_rss_of(score(waves(["env0"] * 24)))
        mixed = waves([f"env{i % 3}" for i in range(24)])  # every wave needs all three teachers
        task = asyncio.ensure_future(score(mixed))
        peak, engines = await peak_rss_of(task)
        for traj in mixed[0]:
            assert_scored_by(traj, paths[traj.metadata["teacher"]])
        return dict(size=size, budget=budget, one_rss=one_rss, peak=peak, engines=engines,
                    metrics=task.result())  # fmt: skip

    return asyncio.run(main())


def test_the_budget_is_never_exceeded_measured(big_teachers):
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as fresh:
        m = fresh.submit(measure_budget, big_teachers).result()
    assert m["engines"] == 1  # never two teachers loaded at once
    assert m["metrics"]["teachers/resident_bytes_max"] <= m["budget"]
    assert m["metrics"]["teachers/swaps"] >= 3
    # measured: a second teacher in memory would add at least its weights (`size`; ~1.7x with
    # its tokenizer); swapping itself costs up to ~0.6x here (heap glibc keeps after a swap-out)
    over, size = m["peak"] - m["one_rss"], m["size"]
    assert over < size, (over / size, m["one_rss"] / size)


async def test_without_a_budget_every_teacher_stays_resident(teachers):
    cfg, paths = distill(teachers)
    rng = random.Random(3)
    async with TeacherManager(cfg, paths) as manager:
        for _ in range(2):
            await asyncio.gather(*(manager.score(trajectory(rng, f"env{i}")) for i in range(3)))
        assert sorted(manager.resident()) == ["t0", "t1", "t2"]
        metrics = manager.metrics()
    assert metrics["teachers/swaps"] == 0
    assert metrics["teachers/resident_bytes_max"] == 3 * weight_bytes(teachers[0], "float32")
    for name in ("t0", "t1", "t2"):
        assert metrics[f"teachers/{name}/tokens_per_s"] > 0
        assert metrics[f"teachers/{name}/latency_s"] > 0


async def test_swaps_evict_the_least_recently_used_teacher(teachers):
    size = weight_bytes(teachers[0], "float32")
    cfg, paths = distill(teachers, memory_budget=str(2 * size), linger_s=0)
    rng = random.Random(4)
    async with TeacherManager(cfg, paths) as manager:
        await manager.score(trajectory(rng, "env0"))
        await manager.score(trajectory(rng, "env1"))
        await manager.score(trajectory(rng, "env0"))  # t1 is now the least recently used
        await manager.score(trajectory(rng, "env2"))
        assert sorted(manager.resident()) == ["t0", "t2"]
        assert manager.metrics()["teachers/swaps"] == 0  # every teacher loaded once so far
        await manager.score(trajectory(rng, "env1"))  # evicts t0 (used before t2)
        assert sorted(manager.resident()) == ["t1", "t2"]
        assert manager.metrics()["teachers/swaps"] == 1


async def test_requests_for_a_swapped_out_teacher_are_batched(teachers):
    size = weight_bytes(teachers[0], "float32")
    cfg, paths = distill(teachers[:2], memory_budget=str(size), linger_s=0.5)
    rng = random.Random(5)
    async with TeacherManager(cfg, paths) as manager:
        await manager.score(trajectory(rng, "env0"))
        # 8 requests each for t1 and t0 arrive interleaved: lingering makes them 2 swaps, not 16
        await asyncio.gather(*(manager.score(trajectory(rng, f"env{i % 2}")) for i in range(16)))
        assert manager.metrics()["teachers/swaps"] <= 2


async def test_a_teacher_with_uniform_logprobs_is_an_error_naming_it(tiny_model_path, tmp_path):
    broken = make_teacher(tiny_model_path, tmp_path / "zero", seed=0, zero=True)
    cfg, paths = distill([broken])
    async with TeacherManager(cfg, paths) as manager:
        with pytest.raises(TeacherError, match=r"teacher 't0' returns uniform logprobs"):
            await manager.score(trajectory(random.Random(6), "env0"))
        with pytest.raises(TeacherError, match="'t0'"):  # and it stays failed
            await manager.score(trajectory(random.Random(7), "env0"))


def test_uniformity_check():
    check_not_uniform("t", [-0.01] * 20)  # a confident teacher is not uniform
    check_not_uniform("t", [-10.8] * 5)  # too few tokens to tell
    check_not_uniform("t", [-10.8, -3.2] * 10)
    with pytest.raises(TeacherError, match=r"log\(1/49152\)"):
        check_not_uniform("t", [-math.log(49152)] * 10)


async def test_a_teacher_that_fails_to_load_is_an_error_naming_it(teachers, tmp_path):
    gone = shutil.copytree(teachers[1], tmp_path / "gone")
    cfg, paths = distill([teachers[0], gone], memory_budget=str(weight_bytes(gone, "float32")),
                         linger_s=0)  # fmt: skip
    rng = random.Random(8)
    async with TeacherManager(cfg, paths) as manager:
        await manager.score(trajectory(rng, "env1"))
        await manager.score(trajectory(rng, "env0"))  # swaps t1 out; t1 now lives on disk only
        (gone / "model.safetensors").write_bytes(b"truncated")
        with pytest.raises(TeacherError, match=rf"teacher 't1' failed to load \({gone}\)"):
            await manager.score(trajectory(rng, "env1"))
        with pytest.raises(TeacherError, match="'t1'"):  # every teacher stops with it
            await manager.score(trajectory(rng, "env0"))


def test_bytes_and_config_errors(teachers):
    assert parse_bytes("x", "1.5GiB") == int(1.5 * 2**30) and parse_bytes("x", 600) == 600
    assert parse_bytes("x", "600MB") == 600_000_000
    with pytest.raises(ValueError, match="memory_budget: '6 parsecs' is not a size"):
        DistillConfig(memory_budget="6 parsecs")
    with pytest.raises(
        ValueError, match=r"route.calc: 'calcc' is not a teacher \(teachers: calc\)"
    ):
        DistillConfig(teachers={"calc": TeacherConfig(model="tiny")}, route={"calc": "calcc"})
    with pytest.raises(ValueError, match="exactly one of model"):
        TeacherConfig()
    cfg, paths = distill(teachers[:1], memory_budget="1MB")
    with pytest.raises(TeacherError, match="teacher 't0' needs 12879104 bytes, more than"):
        TeacherManager(cfg, paths)


def sglang_distill(urls: list[str], budget: str) -> tuple[DistillConfig, dict]:
    """One SGLang teacher per fake server, each said to hold 1 GB."""
    teachers = {
        f"s{i}": TeacherConfig(
            model="fake/tiny-random",
            engine=EngineConfig(kind="sglang", urls=[url]),
            memory_bytes="1GB",
        )
        for i, url in enumerate(urls)
    }
    route = {f"env{i}": f"s{i}" for i in range(len(urls))}
    cfg = DistillConfig(teachers=teachers, route=route, memory_budget=budget, linger_s=0)
    return cfg, dict.fromkeys(teachers)


def fake_logprobs(ids: list[int]) -> list[float]:
    """The fake server's model: log p(ids[i] | ids[:i]) for i >= 1."""
    out, h = [0.0], step(0, ids[0])
    for t in ids[1:]:
        out.append(token_logprob(h, t))
        h = step(h, t)
    return out


def holding_weights(urls: list[str]) -> list[str]:
    """The servers whose weights are not released, as they report it."""
    infos = [httpx.get(url + "/get_server_info").json() for url in urls]
    return [u for u, i in zip(urls, infos, strict=True) if "weights" not in i["released_memory"]]


@pytest.fixture
def two_servers():
    with (
        serve_fake("--enable-weights-cpu-backup") as a,
        serve_fake("--enable-weights-cpu-backup") as b,
    ):
        yield [a, b]


async def test_sglang_teachers_release_and_resume_within_the_budget(two_servers):
    cfg, paths = sglang_distill(two_servers, budget="1.5GB")  # one of the two fits
    rng = random.Random(9)
    async with TeacherManager(cfg, paths) as manager:
        for i in [0, 1, 1, 0, 1]:
            traj = trajectory(rng, f"env{i}", turns=2)
            await manager.score(traj)
            assert holding_weights(two_servers) == [two_servers[i]]  # the other one released
            for seg in traj.segments:
                want = fake_logprobs(seg.token_ids)
                for got, lp, m in zip(seg.teacher_logprobs, want, seg.loss_mask, strict=True):
                    assert got == (pytest.approx(lp, abs=1e-9) if m else 0.0)
        metrics = manager.metrics()
    assert metrics["teachers/swaps"] == 2  # s1 -> s0 -> s1, after each one's first load
    assert metrics["teachers/resident_bytes_max"] == 10**9
    assert holding_weights(two_servers) == two_servers  # left as found: memory resumed


async def test_an_sglang_teacher_resumed_without_weight_backup_is_an_error():
    with serve_fake() as a, serve_fake() as b:  # no --enable-weights-cpu-backup
        cfg, paths = sglang_distill([a, b], budget="1.5GB")
        async with TeacherManager(cfg, paths) as manager:
            with pytest.raises(TeacherError, match=r"teacher 's0' returns uniform logprobs"):
                await manager.score(trajectory(random.Random(10), "env0"))


def test_the_reverse_kl_advantage_equals_a_hand_computation():
    sample = TrainSample(
        token_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 0, 1, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -2.0, -0.1],
        advantage=0.25,
        teacher_logprobs=[0.0, 0.0, -0.7, -1.0, -0.1],
    )
    unscored = TrainSample([1, 2], [0, 1], [0.0, -1.0], 0.25)
    add_distill_advantages([sample, unscored], coef=2.0)
    # per sampled token: 0.25 + 2 * -(logp_student - logp_teacher); untrained tokens 0
    want = [0.0, 0.0, 0.25 + 2 * -(-0.5 + 0.7), 0.25 + 2 * -(-2.0 + 1.0), 0.25 + 0.0]
    assert sample.advantage == pytest.approx(want, abs=1e-12)
    assert unscored.advantage == 0.25  # no teacher: the task advantage alone
    assert trajectory_advantages([[1.0, 0.0], [0.0]], "opd") == [[0.0, 0.0], [0.0]]


def distill_recipe(tmp_path, teachers: dict, route: dict) -> list[str]:
    """The tiny recipe on two Calc envs (tags `a`, `b`), distilled from `teachers` alone."""
    recipe = yaml.safe_load((RECIPE_DIR / "tiny.yaml").read_text())
    recipe["rollout"]["envs"] = {
        "a": {"env": "loongsage/Calc-v0", "env_kwargs": {"difficulty": 0}},
        "b": {"env": "loongsage/Calc-v0", "env_kwargs": {"difficulty": 1}},
    }
    recipe["algorithm"] = {"advantage": "opd", "distill": {"teachers": teachers, "route": route}}
    recipe["eval"]["n"] = 2
    (tmp_path / "opd.yaml").write_text(yaml.safe_dump(recipe))
    return [f"recipe={tmp_path / 'opd.yaml'}", "ray.enabled=false", f"run.dir={tmp_path / 'run'}"]


@pytest.mark.slow
async def test_a_distillation_run_routes_two_envs_to_their_teachers(tmp_path, teachers):
    size = weight_bytes(teachers[0], "float32")
    argv = distill_recipe(
        tmp_path,
        {"t0": {"model": str(teachers[0])}, "t1": {"model": str(teachers[1])}},
        {"a": "t0", "b": "t1"},
    )
    cfg = load([*argv, f"algorithm.distill.memory_budget={size}"])
    await train(cfg, run_dir=tmp_path / "run")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    for row in steps:
        assert row["distill/scored_frac"] == 1.0  # every sampled token had its teacher
        assert row["teachers/resident_bytes_max"] <= size
        # the train-inference gap metrics stay (values only where there are fresh tokens)
        assert row["mismatch/tokens"] + row["off_policy/tokens"] == row["train/tokens"]
    assert any("distill/reverse_kl/t0" in r for r in steps)
    assert any("distill/reverse_kl/t1" in r for r in steps)
    assert {"eval/a/success_rate", "eval/b/success_rate", "eval/success_rate"} <= set(rows[0])


@pytest.mark.parametrize("broken", [pytest.param("uniform", marks=pytest.mark.slow), "unloadable"])
async def test_a_broken_teacher_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_path, broken):
    if broken == "uniform":
        model = make_teacher(tiny_model_path, tmp_path / "zero", seed=0, zero=True)
    else:
        model = shutil.copytree(tiny_model_path, tmp_path / "gone")
        (model / "model.safetensors").write_bytes(b"truncated")
    argv = distill_recipe(tmp_path, {"bad": {"model": str(model), "memory_bytes": "1MB"}},
                          {"a": "bad", "b": "bad"})  # fmt: skip
    with pytest.raises(StopRun, match="teacher 'bad'") as stop:
        await train(load(argv), run_dir=tmp_path / "run")
    assert "resume with run.resume=auto" in str(stop.value)
    assert (tmp_path / "run" / "checkpoints" / "step_000000" / "trainer.pt").is_file()


def test_distillation_config_errors_name_the_key(tmp_path):
    argv = distill_recipe(tmp_path, {"t": {"model": "tiny"}}, {"a": "t", "b": "t"})
    assert load(argv).algorithm.distill.route == {"a": "t", "b": "t"}
    with pytest.raises(ConfigError, match=r"algorithm.distill.route.c: not an env tag or env id"):
        load([*argv, "algorithm.distill.route={a: t, b: t, c: t}"])
    with pytest.raises(ConfigError, match=r"advantage=opd: env 'b' has no teacher"):
        load([*argv, "algorithm.distill.route={a: t}"])
    with pytest.raises(ConfigError, match="advantage=opd learns from teachers alone"):
        load([*argv, "algorithm.distill.coef=0"])
    rl_alone = load([*argv, "algorithm.advantage=grpo", "algorithm.distill.coef=0"])
    assert rl_alone.algorithm.distill.coef == 0  # teachers measure only
    with pytest.raises(ConfigError, match="set either env"):
        load([*argv, "rollout.env=loongsage/ReasoningGym-v0"])


@pytest.mark.slow
def test_a_recipe_teacher_is_made_once_and_cached():
    argv = ["recipe=tiny", "run.steps=1", "ray.enabled=false", f"run.seed={time.time_ns()}"]
    try:
        path = made_teacher("t", argv)  # a child trainer.run; its final model, cached
        assert (path / "config.json").is_file() and path.name.startswith("teacher-t-")
        made = (path / "config.json").stat().st_mtime_ns
        assert made_teacher("t", argv) == path  # the same config: no second run
        assert made_teacher("t", [*argv, "logging.progress=false"]) == path  # shown otherwise
        assert (path / "config.json").stat().st_mtime_ns == made
        assert made_teacher("t", [*argv, "run.steps=2"]) != path  # another config: another one
    finally:
        for folder in loongsage_home().glob("models/teacher-t-*"):
            shutil.rmtree(folder, ignore_errors=True)
