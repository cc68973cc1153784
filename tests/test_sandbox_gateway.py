"""Sandboxed agents through the real gateway (tiny model, auth=keys, Unix socket).

An agent holding one session's key reaches the model through the forwarder, its calls land in
its own session's token log, and nothing of another session (its trajectory, its chat route, the
admin list) is reachable with that key. The example agents (`examples/agents/`) run unmodified
in every backend (slow: a few hundred tokens each on the CPU), and so does mini-swe-agent, from
PyPI, in a venv of its own (local) and in a derived image (docker), both prepared by
`scripts/test_services.sh` (slow; skipped with the reason where they are missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from gateway.engines.local import LocalEngine
from gateway.models import loongsage_home
from gateway.render import load_renderer
from gateway.server import Gateway, GatewayConfig
from sandbox import SandboxConfig, open_sandbox, run_once
from sandbox.image import docker_unavailable

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = LocalEngine(tiny_model_path, max_batch_size=8)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
async def served(engine, tiny_model_path, tmp_path):
    """(gateway, unix socket path) with per-session keys."""
    gw = Gateway(
        engine, tiny_model_path, GatewayConfig(auth="keys"), renderer=_renderer(tiny_model_path)
    )
    os.chmod(tmp_path, 0o755)
    sock = str(tmp_path / "gateway.sock")
    server = await gw.start_http("127.0.0.1", 0, uds=sock)
    yield gw, sock
    await server.stop()
    await gw.aclose()


_renderers: dict[str, object] = {}


def _renderer(path):
    if str(path) not in _renderers:
        _renderers[str(path)] = load_renderer(path)
    return _renderers[str(path)]


BACKENDS = [
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
    ),
    pytest.param("process"),
    pytest.param("docker", marks=pytest.mark.docker),
]
ISOLATED = [p for p in BACKENDS if p.values[0] != "process"]


def make_cfg(backend: str, **kw) -> SandboxConfig:
    if backend == "docker":
        if why := docker_unavailable():
            pytest.skip(why)
        return SandboxConfig(kind="docker", **kw)
    return SandboxConfig(kind="local", local_isolation=backend, **kw)


PROBE = """
import json, os, sys, urllib.error, urllib.request
base = os.environ["OPENAI_BASE_URL"]           # http://127.0.0.1:PORT/v1
root = base.rsplit("/v1", 1)[0]
key = os.environ["OPENAI_API_KEY"]
other = sys.argv[1]

def call(url, body=None, key=key):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Authorization", "Bearer " + key)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None

chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
own, reply = call(base + "/chat/completions", chat)
out = {
    "own": own,
    "content_is_str": isinstance(reply["choices"][0]["message"]["content"], str),
    "other_trajectory": call(root + "/sessions/" + other + "/trajectory")[0],
    "other_chat": call(root + "/sessions/" + other + "/v1/chat/completions", chat)[0],
    "admin_list": call(root + "/sessions")[0],
    "made_up_key": call(base + "/chat/completions", chat, key="sk-made-up")[0],
}
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
async def test_agent_reaches_only_its_own_session(backend, served):
    gw, sock = served
    mine, my_key = gw.create_session({"rollout": "mine"})
    other, _ = gw.create_session({"rollout": "other"})
    cfg = make_cfg(backend, timeout_s=120, gateway_socket=sock)

    def run():
        with open_sandbox(cfg) as sb:
            sb.put_files({"probe.py": PROBE})
            return sb.run(["python3", "probe.py", other], env={"OPENAI_API_KEY": my_key})

    res = await asyncio.to_thread(run)
    assert res.status == "ok", res
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["own"] == 200 and out["content_is_str"]
    for name in ("other_trajectory", "other_chat", "admin_list", "made_up_key"):
        assert out[name] in (401, 403, 404), (name, out)
    assert len(gw.trajectory(mine).turns) == 1
    assert gw.trajectory(other).turns == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", ISOLATED)
