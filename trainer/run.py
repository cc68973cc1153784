"""`python -m trainer.run recipe=NAME [key.sub=value ...]`: the main job.

Builds the parts a recipe names, each from its registry of kinds, and hands them to the
controller:

    engines (Ray actors, in-process, or SGLang) <- router <- gateway (here, per-rollout sessions)
         ^                                                    ^
         | TransferMesh after each step                       | AgentFlow: the agent kind `agent.kind` names
    train backend (Ray actor, or in-process) <- controller (admission, batches, train, push, eval)

`engine.replicas` local engines (or one engine per SGLang URL) stand behind the gateway's
session-sticky, least-loaded router; each is a TransferMesh receiver, and the plan of which
route reaches which engine is printed at start. The engines and the backend run as Ray actors
with `ray.enabled`, unless the engine kind is a client of servers elsewhere (`remote`, e.g.
SGLang), which keeps the rest of the run in this process.
The gateway also listens on a Unix socket in a private temporary folder: the only way out of
the sandboxes of black-box agents. `--help` lists every key with its help text;
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
from gateway.engines import ENGINES, make_engines, replica_configs, serve_together
from gateway.engines.base import Engine
from gateway.models import resolve_model
from gateway.server import Gateway, GatewayConfig
from trainer.agentflow import AgentFlow, gateway_socket
from trainer.backends import TrainBackend, make_backend
from trainer.buffer import PromptStream
from trainer.config import TrainerConfig, load
from trainer.controller import Controller
from trainer.eval import FlowEvaluator
from trainer.metrics import Summary
from trainer.transfer import TransferMesh


@contextlib.asynccontextmanager
async def engines_and_backend(
    cfg: TrainerConfig, model_path: str
) -> AsyncIterator[tuple[list[Engine], TrainBackend]]:
    """The engines and the train backend, as Ray actors (`ray.enabled`, for engines that run
    here) or in this process; all stopped on exit."""
    async with contextlib.AsyncExitStack() as stack:
        if cfg.ray.enabled and not ENGINES.attrs(cfg.engine.kind)["remote"]:
            from trainer.actors import init_ray, spawn_backend, spawn_engine

            check_ray_cpus(cfg)
            init_ray(cfg.ray.address, cfg.ray.num_cpus)
            engines: list[Engine] = []
            for replica in replica_configs(cfg.engine):
                engines.append(spawn_engine(replica, model_path, num_cpus=cfg.ray.engine_cpus))
                stack.push_async_callback(engines[-1].close)
            backend = spawn_backend(cfg, num_cpus=cfg.ray.trainer_cpus)
            stack.callback(backend.close)
        else:
            engines = make_engines(cfg.engine, model_path)
            for engine in engines:
                stack.push_async_callback(engine.close)
            backend = make_backend(cfg)
        yield engines, backend


def check_ray_cpus(cfg: TrainerConfig) -> None:
    """A local Ray must hold every actor, or spawning the last one waits forever."""
    need = cfg.engine.replicas * cfg.ray.engine_cpus + cfg.ray.trainer_cpus
    if cfg.ray.address is None and need > cfg.ray.num_cpus:
        raise ConfigError(
            f"ray.num_cpus={cfg.ray.num_cpus} cannot hold engine.replicas={cfg.engine.replicas} "
            f"x ray.engine_cpus={cfg.ray.engine_cpus} + ray.trainer_cpus={cfg.ray.trainer_cpus}; "
            "raise ray.num_cpus (logical CPUs may exceed the cores) or lower the others"
        )


async def train(cfg: TrainerConfig, run_dir: Path | None = None) -> Summary:
    """Run `cfg` to the end; everything started here is stopped before returning."""
    AgentFlow.check(cfg.rollout.env, cfg.agent)  # before loading anything
    model_path = resolve_model(cfg.model.name)
    async with contextlib.AsyncExitStack() as stack:
        engines, backend = await stack.enter_async_context(engines_and_backend(cfg, model_path))
        engine = serve_together(engines)
        if len(engines) > 1:
            stack.push_async_callback(engine.close)  # the router's health checks
        mesh = TransferMesh(backend, engines, cfg.transfer, cfg.rollout.partial_rollout)
        stack.push_async_callback(mesh.close)
        print(mesh.plan.describe(), flush=True)
        gateway = Gateway(engine, model_path, GatewayConfig(model=cfg.model.name, auth="keys"))
        stack.push_async_callback(gateway.aclose)
        socket = await stack.enter_async_context(gateway_socket(gateway))
        flow = AgentFlow(gateway, cfg.rollout, cfg.agent, gateway_socket=socket)
        controller = Controller(
            cfg,
            backend,
            flow,
            mesh,
            prompts=PromptStream(seed=cfg.run.seed),
            evaluator=FlowEvaluator(flow, cfg.eval),
            decode=AutoTokenizer.from_pretrained(model_path).decode,
            run_dir=run_dir,
        )
        return await controller.run()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(sys.argv[1:] if argv is None else argv)
        summary = asyncio.run(train(cfg))
    except (ConfigError, gym.error.Error) as e:
        raise SystemExit(f"trainer.run: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(
            "trainer.run: interrupted; resume with run.resume=auto run.dir=<its run dir>"
        ) from None
    print(summary.text())


if __name__ == "__main__":
    main()
