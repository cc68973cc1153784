"""TransferMesh across Ray nodes: a second raylet on this machine plays the other node (its own
node id, so no shared memory with the trainer's node), started with `ray start` and stopped at
the end. The planner sends the engine on the trainer's node shared memory and the engine on the
other node a gloo broadcast; both get the weights bit-exactly."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import ray
import torch
from ray._raylet import AuthenticationMode, get_authentication_mode

from gateway.engines import EngineConfig
from trainer.actors import init_ray, spawn_engine
from trainer.transfer import StateDictSource, TransferMesh

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def raylet(*args: str) -> Iterator[subprocess.Popen]:
    """`ray start --block ...` in a process group of its own, killed (by group) on exit."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    common = ["--block", "--disable-usage-stats"]
    proc = subprocess.Popen(
        [ray_cli, "start", *args, *common],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ls-ray-")  # short: Ray's socket paths have a length limit
    resources = '--resources={"node_a": 4}'
    with pytest.MonkeyPatch.context() as env, contextlib.ExitStack() as stack:
        # Ray reads its auth mode once per process: raylets started here take the mode this
        # process already has (token, with ~/.ray/auth_token, after an earlier local ray.init)
        token = get_authentication_mode() == AuthenticationMode.TOKEN
        env.setenv("RAY_AUTH_MODE", "token" if token else "disabled")
        stack.callback(shutil.rmtree, temp, True)
        stack.enter_context(
            raylet("--head", f"--port={port}", f"--temp-dir={temp}", "--num-cpus=3",
                   "--include-dashboard=false", resources)
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not ray.is_initialized():
            try:
                init_ray(f"127.0.0.1:{port}")
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        stack.callback(ray.shutdown)
        stack.enter_context(
            raylet(f"--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"node_b": 4}')
        )
        deadline = time.monotonic() + 300  # a loaded machine starts a raylet slowly
        while sum(node["Alive"] for node in ray.nodes()) < 2:
            assert time.monotonic() < deadline, "the second raylet did not join"
            time.sleep(0.5)
        yield


async def test_an_engine_on_another_node_gets_a_broadcast(two_nodes, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    new = {k: v + 0.01 for k, v in StateDictSource(model.state_dict()).tensors.items()}
    here = spawn_engine(EngineConfig(), tiny_model_path, options={"resources": {"node_a": 1}})
    there = spawn_engine(EngineConfig(), tiny_model_path, options={"resources": {"node_b": 1}})
    mesh = TransferMesh(new, [here, there])
    try:
        assert here.placement.node == mesh.plan.sender.node != there.placement.node
        assert [route for _, route, _ in mesh.plan.entries] == ["shm", "broadcast"]
        assert "gloo" in mesh.plan.describe()
        report = await mesh.push(1)
        assert report.delivered == 2, report.failed
        for engine in (here, there):
            assert engine.weight_version == 1
            got = await engine.run(_weights)
            for name, tensor in new.items():
                assert torch.equal(got[name], tensor), name
    finally:
        await mesh.close()
        await here.close()
        await there.close()


async def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.weights().items()}


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
