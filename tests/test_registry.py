"""Registries of kinds: lazy entry points, config errors that name the closest kind, and new
kinds (an agent, an engine, a weight route) added as one module plus one `register` line."""

from __future__ import annotations

import sys

import pytest
import torch

from gateway.config import ConfigError
from gateway.engines import ENGINES, EngineConfig, make_engine
from gateway.registry import Registry
from sandbox import SANDBOXES, SandboxConfig
from trainer.agents import AGENTS
from trainer.backends import TRAIN_BACKENDS
from trainer.config import load
from trainer.weights import PUSH_ROUTES, InProcessPush, WeightPush


@pytest.fixture
def kinds_module(tmp_path, monkeypatch):
    """Write `<name>.py` into an importable folder: the one file a new kind is."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


@pytest.fixture
def register(monkeypatch):
    """`registry.register(...)`, undone after the test (the registries are process-wide)."""

    def add(registry: Registry, kind: str, entry_point: str, **attrs) -> None:
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        monkeypatch.setattr(registry, "_attrs", dict(registry._attrs))
        registry.register(kind, entry_point, **attrs)

    return add


def test_unknown_kind_names_the_registered_ones_and_the_closest():
    reg = Registry("engine.kind")
    reg.register("local", "no_such_module:Engine")  # lazy: nothing is imported yet
    reg.register("sglang", "no_such_module:Other")
    with pytest.raises(ConfigError, match=r"engine.kind: 'sglnag' .*did you mean 'sglang'"):
        reg.check("sglnag")
    with pytest.raises(ConfigError, match=r"\(registered: local, sglang\)"):
        reg.build("vllm")
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        reg.build("local")  # a kind is imported only when it is built


def test_bad_registrations_are_refused():
    reg = Registry("x.kind")
    with pytest.raises(ValueError, match="module:attr"):
        reg.register("a", "no_colon")
    reg.register("a", "m:A")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", "m:B")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.kind=sglnag", "engine.kind: 'sglnag' is not a registered kind; did you mean"),
        ("train.kind=megatorn", "train.kind: 'megatorn' .*registered: megatron, torch"),
        ("agent.kind=comand", "agent.kind: 'comand' .*did you mean 'command'"),
        ("agent.sandbox.kind=dokcer", "sandbox.kind: 'dokcer' .*did you mean 'docker'"),
    ],
)
def test_a_recipe_with_an_unknown_kind_fails_when_loaded(override, message):
    with pytest.raises(ConfigError, match=message):
        load([override])


@pytest.mark.parametrize(
    "registry", [ENGINES, TRAIN_BACKENDS, PUSH_ROUTES, SANDBOXES, AGENTS], ids=lambda r: r.key
)
def test_every_registered_entry_point_resolves(registry):
    assert len(registry.kinds()) >= 2  # each part has (at least) two kinds
    for kind in registry.kinds():
        assert callable(registry.load(kind)), kind


ECHO_AGENT = '''
from envs.agent import Episode


class EchoAgent:
    """Asks the model once with the task and answers with what it said."""

    def __init__(self, cfg, rollout, *, gateway_socket=None):
        self.rollout = rollout

    @staticmethod
    def preflight(cfg):
        pass

    async def play(self, env, session, *, task_seed, options, sample_seed):
        task, _ = env.reset(seed=task_seed, options=options)
        client = session.gateway.openai_client(session.api_key)
        reply = await client.chat.completions.create(
            model=session.gateway.model_name, messages=[{"role": "user", "content": task}],
            max_tokens=self.rollout.max_tokens, temperature=session.temperature,
        )
        _, reward, *_ = env.step(reply.choices[0].message.content or "")
        return Episode(reward=float(reward), turns=1)
'''


async def test_a_new_agent_kind_is_one_module_and_one_line(tiny_model_path, kinds_module, register):
    from gateway.engines.local import LocalEngine
    from gateway.server import Gateway, GatewayConfig
    from trainer.agentflow import AgentFlow
    from trainer.config import AgentConfig, RolloutConfig

    register(AGENTS, "echo", f"{kinds_module('kinds_echo', ECHO_AGENT)}:EchoAgent")
    async with LocalEngine(tiny_model_path) as engine:
        gateway = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"))
        try:
            flow = AgentFlow(gateway, RolloutConfig(max_tokens=8), AgentConfig(kind="echo"))
            traj = await flow.rollout(5, seed=1)
        finally:
            await gateway.aclose()
    assert traj.status == "ok", traj.reason
    assert len(traj.turns) == 1 and traj.num_output_tokens > 0
    assert traj.reward == 0.0 and traj.info["turns"] == 1


def test_a_new_engine_kind_is_one_module_and_one_line(tiny_model_path, kinds_module, register):
    module = kinds_module(
        "kinds_engine",
        "from gateway.engines.local import LocalEngine\n\n"
        "class SmallBatchEngine(LocalEngine):\n"
        "    def __init__(self, cfg, model_path):\n"
        "        super().__init__(str(model_path), max_batch_size=2)\n",
    )
    register(ENGINES, "small_batch", f"{module}:SmallBatchEngine", remote=False)
    engine = make_engine(EngineConfig(kind="small_batch"), tiny_model_path)
    try:
        assert type(engine).__name__ == "SmallBatchEngine" and engine.max_batch_size == 2
    finally:
        import asyncio

        asyncio.run(engine.close())
    assert sys.modules[module]  # imported when built, not when registered


class Receiver:
    """A receiver that records what happens to it, and says which routes it accepts (without
    `weight_routes`, like most engines, it takes the default: `in_process`)."""

    def __init__(self, *routes: str) -> None:
        if routes:
            self.weight_routes = routes
        self.calls: list[str] = []
        self.version = 0

    async def pause(self, mode: str) -> None:
        self.calls.append(f"pause:{mode}")

    async def resume(self) -> None:
        self.calls.append("resume")

    async def update_weights(self, state, version: int) -> None:
        self.calls.append(f"in_process:{version}")
        self.version = version


COPY_ROUTE = '''
import time


class Copied:
    def __init__(self, tensors):
        self.tensors = {k: v.clone() for k, v in tensors.items()}
        self.created = time.perf_counter()

    async def ready(self):
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class CopyRoute:
    """Stages one copy of the weights per push and hands it to every receiver."""

    staged = 0

    async def stage(self, state_dict):
        CopyRoute.staged += 1
        return Copied(state_dict)

    async def apply(self, engine, staged, version):
        engine.calls.append(f"copy:{version}")
        engine.version = version
'''


@pytest.mark.parametrize("mode", ["continue", "abort_resubmit"])
async def test_weight_routes_are_planned_per_receiver(kinds_module, register, mode):
    module = kinds_module("kinds_route", COPY_ROUTE)
    register(PUSH_ROUTES, "copy", f"{module}:CopyRoute")
    plain, copying, unknown_first = Receiver(), Receiver("copy"), Receiver("shm", "in_process")
    push = WeightPush([plain, copying, unknown_first], mode)
    assert [route for _, route in push.plan] == ["in_process", "copy", "in_process"]
    state = {"w": torch.ones(4), "tied": torch.zeros(2)}
    report = await push.push(state, 3)
    assert sys.modules[module].CopyRoute.staged == 1  # once per push, not per receiver
    assert report.receivers == 3 and report.bytes == 24 and report.seconds > 0
    assert all(r.version == 3 for r in (plain, copying, unknown_first))
    around = ["pause:retract"], ["resume"]
    if mode == "continue":
        around = [], []
    assert plain.calls == [*around[0], "in_process:3", *around[1]]
    assert copying.calls == [*around[0], "copy:3", *around[1]]
    with pytest.raises(ValueError, match="no registered weight route reaches"):
        WeightPush([Receiver("shm")])


async def test_a_forced_route_reaches_every_engine_the_same_way():
    receivers = [Receiver("copy"), Receiver()]
    push = InProcessPush(receivers, "abort_resubmit")
    assert [route for _, route in push.plan] == ["in_process", "in_process"]
    await push.push({"w": torch.ones(2)}, 1)
    assert all(r.calls == ["pause:retract", "in_process:1", "resume"] for r in receivers)


def test_sandbox_kinds_check_before_a_run(monkeypatch):
    from sandbox import unavailable

    assert unavailable(SandboxConfig(kind="local")) == ""  # nothing to check: it can always try
    from sandbox.docker_backend import DockerSandbox

    monkeypatch.setattr("sandbox.image.docker_unavailable", lambda image: f"no image {image}")
    why = DockerSandbox.unavailable(SandboxConfig(kind="docker", image="x:1"))
    assert why == "no image x:1 (or use kind=local)"
