"""`agent.kind=command`: a black-box agent. An unmodified program runs in a fresh sandbox whose
only way out is the gateway (its Unix socket bound in), with `OPENAI_BASE_URL` and the session's
`OPENAI_API_KEY`.

It reads its task from `task.txt` and the env's instructions (the env's system prompt: what a
final answer must look like) from `instructions.txt` (also argv placeholders `{task}` and
`{instructions}`), and leaves its final answer in `answer.txt`; the env's own verifier scores
that answer (it is stepped as the env's final message). The two files are kept apart because
where instructions go matters: SmolLM2 answers 23% of Calc L0 greedily with them as the system
message, 6% with them pasted above the task in one user message. A sandbox that fails, times
out or hits a limit, and a program that leaves no answer, make an `aborted` episode with the
reason and the output tails.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import gymnasium as gym

from envs.agent import Episode
from gateway.config import ConfigError
from sandbox import Stopper, run_once, unavailable
from trainer.agents import Agent, Session
from trainer.config import AgentConfig, RolloutConfig


class CommandAgent(Agent):
    def __init__(
        self, cfg: AgentConfig, rollout: RolloutConfig, *, gateway_socket: str | None = None
    ) -> None:
        if gateway_socket is None:
            raise ValueError(
                "agent.kind=command needs the gateway's Unix socket to bind into the sandbox"
            )
        self.cfg = cfg
        self.sandbox = dataclasses.replace(cfg.sandbox, gateway_socket=gateway_socket)
        self.files = {k: Path(v).read_bytes() for k, v in cfg.files.items()}

    @staticmethod
    def preflight(cfg: AgentConfig) -> None:
        """A sandbox that cannot open here (no Docker engine, no image) fails the run at once,
        not with every rollout aborted."""
        if why := unavailable(cfg.sandbox):
            raise ConfigError(f"agent.sandbox.kind={cfg.sandbox.kind}: {why}")

    async def play(
        self,
        env: gym.Env,
        session: Session,
        *,
        task_seed: int | None,
        options: dict[str, Any] | None,
        sample_seed: int | None,
    ) -> Episode:
        task, info = await asyncio.to_thread(env.reset, seed=task_seed, options=options)
        instructions = info.get("system", "")
        files: dict[str, str | bytes] = {
            **self.files,
            "task.txt": task,
            "instructions.txt": instructions,
        }
        command = [
            part.replace("{task}", task).replace("{instructions}", instructions)
            for part in self.cfg.command
        ]
        stopper = Stopper()
        try:
            result, out = await asyncio.to_thread(
                run_once,
                self.sandbox,
                command,
                files,
                env={"OPENAI_API_KEY": session.api_key},
                collect=["answer.txt"],
                timeout_s=self.cfg.timeout_s,
                stopper=stopper,
            )
        except asyncio.CancelledError:
            # The run is shutting down: stop the sandbox now, or its thread holds the process
            # until the agent times out (asyncio.run waits for its worker threads).
            await asyncio.to_thread(stopper.stop)
            raise
        answer = out.get("answer.txt")
        logs = {"stdout_tail": result.stdout[-2000:], "stderr_tail": result.stderr[-2000:]}
        if not result.ok:
            return Episode(status="aborted", reason=f"{result.status}: {result.reason}", info=logs)
        if answer is None:
            return Episode(status="aborted", reason="the agent wrote no answer.txt", info=logs)
        _, reward, _, _, info = await asyncio.to_thread(env.step, answer.decode(errors="replace"))
        return Episode(reward=float(reward), info={**info, **logs})
