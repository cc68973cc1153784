"""`python -m trainer.run` end to end on the tiny model: the real gateway, engine, envs and trainer."""

from __future__ import annotations

import glob
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import ray as ray_lib

from trainer.config import load
from trainer.run import train

REQUIRED = [
    "step", "time_s", "reward/mean", "eval/success_rate", "response/len_mean",
    "throughput/tokens_per_s", "time/generation_wait_s", "time/train_s", "time/weight_sync_s",
    "time/trainer_idle_frac", "staleness/mean", "staleness/max", "mismatch/tokens",
    "off_policy/tokens", "train/grad_norm", "train/lr",
]  # fmt: skip


def test_a_stopped_run_does_not_wait_for_a_call_in_flight():
    """A blocking call in flight (here an hour's sleep standing for a train step on a loaded
    CPU) does not hold a run stopped by Ctrl-C: its executor neither waits for it at shutdown nor
    is joined at exit. With asyncio's default executor this test times out."""
    script = textwrap.dedent("""
        import asyncio, signal, time
        from trainer.run import DaemonThreads
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as trainer.run's main does
        def step():
            print("in flight", flush=True)
            time.sleep(3600)
        async def main():
            asyncio.get_running_loop().set_default_executor(DaemonThreads())
            await asyncio.to_thread(step)
        asyncio.run(main())
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        first = proc.stdout.readline()
        assert first == "in flight\n", first + proc.stdout.read()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)  # interpreter exit alone took >30 s under load
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("ray,replicas", [(True, 1), (False, 1), (True, 2)])
async def test_two_step_run_writes_a_complete_run_dir(tmp_path, capsys, ray, replicas):
    more = ["ray.num_cpus=4"] if replicas > 1 else []
    cfg = load(["recipe=tiny", f"ray.enabled={ray}", f"engine.replicas={replicas}", *more])
    boards = set(glob.glob("/dev/shm/loongsage-cores-*"))
    summary = await train(cfg, run_dir=tmp_path)
    assert not ray_lib.is_initialized()  # the Ray a run starts ends with it
    plan = capsys.readouterr().out
    # CPU lending on a local Ray (both ways with one engine); its board is gone afterwards
    lending = {(True, 1): "trainer and engine", (True, 2): "the trainer"}.get((ray, replicas))
    assert (f"cpu lending: {lending} compute" in plan) if lending else "cpu lending" not in plan
    assert set(glob.glob("/dev/shm/loongsage-cores-*")) == boards
    route = "shm" if ray else "in_process"
    plan = plan[plan.index("TransferMesh: weights from") :]
    assert plan.count(f" {route} ") == replicas
    assert summary.final_model == tmp_path / "final"
    assert (tmp_path / "final" / "config.json").is_file()
    assert (tmp_path / "final" / "tokenizer.json").is_file()
    assert (tmp_path / "config.yaml").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/success_rate" in rows[0]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        # engine (a Ray actor with ray=True), gateway, trajectory and trainer agree on the
        # log-probs of the tokens sampled with the weights being trained: fp32 on both sides
        assert row["mismatch/tokens"] + row["off_policy/tokens"] == row["train/tokens"]
        if row["mismatch/tokens"]:
            assert row["mismatch/logprob_abs_diff"] < 1e-5, row
        assert row["staleness/max"] <= cfg.rollout.max_staleness
        # every engine got every version, over the planned route
        assert row[f"weights/{route}/gb_per_s"] > 0 and row["weights/failed"] == 0
        assert all(row[f"weights/version/engine{i}"] == row["step"] for i in range(replicas))
        assert all(f"weights/stall_s/engine{i}" in row for i in range(replicas))
        assert ("perf/threads" in row) == ray
    assert steps[0]["mismatch/tokens"] == steps[0]["train/tokens"] > 0  # step 1: all fresh
    assert {p.name for p in (tmp_path / "plots").glob("*.png")} >= {"reward.png", "timeline.png"}
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["text"] for s in samples)


def test_cli_errors_are_one_clear_line():
    out = subprocess.run(
        [sys.executable, "-m", "trainer.run", "recipe=tiny", "rollout.max_stalenes=1"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "did you mean rollout.max_staleness" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "trainer.run", "recipe=quikstart"], capture_output=True, text=True
    )
    assert "did you mean recipe=quickstart" in out.stderr

    out = subprocess.run(
        [sys.executable, "-m", "trainer.run", "recipe=blackbox", "agent.sandbox.image=ls-no:1"],
        capture_output=True,
        text=True,
    )  # a missing image (or no Docker engine) stops the run before anything loads
    assert "agent.sandbox.kind=docker: no " in out.stderr and "Traceback" not in out.stderr


@pytest.mark.docker
async def test_black_box_agent_in_docker_trains(tmp_path):
    """recipes/blackbox.yaml's path on the tiny model: an unmodified agent per rollout in Docker."""
    from sandbox.image import docker_unavailable

    if why := docker_unavailable("loongsage-sandbox:latest"):
        pytest.skip(why)
    cfg = load(
        [
            "recipe=tiny",
            "run.steps=1",
            "eval.n=2",
            "agent.kind=command",
            "agent.command=[python3, agent.py]",
            "agent.files={agent.py: examples/agents/chat_agent.py}",
            "agent.sandbox.kind=docker",
        ]
    )
    summary = await train(cfg, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/aborted_frac"] == 0.0  # every agent ran and answered
    step = rows[1]
    assert step["rollout/aborted_samples"] == 0 and step["train/sequences"] >= 2
    assert summary.final_model is not None


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(1800)  # six mini-swe-agent runs in Docker: ~10 min on a loaded 2-core CI
async def test_the_mini_swe_agent_recipe_trains_a_step(tmp_path):
    """recipes/blackbox_mini_swe.yaml as written, on the tiny model: mini-swe-agent from PyPI,
    unmodified, per rollout in its derived image. The tiny model never writes a valid action, so
    mini ends by its own limits (an empty answer.txt: reward 0); what is checked is the path:
    no rollout aborted, every call capped at rollout.max_tokens (mini sends no max_tokens), and a
    train step on what came back, segments (forks) included."""
    from sandbox.image import docker_unavailable

    image = "loongsage-mini-swe-agent:latest"
    if why := docker_unavailable(image):
        pytest.skip(f"{why} (scripts/test_services.sh builds it)")
    cfg = load(
        [
            "recipe=blackbox_mini_swe",
            "model.name=tiny",
            "agent.sandbox.env.MSWEA_MODEL_NAME=openai/tiny-random",  # the tiny model's served name
            "run.steps=1",
            "eval.n=2",
            "rollout.batch_size=1",
            "rollout.num_samples_per_prompt=2",
            "rollout.max_tokens=24",
            "rollout.filter_zero_variance=false",  # all rewards are 0 with the tiny model
            "logging.progress=false",
        ]
    )
    summary = await train(cfg, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/aborted_frac"] == 0.0, summary.aborted
    step = rows[1]
    assert step["rollout/aborted_samples"] == 0, summary.aborted
    assert step["train/sequences"] >= 2
    # mini_swe_agent.yaml's step_limit (4 calls), each capped at 24 tokens by the session
    assert 0 < step["response/len_max"] <= 4 * 24 and "rollout/forks_max" in step
    assert summary.final_model is not None
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["status"] == "ok" for s in samples)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_run_and_its_sandboxes_at_once(tmp_path, sig):
    """Agents that would run for minutes do not hold the run after Ctrl-C or SIGTERM (Ray's own
    SIGTERM handler exited from the loop and then waited for every sandbox thread). The run is
    started as `cmd &` in a script starts it, with SIGINT ignored (both signals were then
    ignored: SIGTERM stops the run through SIGINT's handler)."""
    marker = "587.25"  # a unique `sleep` argument: its processes are this test's agents
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.run", "recipe=tiny", f"run.dir={tmp_path}",
         "agent.kind=command", f"agent.command=[sleep, '{marker}']",
         "agent.sandbox.kind=local", "ray.enabled=true"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip

    def agents() -> int:
        ps = subprocess.run(["pgrep", "-fc", f"sleep {marker}"], capture_output=True, text=True)
        return int(ps.stdout.strip() or 0)

    try:
        deadline = time.monotonic() + 240
        while agents() < 2:  # the step-0 evaluation's agents are running
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no agent started"
            time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - start < 60
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "interrupted; resume with run.resume=auto" in out, out[-3000:]
    assert agents() == 0
