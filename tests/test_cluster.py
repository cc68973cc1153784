"""A real two-node Ray cluster on this machine (`ray start --head`, `ray start --address`, each
with its own resources): the tiny recipe with the megatron backend at tensor parallel 2 on one
node and the engine on the other, run by the real command line; where each actor ran is asked
of the actors and checked against the nodes. The cluster is stopped at the end (the `ray start
--block` processes started here are terminated, and they stop their node's processes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fake_sglang import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a loopback test cluster; no token to hand around
    return env


def _start(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(
        [RAY, "start", "--block", "--object-store-memory=200000000", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=_env(),
        start_new_session=True,
    )
    proc.log = out  # type: ignore[attr-defined]
    deadline = time.monotonic() + 180
    while "block forever" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start {args} failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.log.close()  # type: ignore[attr-defined]


@pytest.fixture
def two_nodes():
    """A head node offering `trainer_node` and a second node offering `rollout_node`."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    port = free_port()
    procs = []
    try:
        procs.append(
            _start(
                [
                    "--head",
                    f"--port={port}",
                    "--num-cpus=2",
                    '--resources={"trainer_node": 2}',
                    f"--temp-dir={temp}",
                    "--include-dashboard=false",
                    "--disable-usage-stats",
                ],
                temp / "head.log",
            )
        )
        procs.append(
            _start(
                [f"--address=127.0.0.1:{port}", "--num-cpus=1", '--resources={"rollout_node": 1}'],
                temp / "worker.log",
            )
        )
        yield f"127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _nodes(address: str) -> dict[str, dict[str, float]]:
    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR');"
        "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_tp2_on_one_node_engine_on_the_other(two_nodes, tmp_path):
    nodes = _nodes(two_nodes)
    assert len(nodes) == 2
    trainer_node = next(n for n, res in nodes.items() if "trainer_node" in res)
    rollout_node = next(n for n, res in nodes.items() if "rollout_node" in res)

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.run",
            "recipe=tiny",
            f"ray.address={two_nodes}",
            "train.kind=megatron",
            "train.tensor_parallel=2",
            "ray.trainer_resources={trainer_node: 1}",
            "ray.engine_resources={rollout_node: 1}",
            f"run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    placed = dict(re.findall(r"^  (trainer rank \d|engine): node (\w+) ", run.stdout, re.M))
    assert placed == {
        "trainer rank 0": trainer_node,
        "trainer rank 1": trainer_node,
        "engine": rollout_node,
    }, run.stdout

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:  # trainer (TP 2, gloo) and engine agree on the sampled tokens' log-probs
        assert row["mismatch/logprob_abs_diff"] < 1e-3
    ranks = sorted(
        p.name for p in (tmp_path / "checkpoints" / "step_000002" / "megatron").iterdir()
    )
    assert ranks == ["rank00000.pt", "rank00001.pt"]
    assert (tmp_path / "final" / "model.safetensors").is_file()
