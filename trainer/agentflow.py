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

Several envs (`rollout.envs`, by tag): group g plays the env at position g of a smooth weighted
round-robin over the tags (weights 2:1 give a, b, a, a, b, a, ...), so every batch holds the mix
in proportion and a resumed run gives each group the same env again. Every trajectory's
metadata carries `env` (the id) and `env_tag` (the tag; the id for a single env), by which the
Teacher Manager routes it and evaluation reports per env.
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
        self.envs = rollout.mix()
        for spec in self.envs.values():
            find_spec(spec.env)  # an unknown env id fails here, with gymnasium's suggestion
        self.turns = _round_robin({tag: spec.weight for tag, spec in self.envs.items()})
        self.agent = AGENTS.build(self.cfg.kind, self.cfg, rollout, gateway_socket=gateway_socket)

    @staticmethod
    def check(rollout: RolloutConfig, agent: AgentConfig) -> None:
        """Fail before a run loads anything: an unknown env id (gymnasium's error, with its
        suggestion) or an agent that cannot run here (ConfigError)."""
        for spec in rollout.mix().values():
            find_spec(spec.env)
        AGENTS.load(agent.kind).preflight(agent)

    def tag_of(self, group_id: int) -> str:
        """The env tag group `group_id` plays."""
        return self.turns[group_id % len(self.turns)]

    def make_env(self, tag: str | None = None) -> gym.Env:
        """The env of `tag` (default: the first, or only, env)."""
        spec = self.envs[tag if tag is not None else next(iter(self.envs))]
        return gym.make(spec.env, **spec.env_kwargs)

    async def rollout(
        self,
        prompt: Any,
        *,
        group_id: int = 0,
        sample_index: int = 0,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        temperature: float | None = None,
        tag: str | None = None,
        max_tokens: int | None = None,
    ) -> Trajectory:
        """One episode of the env task drawn with `reset(seed=prompt, options=options)` (a GRPO
        group shares the prompt), sampled with seed `seed`, in a fresh session; returns its
        closed Trajectory. The env is `tag`'s (default: the one group `group_id` plays). The
        session forces `temperature` (default: the rollout temperature, which the trainer
        scales its logits by) on every call, and caps each call at `max_tokens` (default
        `rollout.max_tokens`)."""
        r = self.rollout_cfg
        temperature = r.temperature if temperature is None else temperature
        max_tokens = r.max_tokens if max_tokens is None else max_tokens
        tag = self.tag_of(group_id) if tag is None else tag
        meta = {
            "agent": self.cfg.kind,
            "env": self.envs[tag].env,
            "env_tag": tag,
            "task_seed": prompt,
            "group_id": group_id,
            "sample_index": sample_index,
        }
        session_id, api_key = self.gateway.create_session(
            meta, sampling={"temperature": temperature, "max_tokens": max_tokens}
        )
        session = Session(self.gateway, session_id, api_key, temperature)
        env = self.make_env(tag)
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


def _round_robin(weights: dict[str, int]) -> list[str]:
    """One cycle of smooth weighted round-robin: each tag `weight` times, spread out."""
    current = dict.fromkeys(weights, 0)
    cycle = []
    for _ in range(sum(weights.values())):
        for tag, weight in weights.items():
            current[tag] += weight
        best = max(current, key=current.get)
        current[best] -= sum(weights.values())
        cycle.append(best)
    return cycle


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(info, default=str))
