"""Evaluation: rollouts on an env's held-out eval split through the same AgentFlow as training.

    python -m trainer.eval env=loongsage/Calc-v0 'env_kwargs={difficulty: 0}' n=48
    python -m trainer.eval agent.kind=command 'agent.command=[python3, agent.py]' \\
        'agent.files={agent.py: examples/agents/chat_agent.py}' agent.sandbox.kind=docker

Eval task i is `reset(options={"split": "eval", "index": i})`, played by any agent kind in its
own gateway session, which forces the eval temperature (greedy by default) on every call, as
training forces the rollout temperature. One metric set for every agent kind: `eval/success_rate`
(reward >= 1), `eval/mean_reward`, `eval/mean_turns` (model calls in the session),
`eval/mean_tokens` (generated tokens) and `eval/aborted_frac` (episodes that did not end `ok`,
scored 0). The trainer's periodic evaluation (`FlowEvaluator`) and this command are the same
`evaluate`. A run on several envs (`rollout.envs`) evaluates each env's split, `eval.n` tasks
each, as `eval/<tag>/success_rate` etc., and reports their mean under the plain names.

`python -m envs.eval` (the older name, same keys) hands its command line to this module: envs
import nothing of the trainer, and evaluation is trainer rollouts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from tqdm import tqdm

from gateway.config import parse_cli
from gateway.engines import EngineConfig
from gateway.server import Gateway, GatewayConfig
from gateway.trajectory import Trajectory
from trainer.agentflow import AgentFlow, gateway_socket
from trainer.config import AgentConfig, EvalConfig, RolloutConfig


@dataclass
class EvalResult:
    success_rate: float
    mean_reward: float
    mean_turns: float
    """Model calls per episode."""
    mean_tokens: float
    """Generated tokens per episode."""
    aborted_frac: float
    n: int
    errors: int
    """Episodes that did not end `ok` (aborted or error; scored 0)."""

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> EvalResult:
        n = len(trajectories)
        rewards = [t.reward or 0.0 for t in trajectories]
        errors = sum(t.status != "ok" for t in trajectories)
        return cls(
            success_rate=sum(r >= 1.0 for r in rewards) / n,
            mean_reward=sum(rewards) / n,
            mean_turns=sum(len(t.turns) for t in trajectories) / n,
            mean_tokens=sum(t.num_output_tokens for t in trajectories) / n,
            aborted_frac=errors / n,
            n=n,
            errors=errors,
        )

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        fields = ("success_rate", "mean_reward", "mean_turns", "mean_tokens", "aborted_frac")
        return {f"{prefix}/{name}": getattr(self, name) for name in fields}

    def line(self) -> str:
        return (
            f"success_rate={self.success_rate:.3f}  mean_reward={self.mean_reward:.3f}  "
            f"mean_turns={self.mean_turns:.2f}  mean_tokens={self.mean_tokens:.1f}  "
            f"n={self.n}  errors={self.errors}"
        )


async def evaluate(
    flow: AgentFlow,
    n: int | None = None,
    *,
    temperature: float = 0.0,
    concurrency: int = 16,
    progress: bool = False,
    tag: str | None = None,
    max_tokens: int | None = None,
) -> EvalResult:
    """Play the first `n` tasks of the eval split (None: all of them) of `tag`'s env (default:
    the first or only one) through `flow`, `max_tokens` a call (None: the flow's
    `rollout.max_tokens`)."""
    probe = flow.make_env(tag)
    size = len(probe.unwrapped.eval_tasks())
    probe.close()
    count = size if n is None else min(n, size)
    if count <= 0:
        raise ValueError(f"n must be >= 1 (the eval split of {probe.spec.id} has {size})")
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=count, desc="eval", disable=not progress, file=sys.stderr)

    async def one(index: int) -> Trajectory:
        async with limit:
            options = {"split": "eval", "index": index}
            traj = await flow.rollout(
                None, options=options, temperature=temperature, tag=tag, max_tokens=max_tokens
            )
            bar.update(1)
            return traj

    try:
        return EvalResult.of(list(await asyncio.gather(*(one(i) for i in range(count)))))
    finally:
        bar.close()


class FlowEvaluator:
    """The controller's Evaluator: `eval.n` eval tasks of each env through the run's AgentFlow."""

    def __init__(self, flow: AgentFlow, cfg: EvalConfig) -> None:
        self.flow = flow
        self.cfg = cfg

    async def evaluate(self, step: int) -> dict[str, float]:
        if self.cfg.n == 0:
            return {}
        results = {
            tag: await evaluate(
                self.flow,
                self.cfg.n,
                temperature=self.cfg.temperature,
                concurrency=self.cfg.concurrency,
                tag=tag,
                max_tokens=self.cfg.max_tokens,
            )
            for tag in self.flow.envs
        }
        if len(results) == 1:
            return next(iter(results.values())).metrics()
        out: dict[str, float] = {}
        for tag, result in results.items():
            out |= result.metrics(f"eval/{tag}")
        for key in next(iter(results.values())).metrics():
            out[key] = sum(r.metrics()[key] for r in results.values()) / len(results)
        return out


@dataclass
class EvalCommandConfig:
    env: str = "loongsage/Calc-v0"
    """Registered env id."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `gymnasium.make`, e.g. {difficulty: 1}."""
    model: str = "SmolLM2-135M-Instruct"
    """Embedded model name or a Hugging Face folder."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The inference engine."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent that plays the tasks (the white-box tool loop by default)."""
    n: int | None = None
    """How many eval tasks (the first n of the split); None = all of them."""
    temperature: float = 0.0
    """0 = greedy, the usual way to report a success rate."""
    max_tokens: int = 256
    """Most tokens per model call."""
    max_turns: int = 6
    """Most model calls per episode."""
    concurrency: int = 16
    """Episodes in flight at once (the engine batches them)."""

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise ValueError(f"n must be >= 1 or unset (all eval tasks), got {self.n}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def rollout(self) -> RolloutConfig:
        return RolloutConfig(
            env=self.env,
            env_kwargs=self.env_kwargs,
            max_tokens=self.max_tokens,
            max_turns=self.max_turns,
        )


async def _main(cfg: EvalCommandConfig) -> EvalResult:
    gateway = Gateway.from_config(GatewayConfig(model=cfg.model, engine=cfg.engine, auth="keys"))
    rollout = cfg.rollout()
    try:
        async with gateway_socket(gateway) as socket:
            flow = AgentFlow(gateway, rollout, cfg.agent, gateway_socket=socket)
            return await evaluate(
                flow,
                cfg.n,
                temperature=cfg.temperature,
                concurrency=cfg.concurrency,
                progress=True,
            )
    finally:
        await gateway.aclose()


def main(argv: list[str] | None = None, prog: str = "trainer.eval") -> None:
    try:
        cfg = parse_cli(EvalCommandConfig, sys.argv[1:] if argv is None else argv)
        AgentFlow.check(cfg.rollout(), cfg.agent)
    except (ValueError, gym.error.Error) as e:
        raise SystemExit(f"{prog}: {e}") from None
    start = time.monotonic()
    result = asyncio.run(_main(cfg))
    print(f"{cfg.env} {json.dumps(cfg.env_kwargs)} model={cfg.model} agent={cfg.agent.kind}")
    print(result.line() + f"  wall_s={time.monotonic() - start:.0f}")


if __name__ == "__main__":
    main()
