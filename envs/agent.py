"""The standard white-box agent: a tool-calling loop that plays one `ToolEnv` episode.

It talks to the model only through an OpenAI client, so pointed at the gateway (in-process over
an ASGI transport, or over HTTP) its tokens land in the session's token log like any other
agent's. It lives in `envs` because it is the env contract's reference client (it needs nothing
but an OpenAI client); the trainer runs it as the `tool_loop` agent kind
(trainer/agents/tool_loop.py), for training and evaluation alike. `Episode` is what every agent
kind returns.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium as gym
import openai


@dataclass
class Episode:
    """What an episode produced, before the gateway's token log is attached."""

    reward: float = 0.0
    status: Literal["ok", "aborted", "error"] = "ok"
    reason: str = ""
    turns: int = 0
    info: dict[str, Any] = field(default_factory=dict)


async def run_tool_episode(
    client: openai.AsyncOpenAI,
    model: str,
    env: gym.Env,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    max_turns: int = 6,
    temperature: float = 1.0,
    max_tokens: int = 256,
    sample_seed: int | None = None,
) -> Episode:
    """Run one episode of `env` with the model behind `client` (envs/base.py has the contract)."""
    obs, info = await asyncio.to_thread(env.reset, seed=seed, options=options)
    messages: list[dict[str, Any]] = []
    if info.get("system"):
        messages.append({"role": "system", "content": info["system"]})
    messages.append({"role": "user", "content": obs})
    tools = info.get("tools") or openai.NOT_GIVEN
    episode = Episode()
    for _ in range(max_turns):
        try:
            response = await client.chat.completions.create(
                model=model,
                messages=messages,
                tools=tools,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=openai.NOT_GIVEN if sample_seed is None else sample_seed + episode.turns,
            )
        except openai.BadRequestError as e:
            # Typically the history outgrew the context window: the episode ends, scored 0.
            episode.reason = f"stopped: {e.message}"
            return episode
        message = response.choices[0].message
        assistant = message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
        messages.append(assistant)
        episode.turns += 1
        obs, reward, terminated, truncated, info = await asyncio.to_thread(
            env.step, json.dumps(assistant)
        )
        episode.reward = float(reward)
        episode.info = {k: v for k, v in info.items() if k != "tool_messages"}
        if terminated or truncated:
            if truncated:
                episode.reason = f"truncated: {info.get('reason', '')}"
            return episode
        messages.extend(info.get("tool_messages") or [{"role": "user", "content": obs}])
    episode.reason = f"max_turns={max_turns} reached without a final answer"
    return episode
