"""Evaluate a model on an env's held-out eval split with the standard tool-calling agent.

    python -m envs.eval env=loongsage/Calc-v0 model=SmolLM2-135M-Instruct n=50

Runs each eval task (`reset(options={"split": "eval", "index": i})`) through `envs.agent`'s loop
against an in-process gateway (the local engine by default, or SGLang servers with
`engine.kind=sglang engine.urls=[...]`), and prints success rate, mean turns and mean tokens.
`evaluate` is the same function the trainer calls for `eval/success_rate`.
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

import envs  # noqa: F401  (registers the loongsage/ envs)
from envs import find_spec
from envs.agent import run_tool_episode
from gateway.config import parse_cli
from gateway.engines import EngineConfig
from gateway.server import Gateway, GatewayConfig


@dataclass
class EvalConfig:
    env: str = "loongsage/Calc-v0"
    """Registered env id."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `gymnasium.make`, e.g. {difficulty: 1}."""
    model: str = "SmolLM2-135M-Instruct"
    """Embedded model name or a Hugging Face folder."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The inference engine."""
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


@dataclass
class EvalResult:
    success_rate: float
    mean_reward: float
    mean_turns: float
    mean_tokens: float
    """Generated tokens per episode."""
    n: int
    errors: int
    """Episodes that ended in an error (counted as failures)."""

    def line(self) -> str:
        return (
            f"success_rate={self.success_rate:.3f}  mean_reward={self.mean_reward:.3f}  "
            f"mean_turns={self.mean_turns:.2f}  mean_tokens={self.mean_tokens:.1f}  "
            f"n={self.n}  errors={self.errors}"
        )


async def evaluate(
    gateway: Gateway,
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    n: int | None = None,
    temperature: float = 0.0,
    max_tokens: int = 256,
    max_turns: int = 6,
    concurrency: int = 16,
    progress: bool = False,
) -> EvalResult:
    """Play the first `n` eval tasks of `env_id`, each in its own gateway session."""
    probe = gym.make(env_id, **(env_kwargs or {}))
    size = len(probe.unwrapped.eval_tasks())
    probe.close()
    count = size if n is None else min(n, size)
    if count <= 0:
        raise ValueError(f"n must be >= 1 (the eval split of {env_id} has {size} tasks)")
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=count, desc=f"eval {env_id}", disable=not progress, file=sys.stderr)

    async def one(index: int) -> tuple[float, int, int, bool]:
        async with limit:
            env = gym.make(env_id, **(env_kwargs or {}))
            session_id, key = gateway.create_session({"eval": env_id, "index": index})
            error = False
            try:
                episode = await run_tool_episode(
                    gateway.openai_client(key, max_retries=8),
                    gateway.model_name,
                    env,
                    options={"split": "eval", "index": index},
                    max_turns=max_turns,
                    temperature=temperature,
                    max_tokens=max_tokens,
                )
                reward, turns = episode.reward, episode.turns
            except Exception:  # an env or agent failure is a failed task, not a failed eval
                reward, turns, error = 0.0, 0, True
            finally:
                env.close()
            traj = await gateway.close_session(session_id)
            bar.update(1)
            return reward, turns, traj.num_output_tokens, error

    try:
        results = await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        bar.close()
    rewards = [r for r, _, _, _ in results]
    return EvalResult(
        success_rate=sum(r >= 1.0 for r in rewards) / count,
        mean_reward=sum(rewards) / count,
        mean_turns=sum(t for _, t, _, _ in results) / count,
        mean_tokens=sum(k for _, _, k, _ in results) / count,
        n=count,
        errors=sum(e for _, _, _, e in results),
    )


async def _main(cfg: EvalConfig) -> EvalResult:
    gateway = Gateway.from_config(GatewayConfig(model=cfg.model, engine=cfg.engine, auth="keys"))
    try:
        return await evaluate(
            gateway,
            cfg.env,
            cfg.env_kwargs,
            n=cfg.n,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            max_turns=cfg.max_turns,
            concurrency=cfg.concurrency,
            progress=True,
        )
    finally:
        await gateway.aclose()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_cli(EvalConfig, sys.argv[1:] if argv is None else argv)
        find_spec(cfg.env)
    except (ValueError, gym.error.Error) as e:
        raise SystemExit(f"envs.eval: {e}") from None
    start = time.monotonic()
    result = asyncio.run(_main(cfg))
    print(f"{cfg.env} {json.dumps(cfg.env_kwargs)} model={cfg.model}")
    print(result.line() + f"  wall_s={time.monotonic() - start:.0f}")


if __name__ == "__main__":
    main()