@pytest.mark.parametrize("agent", ["openai_tool_agent.py", "agents_sdk_agent.py"])
async def test_example_agents_run_unmodified(backend, agent, served):
    gw, sock = served
    sid, key = gw.create_session({"task": "17*23"})
    cfg = make_cfg(backend, timeout_s=300, gateway_socket=sock)

    def run():
        with open_sandbox(cfg) as sb:
            sb.put_files({agent: (EXAMPLES / agent).read_text(), "task.txt": "What is 17*23?"})
            res = sb.run(["python3", agent], env={"OPENAI_API_KEY": key})
            return res, sb.get_files(["answer.txt"])

    res, files = await asyncio.to_thread(run)
    assert res.status == "ok", res
    assert "answer.txt" in files  # the tiny model's answer is noise; a verifier scores it
    traj = gw.trajectory(sid)
    assert len(traj.turns) >= 1
    assert all(t.output_ids for t in traj.turns)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_session_scoped_base_url(backend, served):
    """Agents that can set only a base URL: the session's path, via `gateway_path`."""
    gw, sock = served
    sid, key = gw.create_session()
    cfg = make_cfg(backend, timeout_s=120, gateway_socket=sock, gateway_path=f"/sessions/{sid}/v1")
    script = (
        "import json, os, urllib.request\n"
        "chat = {'model': 'tiny-random', 'messages': [{'role': 'user', 'content': 'hi'}],"
        " 'max_tokens': 3}\n"
        "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions',"
        " data=json.dumps(chat).encode(), headers={'Content-Type': 'application/json',"
        " 'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})\n"
        "print(urllib.request.urlopen(req, timeout=60).status)\n"
    )
    res, _ = await asyncio.to_thread(
        run_once, cfg, ["python3", "agent.py"], {"agent.py": script}, {"OPENAI_API_KEY": key}
    )
    assert res.status == "ok" and res.stdout.strip() == "200", res
    assert len(gw.trajectory(sid).turns) == 1


# ---- mini-swe-agent (PyPI), unmodified ----

MINI_VENV = loongsage_home() / "agents" / "mini-swe-agent"
MINI_IMAGE = "loongsage-mini-swe-agent:latest"
MINI_ENV = {"MSWEA_CONFIGURED": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# the recipe's command (recipes/blackbox_mini_swe.yaml), with a small max_tokens for speed
MINI_COMMAND = (
    'mini -c mini_swe_agent.yaml -c model.model_kwargs.max_tokens=24 -t "$(cat task.txt)" '
    "-o traj.json && { test -e answer.txt || : > answer.txt; }"
)


def mini_cfg(backend: str, sock: str) -> SandboxConfig:
    env = {**MINI_ENV, "MSWEA_MODEL_NAME": "openai/tiny-random"}
    if backend == "docker":
        if why := docker_unavailable(MINI_IMAGE):
            pytest.skip(f"{why} (scripts/test_services.sh builds it)")
        return make_cfg(backend, image=MINI_IMAGE, timeout_s=300, gateway_socket=sock, env=env)
    if not (MINI_VENV / "bin" / "mini").exists():
        pytest.skip(f"no mini-swe-agent venv at {MINI_VENV} (scripts/test_services.sh makes it)")
    env["PATH"] = f"{MINI_VENV}/bin:/usr/bin:/bin"
    return make_cfg(backend, timeout_s=300, gateway_socket=sock, env=env, ro_binds=[str(MINI_VENV)])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
async def test_mini_swe_agent_runs_unmodified(backend, served):
    """mini-swe-agent as published, through litellm's OpenAI client, with the tiny model (which
    never writes a valid action): the run ends by its own limits, exit 0, and leaves its
    trajectory; every call it made is in its session, and nothing else is."""
    gw, sock = served
    sid, key = gw.create_session({"agent": "mini-swe-agent"})
    cfg = mini_cfg(backend, sock)
    files = {
        "mini_swe_agent.yaml": (EXAMPLES / "mini_swe_agent.yaml").read_text(),
        "task.txt": "Ava has 7 apples. She gets 2 more. How many apples does Ava have now?",
    }
    res, out = await asyncio.to_thread(
        run_once,
        cfg,
        ["sh", "-c", MINI_COMMAND],
        files,
        {"OPENAI_API_KEY": key},
        ["traj.json", "answer.txt"],
    )
    assert res.status == "ok", res
    traj = json.loads(out["traj.json"])
    info = traj["info"]
    assert info["exit_status"] in ("LimitsExceeded", "RepeatedFormatError", "Submitted"), info
    assert "answer.txt" in out  # the agent's own, or the command's empty one: a verifier reads it
    calls = info["model_stats"]["api_calls"]
    turns = gw.trajectory(sid).turns
    assert calls >= 1 and len(turns) == calls
    assert all(t.output_ids for t in turns)
