"""AgentFlow: one rollout = one gateway session = one Trajectory, for any kind of agent.

- white-box: `run_tool_episode` is the standard tool-calling loop. It steps a `ToolEnv` and
  calls the model through an OpenAI client pointed at the gateway (in-process over an ASGI
  transport, or over HTTP), so its tokens land in the same session token log as any other agent.
- black-box: an unmodified program runs in a sandbox with `OPENAI_BASE_URL`/`OPENAI_API_KEY` of
  a fresh session, and the env's verifier scores what it left behind.

Both end the same way: the reward is attached to the session, the session is closed and its
Trajectory (status `ok` / `aborted` / `error` with a reason) is what the trainer sees. A failing
agent, a broken tool call or an over-long context is data, never an exception out of a rollout.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import openai


@dataclass
class Episode:
    """What a white-box episode produced, before the gateway's token log is attached."""

    reward: float = 0.0
    status: str = "ok"
    reason: str = ""
    turns: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)


async def run_tool_episode(
    client: openai.AsyncOpenAI,
    model: str,
    env: gym.Env,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    max_turns: int = 8,
    temperature: float = 1.0,
    max_tokens: int = 256,
) -> Episode:
    """Run one episode of `env` with the model behind `client`.

    The env contract (envs/base.py): `reset` gives the task text and `info["tools"]`,
    `info["system"]`; `step` takes the assistant message as JSON and returns tool results in
    `info["tool_messages"]`, or terminates with the reward on a final answer.
    """
    obs, info = await asyncio.to_thread(env.reset, seed=seed, options=options)
    messages: list[dict[str, Any]] = []
    if info.get("system"):
        messages.append({"role": "system", "content": info["system"]})
    messages.append({"role": "user", "content": obs})
    tools = info.get("tools") or None
    episode = Episode(messages=messages)
    for _ in range(max_turns):
        try:
            response = await client.chat.completions.create(
                model=model,
                messages=messages,
                tools=tools,
                temperature=temperature,
                max_tokens=max_tokens,
            )
        except openai.BadRequestError as e:
            # The history outgrew the context window: the episode ends here, scored as it is.
            episode.reason = f"context: {_error_message(e)}"
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
                episode.reason = "env truncated the episode"
            return episode
        tool_messages = info.get("tool_messages")
        messages.extend(tool_messages or [{"role": "user", "content": obs}])
    episode.reason = f"max_turns={max_turns} reached without a final answer"
    return episode


def _error_message(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    return str(body.get("message") or e.message)
