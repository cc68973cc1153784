"""AgentFlow: one rollout = one gateway session = one Trajectory, for any kind of agent.

`rollout` opens a session that forces the sampling temperature on every model call (so the
log-probs the trainer corrects against are the ones the tokens were sampled with, whatever an
agent asks for) and caps each call at `rollout.max_tokens` (black-box agents that send no
`max_tokens` would otherwise get the whole remaining context), makes the env, lets the agent kind that `agent.kind` names (trainer/agents/)
play one episode, attaches the reward, closes the session and returns its Trajectory (status
`ok` / `aborted` / `error` with a reason). A failing agent, a broken tool call or an over-long
context is data, never an exception out of `rollout`.

Training and evaluation take the same path: the controller's rollouts draw tasks with
`reset(seed=prompt)`, evaluation plays the env's held-out split with
`options={"split": "eval", "index": i}` (trainer/eval.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the loongsage/ envs)
from envs import EnvError, find_spec
from envs.agent import Episode
from gateway.server import Gateway
from gateway.trajectory import Trajectory
from trainer.agents import AGENTS, Session
from trainer.config import AgentConfig, RolloutConfig

log = logging.getLogger("loongsage.agentflow")


class AgentFlow:
    """Runs rollouts of `rollout.env` through `gateway` with the agent `agent` describes;
    `gateway_socket` is the gateway's Unix socket, for agents that run in sandboxes."""

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
        find_spec(rollout.env)  # an unknown env id fails here, with gymnasium's suggestion
        self.agent = AGENTS.build(self.cfg.kind, self.cfg, rollout, gateway_socket=gateway_socket)

    @staticmethod
    def check(env_id: str, agent: AgentConfig) -> None:
        """Fail before a run loads anything: an unknown env id (gymnasium's error, with its
        suggestion) or an agent that cannot run here (ConfigError)."""
        find_spec(env_id)
        AGENTS.load(agent.kind).preflight(agent)

    def make_env(self) -> gym.Env:
        return gym.make(self.rollout_cfg.env, **self.rollout_cfg.env_kwargs)

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
        """One episode of the env task drawn with `reset(seed=prompt, options=options)` (a GRPO
        group shares the prompt), sampled with seed `seed`, in a fresh session; returns its
        closed Trajectory. The session forces `temperature` (default: the rollout temperature,
        which the trainer scales its logits by) on every call, and caps each call at
        `rollout.max_tokens`."""
        r = self.rollout_cfg
        temperature = r.temperature if temperature is None else temperature
        meta = {
            "env": r.env,
            "task_seed": prompt,
            "group_id": group_id,
            "sample_index": sample_index,
        }
        session_id, api_key = self.gateway.create_session(
            meta, sampling={"temperature": temperature, "max_tokens": r.max_tokens}
        )
        session = Session(self.gateway, session_id, api_key, temperature)
        env = self.make_env()
        try:
            episode = await self.agent.play(
                env, session, task_seed=prompt, options=options, sample_seed=seed
            )
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


@contextlib.asynccontextmanager
async def gateway_socket(gateway: Gateway) -> AsyncIterator[str]:
    """Serve `gateway` on a Unix socket in a private temporary folder (a short path: sockets
    have a 108-byte limit) for as long as the context lasts; the socket's path. Sandboxed agents
    reach the gateway only through it."""
    with tempfile.TemporaryDirectory(prefix="loongsage-") as folder:
        path = str(Path(folder) / "gateway.sock")
        server = await gateway.start_http(port=0, uds=path)
        try:
            yield path
        finally:
            await server.stop()


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(info, default=str))
