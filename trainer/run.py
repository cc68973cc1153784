"""`python -m trainer.run recipe=NAME [key.sub=value ...]`: the main job.

Builds the parts a recipe names, each from its registry of kinds, and hands them to the
controller:

    engine (Ray actor, or in-process)  <- gateway (in this process, per-rollout sessions)
         ^                                   ^
         | weight push after each step       | AgentFlow: the agent kind `agent.kind` names
    train backend (Ray actor, or in-process) <- controller (admission, batches, train, push, eval)

The engine and the backend run as Ray actors with `ray.enabled`, unless the engine kind is a
client of servers elsewhere (`remote`, e.g. SGLang), which keeps the whole run in this process.
The gateway also listens on a Unix socket in a private temporary folder: the only way out of
the sandboxes of black-box agents. With `algorithm.distill.teachers`, teachers made by recipes
are made first (child runs, cached), and a TeacherManager scores every sample in this process. `--help` lists every key with its help text;
`recipe=quickstart` is the CPU default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import gymnasium as gym
from transformers import AutoTokenizer

from gateway.config import ConfigError
from gateway.engines import ENGINES, make_engine
from gateway.engines.base import Engine
from gateway.models import resolve_model
from gateway.server import Gateway, GatewayConfig
from trainer.agentflow import AgentFlow, gateway_socket
from trainer.backends import TrainBackend, make_backend
from trainer.buffer import PromptStream
from trainer.config import TrainerConfig, load
from trainer.controller import Controller, StopRun
from trainer.eval import FlowEvaluator
from trainer.metrics import Summary
from trainer.teachers.make import teacher_models
from trainer.teachers.manager import TeacherManager
from trainer.weights import WeightPush


@contextlib.asynccontextmanager
async def engine_and_backend(
    cfg: TrainerConfig, model_path: str
) -> AsyncIterator[tuple[Engine, TrainBackend]]:
    """The engine and the train backend, as Ray actors (`ray.enabled`, for engines that run
    here) or in this process; both stopped on exit."""
    async with contextlib.AsyncExitStack() as stack:
        if cfg.ray.enabled and not ENGINES.attrs(cfg.engine.kind)["remote"]:
            from trainer.actors import init_ray, spawn_backend, spawn_engine

            init_ray(cfg.ray.address, cfg.ray.num_cpus)
            engine = spawn_engine(cfg.engine, model_path, num_cpus=cfg.ray.engine_cpus)
            stack.push_async_callback(engine.close)
            backend = spawn_backend(cfg, num_cpus=cfg.ray.trainer_cpus)
            stack.callback(backend.close)
        else:
            engine = make_engine(cfg.engine, model_path)
            stack.push_async_callback(engine.close)
            backend = make_backend(cfg)
        yield engine, backend


async def train(cfg: TrainerConfig, run_dir: Path | None = None) -> Summary:
    """Run `cfg` to the end; everything started here is stopped before returning."""
    AgentFlow.check(cfg.rollout, cfg.agent)  # before loading anything
    teacher_paths = teacher_models(cfg.algorithm.distill)  # runs recipes of uncached teachers
    model_path = resolve_model(cfg.model.name)
    async with contextlib.AsyncExitStack() as stack:
        engine, backend = await stack.enter_async_context(engine_and_backend(cfg, model_path))
        gateway = Gateway(engine, model_path, GatewayConfig(model=cfg.model.name, auth="keys"))
        stack.push_async_callback(gateway.aclose)
        socket = await stack.enter_async_context(gateway_socket(gateway))
        flow = AgentFlow(gateway, cfg.rollout, cfg.agent, gateway_socket=socket)
        teachers = None
        if cfg.algorithm.distill.teachers:
            teachers = TeacherManager(cfg.algorithm.distill, teacher_paths)
            stack.push_async_callback(teachers.close)
        controller = Controller(
            cfg,
            backend,
            flow,
            WeightPush([engine], cfg.rollout.partial_rollout),
            prompts=PromptStream(seed=cfg.run.seed),
            evaluator=FlowEvaluator(flow, cfg.eval),
            decode=AutoTokenizer.from_pretrained(model_path).decode,
            run_dir=run_dir,
            teachers=teachers,
        )
        return await controller.run()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(sys.argv[1:] if argv is None else argv)
        summary = asyncio.run(train(cfg))
    except (ConfigError, gym.error.Error, StopRun) as e:
        raise SystemExit(f"trainer.run: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(
            "trainer.run: interrupted; resume with run.resume=auto run.dir=<its run dir>"
        ) from None
    print(summary.text())


if __name__ == "__main__":
    main()
