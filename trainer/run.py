"""`python -m trainer.run recipe=NAME [key.sub=value ...]`: the main job.

Builds the parts a recipe names and hands them to the controller:

    engine (Ray actor, or in-process)  <- gateway (in this process, per-rollout sessions)
         ^                                   ^
         | weight push after each step       | AgentFlow: white-box tool loop or sandboxed command
    train backend (Ray actor, or in-process) <- controller (admission, batches, train, push, eval)

`--help` lists every key with its help text; `recipe=quickstart` is the CPU default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from envs.eval import evaluate
from gateway.config import ConfigError
from gateway.engines import make_engine
from gateway.models import resolve_model
from gateway.server import Gateway, GatewayConfig
from sandbox.image import docker_unavailable
from trainer.agentflow import AgentFlow
from trainer.backends import make_backend
from trainer.buffer import PromptStream
from trainer.config import TrainerConfig, load
from trainer.controller import Controller, Summary
from trainer.weights import InProcessPush


class EnvEvaluator:
    """`eval/*` metrics: the env's held-out split, greedy by default, through the gateway, played
    by the recipe's own agent (the white-box loop, or the black-box command in its sandbox)."""

    def __init__(self, gateway: Gateway, cfg: TrainerConfig, flow: AgentFlow) -> None:
        self.gateway = gateway
        self.cfg = cfg
        self.flow = flow

    async def evaluate(self, step: int) -> dict[str, float]:
        if self.cfg.eval.n == 0:
            return {}
        if self.cfg.agent.kind == "command":
            return await self._evaluate_agent()
        r = self.cfg.rollout
        result = await evaluate(
            self.gateway,
            r.env,
            r.env_kwargs,
            n=self.cfg.eval.n,
            temperature=self.cfg.eval.temperature,
            max_tokens=r.max_tokens,
            max_turns=r.max_turns,
        )
        return {
            "eval/success_rate": result.success_rate,
            "eval/mean_reward": result.mean_reward,
            "eval/mean_turns": result.mean_turns,
            "eval/mean_tokens": result.mean_tokens,
        }

    async def _evaluate_agent(self) -> dict[str, float]:
        trajs = await asyncio.gather(
            *(
                self.flow.rollout(
                    None,
                    options={"split": "eval", "index": i},
                    temperature=self.cfg.eval.temperature,
                )
                for i in range(self.cfg.eval.n)
            )
        )
        n = len(trajs)
        return {
            "eval/success_rate": sum((t.reward or 0.0) >= 1.0 for t in trajs) / n,
            "eval/mean_reward": sum(t.reward or 0.0 for t in trajs) / n,
            "eval/mean_tokens": sum(t.num_output_tokens for t in trajs) / n,
            "eval/aborted_frac": sum(t.status != "ok" for t in trajs) / n,
        }


def resolve_dtype(cfg: TrainerConfig) -> str:
    """Settle `train.dtype: auto` (by `machine.auto_dtype`) in `cfg`, with a local engine left at
    float32 following the trainer, so both run in one dtype; returns the run header's line."""
    from gateway import machine
    from trainer.backends.torch_backend import train_device, train_dtype

    device = train_device(cfg.train.device)
    asked = cfg.train.dtype
    dtype = train_dtype(asked, device)
    cfg.train.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
    if asked == "auto" and cfg.engine.kind == "local" and cfg.engine.dtype == "float32":
        cfg.engine.dtype = str(dtype).removeprefix("torch.")
    engine = f", engine {cfg.engine.dtype}" if cfg.engine.kind == "local" else ""
    return (
        f"trainer.run: {machine.describe(str(device))}; "
        f"train.dtype={asked} -> {cfg.train.dtype}{engine}"
    )


async def train(cfg: TrainerConfig, run_dir: Path | None = None) -> Summary:
    """Run `cfg` to the end; everything started here is stopped before returning."""
    if cfg.train.kind == "torch":
        print(resolve_dtype(cfg), file=sys.stderr, flush=True)
    if cfg.agent.kind == "command" and cfg.agent.sandbox.kind == "docker":
        # Fail before loading anything, not with every rollout aborted.
        if why := docker_unavailable(cfg.agent.sandbox.image):
            raise ConfigError(f"agent.sandbox.kind=docker: {why} (or agent.sandbox.kind=local)")
    model_path = resolve_model(cfg.model.name)
    mode = cfg.rollout.partial_rollout
    use_ray = cfg.ray.enabled and cfg.engine.kind == "local"
    async with contextlib.AsyncExitStack() as stack:
        if use_ray:
            from trainer.actors import RayObjectStorePush, init_ray, spawn_backend, spawn_engine

            init_ray(cfg.ray.address, cfg.ray.num_cpus)
            engine = spawn_engine(cfg.engine, model_path, num_cpus=cfg.ray.engine_cpus)
            stack.push_async_callback(engine.close)
            backend = spawn_backend(cfg, num_cpus=cfg.ray.trainer_cpus)
            stack.callback(backend.close)
            push: Any = RayObjectStorePush([engine], mode)
        else:
            engine = make_engine(cfg.engine, model_path)
            stack.push_async_callback(engine.close)
            backend = make_backend(cfg)
            push = InProcessPush([engine], mode)
        gateway = Gateway(engine, model_path, GatewayConfig(model=cfg.model.name, auth="keys"))
        stack.push_async_callback(gateway.aclose)
        socket_path = None
        if cfg.agent.kind == "command":
            # Sandboxes reach the gateway only through this Unix socket (short path: 108-byte limit).
            socket_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="loongsage-"))
            socket_path = str(Path(socket_dir) / "gateway.sock")
            server = await gateway.start_http(port=0, uds=socket_path)
            stack.push_async_callback(server.stop)
        source = AgentFlow(gateway, cfg.rollout, cfg.agent, gateway_socket=socket_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        controller = Controller(
            cfg,
            backend,
            source,
            push,
            prompts=PromptStream(seed=cfg.run.seed),
            evaluator=EnvEvaluator(gateway, cfg, source),
            decode=tokenizer.decode,
            run_dir=run_dir,
        )
        return await controller.run()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(sys.argv[1:] if argv is None else argv)
        summary = asyncio.run(train(cfg))
    except ConfigError as e:
        raise SystemExit(f"trainer.run: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(
            "trainer.run: interrupted; resume with run.resume=auto run.dir=<its run dir>"
        ) from None
    print(summary.text())


if __name__ == "__main__":
    main()
