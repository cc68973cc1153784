"""AgentFlow: one rollout = one gateway session = one Trajectory, for any kind of agent.

- `tool_loop` (white-box): `run_tool_episode` is the standard tool-calling loop. It steps a
  `ToolEnv` and calls the model through an OpenAI client pointed at the gateway (in-process over
  an ASGI transport, or over HTTP), so its tokens land in the session's token log exactly like
  any other agent's.
- `command` (black-box): an unmodified program runs in a fresh sandbox whose only way out is
  the gateway, with `OPENAI_BASE_URL` and a per-session `OPENAI_API_KEY`. It reads its task
  from `task.txt` and the env's instructions (the env's system prompt: what a final answer must
  look like) from `instructions.txt` (also argv placeholders `{task}` and `{instructions}`), and
  leaves its final answer in `answer.txt`; the env's own verifier scores that answer (it is
  stepped as the env's final message). The two files are kept apart because where instructions
  go matters: SmolLM2 answers 23% of Calc L0 greedily with them as the system message, 6% with
  them pasted above the task in one user message.

Both end the same way: the reward is attached to the session, the session is closed, and its
Trajectory (status `ok` / `aborted` / `error` with a reason) is what the trainer sees. A failing
agent, a broken tool call or an over-long context is data, never an exception out of `rollout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the loongsage/ envs)
from envs import EnvError, find_spec
from envs.agent import Episode, run_tool_episode
from gateway.server import Gateway
from gateway.trajectory import Trajectory
from sandbox import run_once
from trainer.config import AgentConfig, RolloutConfig

log = logging.getLogger("loongsage.agentflow")


class AgentFlow:
    """Runs rollouts of `env_id` through `gateway` with the agent `cfg` describes."""

    def __init__(
        self,
        gateway: Gateway,
        rollout: RolloutConfig,
        agent: AgentConfig | None = None,
        *,
        gateway_socket: str | None = None,
    ) -> None:
        self.gateway = gateway
        self.rollout_cfg = rollout
        self.cfg = agent or AgentConfig()
        self.gateway_socket = gateway_socket
        if self.cfg.kind == "command" and gateway_socket is None:
            raise ValueError(
                "agent.kind=command needs the gateway's Unix socket to bind into the sandbox"
            )
        find_spec(rollout.env)  # an unknown env id fails here, with gymnasium's suggestion
        self._agent_files = {k: Path(v).read_bytes() for k, v in self.cfg.files.items()}

    async def rollout(
        self,
        prompt: Any,
        *,
        group_id: int = 0,
        sample_index: int = 0,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        temperature: float | None = None,
    ) -> Trajectory:
        """One episode of the env task drawn with `reset(seed=prompt)` (a GRPO group shares the
        prompt), sampled with seed `seed`, in a fresh session; returns its closed Trajectory.

        The session forces `temperature` (default: the rollout temperature, which the trainer
        scales its logits by) on every call, whatever temperature a black-box agent asks for."""
        r = self.rollout_cfg
        temperature = r.temperature if temperature is None else temperature
        meta = {
            "env": r.env,
            "task_seed": prompt,
            "group_id": group_id,
            "sample_index": sample_index,
        }
        session_id, api_key = self.gateway.create_session(
            meta, sampling={"temperature": temperature}
        )
        env = gym.make(r.env, **r.env_kwargs)
        try:
            if self.cfg.kind == "tool_loop":
                episode = await run_tool_episode(
                    self.gateway.openai_client(api_key, max_retries=8),
                    self.gateway.model_name,
                    env,
                    seed=prompt,
                    options=options,
                    max_turns=r.max_turns,
                    temperature=temperature,
                    max_tokens=r.max_tokens,
                    sample_seed=seed,
                )
            else:
                episode = await self._run_command(env, api_key, prompt, options)
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
        api_key: str,
        seed: int | None,
        options: dict[str, Any] | None,
    ) -> Episode:
        task, info = await asyncio.to_thread(env.reset, seed=seed, options=options)
        instructions = info.get("system", "")
        files: dict[str, str | bytes] = {
            **self._agent_files,
            "task.txt": task,
            "instructions.txt": instructions,
        }
        sb_cfg = dataclasses.replace(self.cfg.sandbox, gateway_socket=self.gateway_socket)
        command = [
            part.replace("{task}", task).replace("{instructions}", instructions)
            for part in self.cfg.command
        ]

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
