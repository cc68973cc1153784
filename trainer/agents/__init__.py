"""Agent kinds: who plays one env episode inside a gateway session, chosen by `agent.kind`.

- `tool_loop` (trainer/agents/tool_loop.py): the white-box tool-calling loop of `envs.agent`,
  calling the model through the gateway's in-process OpenAI client;
- `command` (trainer/agents/command.py): an unmodified program in a fresh sandbox whose only
  way out is the gateway.

A kind is a class registered in `AGENTS` by a lazy entry point (`gateway/registry.py`), built
as `Kind(agent_cfg, rollout_cfg, gateway_socket=...)` by `AgentFlow`, which owns everything
around the episode (the session, its forced sampling, the env, the reward, the trajectory); a
new kind is a module and one `register` line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.registry import Registry

if TYPE_CHECKING:
    import gymnasium as gym

    from envs.agent import Episode
    from gateway.server import Gateway
    from trainer.config import AgentConfig


@dataclass
class Session:
    """One rollout's gateway session, as an agent sees it."""

    gateway: Gateway
    id: str
    api_key: str
    """The session's key: the only credential the agent's model calls need."""
    temperature: float
    """Forced on every call of the session; agents ask for it too."""


class Agent(Protocol):
    """The kinds here subclass it (so a type checker holds them to it, and a kind with nothing to
    check inherits `preflight`); a kind registered from elsewhere only needs the same methods."""

    @staticmethod
    def preflight(cfg: AgentConfig) -> None:
        """Raise a ConfigError, before a run loads anything, when this agent cannot run here;
        by default there is nothing to check."""

    async def play(
        self,
        env: gym.Env,
        session: Session,
        *,
        task_seed: int | None,
        options: dict[str, Any] | None,
        sample_seed: int | None,
    ) -> Episode:
        """One episode of `env`'s task `reset(seed=task_seed, options=options)`, calling the model
        in `session` (sampling seed `sample_seed`). Failures are returned as an aborted or error
        Episode with its reason where the agent can tell; an exception is recorded as an error."""
        ...


AGENTS: Registry[Agent] = Registry("agent.kind")
AGENTS.register("tool_loop", "trainer.agents.tool_loop:ToolLoopAgent")
AGENTS.register("command", "trainer.agents.command:CommandAgent")
