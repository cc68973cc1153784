"""AgentFlow rollouts end to end: the real local engine (tiny model) behind an in-process gateway."""

from __future__ import annotations

import gymnasium as gym
import pytest

from envs import EnvError, calc
from gateway.engines.local import LocalEngine
from gateway.server import Gateway, GatewayConfig
from sandbox import SandboxConfig
from trainer.agentflow import AgentFlow, gateway_socket
from trainer.config import AgentConfig, EvalConfig, RolloutConfig
from trainer.eval import FlowEvaluator, evaluate


@pytest.fixture
async def gateway(tiny_model_path):
    engine = LocalEngine(tiny_model_path, max_batch_size=8)
    gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"))
    yield gw
    await gw.aclose()
    await engine.close()


def assert_token_exact(traj):
    assert traj.turns and len(traj.segments) == 1 and traj.forks == 0
    seg = traj.segments[0]
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert sampled == [t for turn in traj.turns for t in turn.output_ids]


async def test_white_box_rollout_is_one_token_exact_trajectory(gateway):
    rollout = RolloutConfig(env_kwargs={"difficulty": 0}, max_tokens=16)
    traj = await AgentFlow(gateway, rollout).rollout(3, group_id=7, sample_index=1, seed=11)
    assert traj.status == "ok", traj.reason
    assert traj.reward == 0.0  # random weights never answer right
    assert traj.metadata["group_id"] == 7 and traj.metadata["task_seed"] == 3
    assert traj.info["turns"] == len(traj.turns) >= 1
    assert_token_exact(traj)
    assert all(v == gateway.weight_version for t in traj.turns for v in t.output_versions)


class BrokenEnv(gym.Env):
    def reset(self, *, seed=None, options=None):
        raise EnvError("the sandbox of this env could not start")


async def test_env_failure_is_an_error_trajectory_not_a_crash(gateway):
    gym.register("test/Broken-v0", entry_point=BrokenEnv, disable_env_checker=True)
    traj = await AgentFlow(gateway, RolloutConfig(env="test/Broken-v0")).rollout(0)
    assert traj.status == "error" and "could not start" in traj.reason
    assert traj.reward == 0.0 and traj.turns == []


def test_bad_agent_configs_are_clear_errors(gateway):
    with pytest.raises(ValueError, match="command: kind=command needs"):
        AgentConfig(kind="command")
    with pytest.raises(ValueError, match="files: 'nope.py'"):
        AgentConfig(kind="command", command=["true"], files={"a.py": "nope.py"})
    with pytest.raises(ValueError, match="Unix socket"):
        AgentFlow(gateway, RolloutConfig(), AgentConfig(kind="command", command=["true"]))
    with pytest.raises(gym.error.Error, match="Did you mean"):
        AgentFlow(gateway, RolloutConfig(env="loongsage/Calk-v0"))


async def black_box_rollout(gateway, tmp_path, seed: int, **agent):
    """One `agent.kind=command` rollout in a local sandbox wired to `gateway` over a Unix socket."""
    sock = str(tmp_path / "gw.sock")
    server = await gateway.start_http(port=0, uds=sock)
    try:
        cfg = AgentConfig(kind="command", sandbox=SandboxConfig(kind="local"), **agent)
        return await AgentFlow(gateway, RolloutConfig(), cfg, gateway_socket=sock).rollout(seed)
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("command", "status", "reason"),
    [
        (["python3", "-c", "open('answer.txt', 'w').write('Answer: 0')"], "ok", ""),
        (["python3", "-c", "import sys; sys.exit(3)"], "aborted", "error"),
        (["python3", "-c", "import time; time.sleep(60)"], "aborted", "timeout"),
        (["python3", "-c", "print('no answer')"], "aborted", "no answer.txt"),
    ],
)
async def test_black_box_rollout_outcomes(gateway, tmp_path, command, status, reason):
    traj = await black_box_rollout(gateway, tmp_path, 1, command=command, timeout_s=5)
    assert traj.status == status and reason in traj.reason
    assert traj.reward in (0.0, 1.0)


async def test_black_box_agent_gets_the_task_and_the_envs_instructions(gateway, tmp_path):
    """task.txt holds the task, instructions.txt the env's system prompt; argv gets both too."""
    script = (
        "import pathlib, sys; t = pathlib.Path('task.txt').read_text();"
        " i = pathlib.Path('instructions.txt').read_text();"
        " assert sys.argv[1:] == [t, i], sys.argv; print(t); print('|' + i)"
    )
    script += "; open('answer.txt', 'w').write('Answer: x')"
    command = ["python3", "-c", script, "{task}", "{instructions}"]
    traj = await black_box_rollout(gateway, tmp_path, 1, command=command, timeout_s=10)
    assert traj.status == "ok", (traj.reason, traj.info)
    task, instructions = traj.info["stdout_tail"].split("\n|")
    assert task.startswith(tuple(calc._NAMES)) and "How many" in task
    assert "Answer: <number>" in task and "Answer: <number>" in instructions
    assert not instructions.startswith(task[:20]), "the task is not repeated in the instructions"


