"""`python -m trainer.run recipe=NAME [key.sub=value ...]`: the main job.

Builds the parts a recipe names, each from its registry of kinds, and hands them to the
controller:

    engine (Ray actor, or in-process)  <- gateway (in this process, per-rollout sessions)
         ^                                   ^
         | weight push after each step       | AgentFlow: the agent kind `agent.kind` names
    train backend (Ray actor, or in-process) <- controller (admission, batches, train, push, eval)

With `ray.enabled` the backend's ranks run as Ray actors (one per rank: tensor x pipeline x
data parallel), and so does the engine unless its kind is a client of servers elsewhere
(`remote`, e.g. SGLang); trainer/cluster.py places them, on this machine or on the cluster at
`ray.address`.
The gateway also listens on a Unix socket in a private temporary folder: the only way out of
the sandboxes of black-box agents. With `algorithm.distill.teachers`, teachers made by recipes
are made first (child runs, cached), and a TeacherManager scores every sample in this process.
`--help` lists every key with its help text; `recipe=quickstart` is the CPU default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
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
    """The engine and the train backend; both stopped on exit. With `ray.enabled` the backend's
    ranks are Ray actors, and so is the engine unless it is a client of servers elsewhere
    (trainer/cluster.py places them); otherwise both run in this process."""
    async with contextlib.AsyncExitStack() as stack:
        remote = ENGINES.attrs(cfg.engine.kind)["remote"]
        if cfg.ray.enabled:
            from trainer import cluster

            cluster.init(cfg.ray)
        if cfg.ray.enabled and not remote:
            engine = await stack.enter_async_context(cluster.placed_engine(cfg, model_path))
        else:
            engine = make_engine(cfg.engine, model_path)
            stack.push_async_callback(engine.close)
        if cfg.ray.enabled:
            backend = stack.enter_context(cluster.placed_trainer(cfg))
            print(cluster.describe(engine, backend), flush=True)
        else:
            backend = make_backend(cfg)
        yield engine, backend


async def train(cfg: TrainerConfig, run_dir: Path | None = None) -> Summary:
    """Run `cfg` to the end; everything started here is stopped before returning."""
    AgentFlow.check(cfg.rollout, cfg.agent)  # before loading anything
    teacher_paths = teacher_models(cfg.algorithm.distill)  # runs recipes of uncached teachers
    model_path = resolve_model(cfg.model.name)
    async with contextlib.AsyncExitStack() as stack:
        engine, backend = await stack.enter_async_context(engine_and_backend(cfg, model_path))
        _stop_on_sigterm(stack)
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


def _stop_on_sigterm(stack: contextlib.AsyncExitStack) -> None:
    """SIGTERM stops the run as Ctrl-C does: every task cancelled, everything started stopped
    (sandboxes included), then exit. Set after Ray starts, whose own handler would exit from
    wherever the loop happens to be and leave worker threads to finish their agents first."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, signal.raise_signal, signal.SIGINT)
    stack.callback(loop.remove_signal_handler, signal.SIGTERM)


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
