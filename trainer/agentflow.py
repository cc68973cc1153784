"""AgentFlow: one rollout = one gateway session = one Trajectory, for any kind of agent.

- `tool_loop` (white-box): `run_tool_episode` is the standard tool-calling loop. It steps a
  `ToolEnv` and calls the model through an OpenAI client pointed at the gateway (in-process over
  an ASGI transport, or over HTTP), so its tokens land in the session's token log exactly like
  any other agent's.
- `command` (black-box): an unmodified program runs in a fresh sandbox whose only way out is
  the gateway, with `OPENAI_BASE_URL` and a per-session `OPENAI_API_KEY`. It reads its task from
  `task.txt` (and argv `{task}` placeholders) and leaves its final answer in `answer.txt`; the
  env's own verifier scores that answer (it is stepped as the env's final message).

Both end the same way: the reward is attached to the session, the session is closed, and its
Trajectory (status `ok` / `aborted` / `error` with a reason) is what the trainer sees. A failing
agent, a broken tool call or an over-long context is data, never an exception out of `rollout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym

import envs  # noqa: F401  (registers the loongsage/ envs)
from envs import EnvError
from envs.agent import Episode, run_tool_episode
from gateway.server import Gateway
from gateway.trajectory import Trajectory
from sandbox import SandboxConfig, run_once

log = logging.getLogger("loongsage.agentflow")


@dataclass
class AgentConfig:
    kind: Literal["tool_loop", "command"] = "tool_loop"
    """`tool_loop`: the built-in white-box agent steps the env; `command`: a black-box program
    runs in a sandbox and the env's verifier scores its `answer.txt`."""
    max_turns: int = 6
    """Most model calls in one white-box episode."""
    temperature: float = 1.0
    """Sampling temperature of rollouts (the trainer scales its logits by the same value)."""
    max_tokens: int = 256
    """Most tokens per model call."""
    command: list[str] = field(default_factory=list)
    """Black-box: the command to run in the sandbox, e.g. [python3, agent.py]."""
    files: dict[str, str] = field(default_factory=dict)
    """Black-box: sandbox path -> host file to copy in (e.g. {agent.py: examples/agents/openai_tool_agent.py})."""
    timeout_s: float = 300.0
    """Black-box: wall-time limit of one agent run."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Black-box: the sandbox each rollout runs in (a fresh one per rollout)."""


class AgentFlow:
    """Runs rollouts of `env_id` through `gateway` with the agent `cfg` describes."""

    def __init__(
        self,
        gateway: Gateway,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        cfg: AgentConfig | None = None,
        *,
        gateway_socket: str | None = None,
    ) -> None:
        self.gateway = gateway
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.cfg = cfg or AgentConfig()
        self.gateway_socket = gateway_socket
        self._agent_files: dict[str, str | bytes] = {}
        for inside, host in self.cfg.files.items():
            if not Path(host).is_file():
                raise ValueError(f"agent.files: {host!r} (for {inside!r}) is not a file")
            self._agent_files[inside] = Path(host).read_bytes()
        if self.cfg.kind == "command" and not self.cfg.command:
            raise ValueError(
                "agent.command: kind=command needs the command to run, e.g. [python3, agent.py]"
            )
        if self.cfg.kind == "command" and gateway_socket is None:
            raise ValueError(
                "kind=command needs the gateway's Unix socket (gateway uds) to bind into the sandbox"
            )

    async def rollout(
        self,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Trajectory:
        """Run one episode in a fresh session and return its closed Trajectory."""
        meta = {"env_id": self.env_id, "seed": seed, **(options or {}), **(metadata or {})}
        session_id, api_key = self.gateway.create_session(meta)
        env = gym.make(self.env_id, **self.env_kwargs)
        try:
            if self.cfg.kind == "tool_loop":
                episode = await run_tool_episode(
                    self.gateway.openai_client(api_key, max_retries=8),
                    self.gateway.model_name,
                    env,
                    seed=seed,
                    options=options,
                    max_turns=self.cfg.max_turns,
                    temperature=self.cfg.temperature,
                    max_tokens=self.cfg.max_tokens,
                )
            else:
                episode = await self._run_command(env, session_id, api_key, seed, options)
        except EnvError as e:
            episode = Episode(status="error", reason=f"env failed: {e}")
        except Exception as e:  # a bug in an agent or env must not take the run down
            log.exception("rollout %s failed", session_id)
            episode = Episode(status="error", reason=f"{type(e).__name__}: {e}")
        finally:
            await asyncio.to_thread(env.close)
        self.gateway.attach_reward(
            session_id, episode.reward, {"turns": episode.turns, **_jsonable(episode.info)}
        )
        return await self.gateway.close_session(session_id, episode.status, episode.reason)

    async def _run_command(
        self,
        env: gym.Env,
        session_id: str,
        api_key: str,
        seed: int | None,
        options: dict[str, Any] | None,
    ) -> Episode:
        task, _ = await asyncio.to_thread(env.reset, seed=seed, options=options)
        files: dict[str, str | bytes] = {**self._agent_files, "task.txt": task}
        sb_cfg = dataclasses.replace(self.cfg.sandbox, gateway_socket=self.gateway_socket)
        command = [part.replace("{task}", task) for part in self.cfg.command]

        result, out = await asyncio.to_thread(
            run_once,
            sb_cfg,
            command,
            files,
            env={"OPENAI_API_KEY": api_key},
            collect=["answer.txt"],
            timeout_s=self.cfg.timeout_s,
        )
        answer = out.get("answer.txt")
        logs = {"stdout_tail": result.stdout[-2000:], "stderr_tail": result.stderr[-2000:]}
        if not result.ok:
            return Episode(status="aborted", reason=f"{result.status}: {result.reason}", info=logs)
        if answer is None:
            return Episode(status="aborted", reason="the agent wrote no answer.txt", info=logs)
        _, reward, _, _, info = await asyncio.to_thread(env.step, answer.decode(errors="replace"))
        return Episode(reward=float(reward), info={**info, **logs})


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(info, default=str))
