"""`python -m trainer.run recipe=NAME [key.sub=value ...]`: the main job.

Builds the parts a recipe names, each from its registry of kinds, and hands them to the
controller:

    engines (Ray actors, in-process, or SGLang) <- router <- gateway (here, per-rollout sessions)
         ^                                                    ^
         | TransferMesh after each step                       | AgentFlow: the agent kind `agent.kind` names
    train backend (Ray actor, or in-process) <- controller (admission, batches, train, push, eval)

`engine.replicas` local engines (or one engine per SGLang URL) stand behind the gateway's
session-sticky, least-loaded router; each is a TransferMesh receiver, and the plan of which
route reaches which engine is printed at start. With `ray.enabled` the backend's ranks run as
Ray actors (one per rank: tensor x pipeline x data parallel), and so does each engine unless
its kind is a client of servers elsewhere (`remote`, e.g. SGLang); trainer/cluster.py places
them, on this machine or on the cluster at `ray.address`.
The gateway also listens on a Unix socket in a private temporary folder: the only way out of
the sandboxes of black-box agents. With `algorithm.distill.teachers`, teachers made by recipes
are made first (child runs, cached), and a TeacherManager scores every sample in this process.
`--help` lists every key with its help text; `recipe=quickstart` is the CPU default.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import gymnasium as gym
import torch
from transformers import AutoTokenizer

from gateway.config import ConfigError
from gateway.engines import ENGINES, make_engines, replica_configs, serve_together
from gateway.engines.base import Engine
from gateway.machine import CoreBoard
from gateway.models import resolve_model
from gateway.server import Gateway, GatewayConfig
from trainer.agentflow import AgentFlow, gateway_socket
from trainer.backends import TRAIN_BACKENDS, TrainBackend, make_backend
from trainer.buffer import PromptStream
from trainer.config import TrainerConfig, load
from trainer.controller import Controller, StopRun
from trainer.eval import FlowEvaluator
from trainer.metrics import Summary
from trainer.teachers.make import teacher_models
from trainer.teachers.manager import TeacherManager
from trainer.transfer import TransferMesh


@contextlib.asynccontextmanager
async def engines_and_backend(
    cfg: TrainerConfig, model_path: str
) -> AsyncIterator[tuple[list[Engine], TrainBackend]]:
    """The engines and the train backend; all stopped on exit. With `ray.enabled` the
    backend's ranks are Ray actors, and so are the engines unless they are clients of servers
    elsewhere (trainer/cluster.py places them); otherwise all run in this process."""
    async with contextlib.AsyncExitStack() as stack:
        remote = ENGINES.attrs(cfg.engine.kind)["remote"]
        if cfg.ray.enabled:
            import ray

            from trainer import cluster

            check_ray_cpus(cfg, remote)
            if cluster.init(cfg.ray):  # a Ray this run started ends with it, after its actors
                stack.callback(ray.shutdown)
        if cfg.ray.enabled and not remote:
            engines: list[Engine] = [
                await stack.enter_async_context(cluster.placed_engine(cfg, replica, model_path))
                for replica in replica_configs(cfg.engine)
            ]
        else:
            engines = make_engines(cfg.engine, model_path)
            for engine in engines:
                stack.push_async_callback(engine.close)
        if cfg.ray.enabled:
            backend = stack.enter_context(cluster.placed_trainer(cfg))
            print(cluster.describe(engines, backend), flush=True)
            if lends_cores(cfg, remote):
                board = CoreBoard.create(1 + len(engines))
                stack.callback(board.close)
                for slot, engine in enumerate(engines, 1):  # one engine borrows: no two do
                    await engine.share_cores(board.path, slot, borrow=len(engines) == 1)
                backend.share_cores(board.path)
                who = "trainer and engine" if len(engines) == 1 else "the trainer"
                print(f"cpu lending: {who} compute with idle processes' cores", flush=True)
        else:
            backend = make_backend(cfg)
        yield engines, backend


def lends_cores(cfg: TrainerConfig, remote_engines: bool) -> bool:
    """`ray.lend_cpus` applies: a local Ray, one CPU torch-backend rank, local CPU engines."""
    from trainer.backends.torch_backend import train_device

    return (
        cfg.ray.lend_cpus
        and cfg.ray.address is None
        and not remote_engines
        and cfg.engine.kind == "local"
        and cfg.ray.engine_gpus == 0
        and cfg.train.kind == "torch"
        and cfg.train.world_size == 1
        and train_device(cfg.train.device).type == "cpu"
    )


def check_ray_cpus(cfg: TrainerConfig, remote_engines: bool) -> None:
    """A local Ray must hold every actor, or placing the last one waits (and fails) first."""
    engines = 0 if remote_engines else cfg.engine.replicas
    need = engines * cfg.ray.engine_cpus + cfg.train.world_size * cfg.ray.trainer_cpus
    if cfg.ray.address is None and need > cfg.ray.num_cpus:
        raise ConfigError(
            f"ray.num_cpus={cfg.ray.num_cpus} cannot hold {engines} engine(s) x "
            f"ray.engine_cpus={cfg.ray.engine_cpus} + {cfg.train.world_size} trainer rank(s) x "
            f"ray.trainer_cpus={cfg.ray.trainer_cpus}; raise ray.num_cpus (logical CPUs may "
            "exceed the cores) or lower the others"
        )


def resolve_dtype(cfg: TrainerConfig) -> str:
    """Settle `train.dtype: auto` (by `machine.auto_dtype`) in `cfg`, with a local engine left at
    float32 following the trainer, so both run in one dtype; returns the run header's line."""
    from gateway import machine
    from trainer.backends.base import train_dtype
    from trainer.backends.torch_backend import train_device

    device = train_device(cfg.train.device)
    asked = cfg.train.dtype
    dtype = train_dtype(asked, device)
    if asked == "auto" and device.type == "cpu":  # bf16 only for a backend that has it on CPU
        if not TRAIN_BACKENDS.attrs(cfg.train.kind).get("cpu_bf16", True):
            dtype = torch.float32
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
    AgentFlow.check(cfg.rollout, cfg.agent)  # before loading anything
    print(resolve_dtype(cfg), file=sys.stderr, flush=True)
    teacher_paths = teacher_models(cfg.algorithm.distill)  # runs recipes of uncached teachers
    model_path = resolve_model(cfg.model.name)
    asyncio.get_running_loop().set_default_executor(DaemonThreads())
    async with contextlib.AsyncExitStack() as stack:
        engines, backend = await stack.enter_async_context(engines_and_backend(cfg, model_path))
        _stop_on_sigterm(stack)
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
        teachers = None
        if cfg.algorithm.distill.teachers:
            teachers = TeacherManager(cfg.algorithm.distill, teacher_paths)
            stack.push_async_callback(teachers.close)
        controller = Controller(
            cfg,
            backend,
            flow,
            mesh,
            prompts=PromptStream(seed=cfg.run.seed),
            evaluator=FlowEvaluator(flow, cfg.eval),
            decode=AutoTokenizer.from_pretrained(model_path).decode,
            run_dir=run_dir,
            teachers=teachers,
        )
        return await controller.run()


class DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """The run's executor for blocking calls (`asyncio.to_thread`): each call in a daemon thread,
    and shutdown waits for none. A stopped run then exits at once even while a train step, a
    weight push or a save is in flight (asyncio.run and the interpreter would otherwise wait for
    it: minutes for a train step on a loaded CPU). What such a call would have produced is
    lost; checkpoints are written atomically, so the last one stands. (A ThreadPoolExecutor only
    because asyncio accepts no other kind as the default; its pool is never used.)"""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # the awaiting task re-raises it
                    future.set_exception(e)

        threading.Thread(target=call, name=getattr(fn, "__name__", "call"), daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to wait for: the threads are daemons."""


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
    # A shell without job control starts `cmd &` with SIGINT ignored, and SIGTERM stops the run
    # through SIGINT's handler: without this, such a run would ignore both.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