async def test_unmodified_openai_agent_in_a_sandbox_is_trained_on(gateway, tmp_path):
    """The example agent knows nothing of LoongSage; its calls land in its session's token log."""
    import sys

    files = {"agent.py": "examples/agents/openai_tool_agent.py"}
    command = [sys.executable, "agent.py"]
    traj = await black_box_rollout(
        gateway, tmp_path, 2, command=command, files=files, timeout_s=120
    )
    assert traj.status == "ok", (traj.reason, traj.info)
    assert traj.turns, "the agent's model calls must be in its trajectory"
    for seg in traj.segments:
        assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.versions)


async def test_evaluate_plays_the_eval_split(gateway):
    rollout = RolloutConfig(env="loongsage/Calc-v0", max_tokens=8, max_turns=6)
    result = await evaluate(AgentFlow(gateway, rollout), n=3)
    assert result.n == 3 and result.errors == 0
    assert result.success_rate == 0.0 and result.mean_turns == 1.0
    assert 0 < result.mean_tokens <= 8
    assert gateway.sessions.num_open == 0
    # a run's evaluation may cap replies differently from its rollouts (`eval.max_tokens`)
    capped = await FlowEvaluator(
        AgentFlow(gateway, rollout), EvalConfig(n=3, max_tokens=3)
    ).evaluate(0)
    assert capped["eval/mean_tokens"] <= 3 * capped["eval/mean_turns"]
    traj = await AgentFlow(gateway, rollout).rollout(
        None, options={"split": "eval", "index": 0}, max_tokens=3
    )
    assert traj.turns and all(t.max_tokens == 3 and len(t.output_ids) <= 3 for t in traj.turns)


SAMPLING_AGENT = """
import os, sys
from openai import OpenAI
client = OpenAI()
model = client.models.list().data[0].id
outs = [
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": open("task.txt").read()}],
        temperature=1.9, seed=seed, max_tokens=12,
    ).choices[0].message.content
    for seed in (1, 2)
]
print(outs[0] == outs[1])
open("answer.txt", "w").write("Answer: 0")
"""


async def test_black_box_evaluation_forces_the_eval_sampling_and_reports_the_same_metrics(
    gateway, tmp_path
):
    """Evaluation of a `command` agent takes the training path: the session forces the eval
    temperature (greedy) whatever the agent asks, and the metric set is the tool loop's."""
    import sys

    (tmp_path / "agent.py").write_text(SAMPLING_AGENT)
    cfg = AgentConfig(
        kind="command",
        command=[sys.executable, "agent.py"],
        files={"agent.py": str(tmp_path / "agent.py")},
        sandbox=SandboxConfig(kind="local"),
        timeout_s=120,
    )
    async with gateway_socket(gateway) as socket:
        flow = AgentFlow(gateway, RolloutConfig(max_tokens=12), cfg, gateway_socket=socket)
        options = {"split": "eval", "index": 0}
        traj = await flow.rollout(None, options=options, temperature=0.0)
        assert traj.status == "ok", (traj.reason, traj.info)
        assert traj.info["stdout_tail"].strip() == "True"  # greedy, whatever the agent asked
        result = await evaluate(flow, n=2)
    white_box = await evaluate(AgentFlow(gateway, RolloutConfig(max_tokens=8)), n=2)
    assert set(result.metrics()) == set(white_box.metrics()) == {
        "eval/success_rate", "eval/mean_reward", "eval/mean_turns", "eval/mean_tokens",
        "eval/aborted_frac",
    }  # fmt: skip
    assert result.n == 2 and result.aborted_frac == 0.0 and result.mean_turns == 2.0
    assert 0 < result.mean_tokens <= 24
    assert gateway.sessions.num_open == 0


def test_eval_cli_rejects_bad_input():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "envs.eval", "env=loongsage/Calk-v0"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "Did you mean: `Calc`" in out.stderr


def test_module_prefixed_env_ids_are_found():
    from envs import find_spec

    assert find_spec("envs:loongsage/Calc-v0").id == "loongsage/Calc-v0"
    with pytest.raises(gym.error.Error, match="cannot import"):
        find_spec("no_such_pkg:x/Y-v0")


async def test_session_sampling_overrides_what_the_agent_asks(gateway):
    """Training forces the rollout temperature: an agent's own temperature/seed cannot change it."""
    sid, key = gateway.create_session(sampling={"temperature": 0.0})
    client = gateway.openai_client(key)
    outs = []
    for seed in (1, 2):
        r = await client.chat.completions.create(
            model=gateway.model_name,
            messages=[{"role": "user", "content": "hi"}],
            temperature=1.9,
            seed=seed,
            max_tokens=12,
        )
        outs.append(r.choices[0].message.content)
    assert outs[0] == outs[1]  # greedy, whatever was asked
    with pytest.raises(ValueError, match="temperature"):
        gateway.create_session(sampling={"temperature": -1})
    await gateway.close_session(sid)
