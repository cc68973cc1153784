"""`agent.kind=tool_loop`: the white-box agent. `envs.agent.run_tool_episode` (the standard
tool-calling loop) steps the `ToolEnv` and calls the model through an OpenAI client reaching the
gateway in-process (an ASGI transport, no socket), so its tokens land in the session's token log
exactly like any other agent's."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from envs.agent import Episode, run_tool_episode
from trainer.agents import Agent, Session
from trainer.config import AgentConfig, RolloutConfig


class ToolLoopAgent(Agent):
    def __init__(
        self, cfg: AgentConfig, rollout: RolloutConfig, *, gateway_socket: str | None = None
    ) -> None:
        self.rollout = rollout

    async def play(
        self,
        env: gym.Env,
        session: Session,
        *,
        task_seed: int | None,
        options: dict[str, Any] | None,
        sample_seed: int | None,
    ) -> Episode:
        return await run_tool_episode(
            session.gateway.openai_client(session.api_key, max_retries=8),
            session.gateway.model_name,
            env,
            seed=task_seed,
            options=options,
            max_turns=self.rollout.max_turns,
            temperature=session.temperature,
            max_tokens=self.rollout.max_tokens,
            sample_seed=sample_seed,
        )
