"""`python -m trainer.run` end to end on the tiny model: the real gateway, engine, envs and trainer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from trainer.config import load
from trainer.run import train

REQUIRED = [
    "step", "time_s", "reward/mean", "eval/success_rate", "response/len_mean",
    "throughput/tokens_per_s", "time/generation_wait_s", "time/train_s", "time/weight_sync_s",
    "time/trainer_idle_frac", "staleness/mean", "staleness/max", "mismatch/logprob_abs_diff",
    "mismatch/k3_kl", "mismatch/ratio_max", "mismatch/clip_frac", "train/grad_norm", "train/lr",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("ray", [True, False])
async def test_two_step_run_writes_a_complete_run_dir(tmp_path, ray):
    cfg = load(["recipe=tiny", f"ray.enabled={ray}"])
    summary = await train(cfg, run_dir=tmp_path)
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
        # engine and trainer compute the same log-probs of the same tokens (fp32)
        assert row["mismatch/logprob_abs_diff"] < 1e-3
        assert row["staleness/max"] <= cfg.rollout.max_staleness
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
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_run_and_its_sandboxes_at_once(tmp_path, sig):
    """Agents that would run for minutes do not hold the run after Ctrl-C or SIGTERM (Ray's own
    SIGTERM handler exited from the loop and then waited for every sandbox thread)."""
    marker = "587.25"  # a unique `sleep` argument: its processes are this test's agents
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.run", "recipe=tiny", f"run.dir={tmp_path}",
         "agent.kind=command", f"agent.command=[sleep, '{marker}']",
         "agent.sandbox.kind=local", "ray.enabled=true"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
