"""Sandboxes, through every backend: files and logs, the only way out, limits, clean-up.

Backends: `bwrap` and `process` (the local backend's two modes) and `docker` (marked `docker`;
skipped with the reason when no Docker engine or no sandbox image is there). The "gateway" here
is a small HTTP server on a Unix socket started by the test; `test_sandbox_gateway.py` goes
through the real gateway.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.server
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway.config import parse_cli
from sandbox import SandboxConfig, SandboxError, open_sandbox
from sandbox.image import docker_unavailable

ROOT = Path(__file__).resolve().parents[1]


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
        why = docker_unavailable()
        if why:
            pytest.skip(why)
        return SandboxConfig(kind="docker", **kw)
    return SandboxConfig(kind="local", local_isolation=backend, **kw)


# ---- a fake gateway on a Unix socket, and a TCP canary on the host loopback ----


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real server

    def log_message(self, *args):  # client_address is '' on a Unix socket
        pass

    def _send(self, obj: dict, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send({"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                data = f"data: {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._send({"path": self.path, "auth": self.headers.get("Authorization")})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send({"sha256": hashlib.sha256(body).hexdigest(), "len": len(body)})


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def fake_gateway(tmp_path):
    path = str(tmp_path / "gw.sock")
    server = _UnixHTTPServer(path, _Handler)
    os.chmod(path, 0o666)
    os.chmod(tmp_path, 0o755)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield path
    server.shutdown()
    server.server_close()


@pytest.fixture
def canary_port():
    """A TCP server on the host's loopback that no sandbox may reach."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


# ---- files and logs ----


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_and_logs_come_back(backend):
    script = (
        "import sys, pathlib\n"
        "print('to stdout', open('in/task.txt').read())\n"
        "print('to stderr', file=sys.stderr)\n"
        "pathlib.Path('out').mkdir()\n"
        "pathlib.Path('out/answer.txt').write_text('42')\n"
        "pathlib.Path('raw.bin').write_bytes(bytes(range(256)))\n"
    )
    with open_sandbox(make_cfg(backend, timeout_s=60)) as sb:
        sb.put_files({"in/task.txt": "six times seven", "agent.py": script})
        res = sb.run(["python3", "agent.py"])
        assert res.status == "ok", res
        assert res.exit_code == 0 and res.reason == ""
        assert "to stdout six times seven" in res.stdout
        assert "to stderr" in res.stderr
        files = sb.get_files(["out", "raw.bin", "in/task.txt", "missing.txt"])
        assert files == {
            "out/answer.txt": b"42",
            "raw.bin": bytes(range(256)),
            "in/task.txt": b"six times seven",
        }
        # a later run sees the files of an earlier one (one work dir per sandbox)
        res = sb.run(["cat", "out/answer.txt"])
        assert res.stdout == "42"
        res = sb.run(["sh", "-c", "echo oops >&2; exit 3"])
        assert (res.status, res.exit_code) == ("error", 3)
        assert "oops" in res.reason
        with pytest.raises(ValueError, match="relative path"):
            sb.put_files({"../escape.txt": "x"})
        with pytest.raises(ValueError, match="relative path"):
            sb.get_files(["/etc/passwd"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_links_out_of_the_work_dir_are_not_followed(backend):
    with open_sandbox(make_cfg(backend, timeout_s=60)) as sb:
        res = sb.run(["ln", "-s", "/etc/hostname", "answer.txt"])
        assert res.status == "ok", res
        assert sb.get_files(["answer.txt"]) == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_command_is_an_error_result(backend):
    with open_sandbox(make_cfg(backend, timeout_s=60)) as sb:
        res = sb.run(["no-such-program-xyz"])
        assert res.status == "error"
        assert res.exit_code != 0


# ---- the only way out ----

NET_PROBE = """
import json, socket, sys, urllib.request
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "reached"
    except Exception as e:
        out[name] = type(e).__name__
attempt("canary", lambda: socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3))
attempt("dns", lambda: socket.getaddrinfo("deb.debian.org", 80))
attempt("outside", lambda: socket.create_connection(("1.1.1.1", 80), timeout=3))
attempt("outside_v6", lambda: socket.create_connection(("2606:4700:4700::1111", 80), timeout=3))
base = __import__("os").environ["OPENAI_BASE_URL"]
req = urllib.request.Request(base + "/whoami")
req.add_header("Authorization", "Bearer " + __import__("os").environ["OPENAI_API_KEY"])
out["gateway"] = json.loads(urllib.request.urlopen(req, timeout=10).read())
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", ISOLATED)
def test_reaches_the_gateway_and_nothing_else(backend, fake_gateway, canary_port):
    cfg = make_cfg(backend, timeout_s=60, gateway_socket=fake_gateway, api_key="sess-key-1")
    with open_sandbox(cfg) as sb:
        sb.put_files({"probe.py": NET_PROBE})
        res = sb.run(["python3", "probe.py", str(canary_port)])
        assert res.status == "ok", res
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["gateway"] == {"path": "/v1/whoami", "auth": "Bearer sess-key-1"}
        assert out["canary"] != "reached"
        assert out["dns"] != "reached"
        assert out["outside"] != "reached"
        assert out["outside_v6"] != "reached"
        # the per-run env wins over the config (a fresh session key per rollout)
        res = sb.run(
            ["sh", "-c", "echo $OPENAI_BASE_URL $OPENAI_API_KEY"], env={"OPENAI_API_KEY": "k2"}
        )
        assert res.stdout.split() == [f"http://127.0.0.1:{cfg.gateway_port}/v1", "k2"]


def test_process_mode_says_it_isolates_less(fake_gateway):
    cfg = make_cfg("process", timeout_s=60, gateway_socket=fake_gateway, api_key="k")
    with open_sandbox(cfg) as sb:
        assert "LESS ISOLATION" in sb.isolation
        sb.put_files({"probe.py": NET_PROBE})
        res = sb.run(["python3", "probe.py", "1"])
        assert res.status == "ok", res
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["gateway"]["auth"] == "Bearer k"  # the forwarder works without a netns too


FORWARDER_CLIENT = """
import hashlib, http.client, json, os, urllib.parse, openai
client = openai.OpenAI()
models = [m.id for m in client.models.list().data]
url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
body = os.urandom(3 << 20)
http = http.client.HTTPConnection(url.hostname, url.port, timeout=30)  # one keep-alive connection
echoes = []
for _ in range(3):
    http.request("POST", "/echo", body=body)
    echoes.append(json.loads(http.getresponse().read()))
http.request("GET", "/stream")
events = [line for line in http.getresponse().read().decode().splitlines() if line]
print(json.dumps({"models": models, "echoes": echoes, "events": events,
                  "sha": hashlib.sha256(body).hexdigest()}))
"""


@pytest.mark.parametrize("backend", ISOLATED)
def test_forwarder_with_real_http_clients(backend, fake_gateway):
    cfg = make_cfg(backend, timeout_s=120, gateway_socket=fake_gateway)
    with open_sandbox(cfg) as sb:
        sb.put_files({"client.py": FORWARDER_CLIENT})
        res = sb.run(["python3", "client.py"])
        assert res.status == "ok", res
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["models"] == ["fake"]
        assert out["echoes"] == [{"sha256": out["sha"], "len": 3 << 20}] * 3
        assert out["events"] == [f"data: {i}" for i in range(5)]


# ---- limits: each misbehaviour is stopped and reported; the others carry on ----

MEMORY_HOG = "blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))\n"
FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
)
INFINITE_LOOP = "while True:\n    pass\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_misbehaving_agents_are_stopped_and_others_carry_on(backend):
    def run(script: str, timeout_s: float, **kw):
        with open_sandbox(make_cfg(backend, timeout_s=timeout_s, **kw)) as sb:
            sb.put_files({"agent.py": script})
            return sb.run(["python3", "agent.py"])

    healthy = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.5)\n"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hog = pool.submit(run, MEMORY_HOG, 60, memory_mb=256)
        bomb = pool.submit(run, FORK_BOMB, 6, pids=32)
        loop = pool.submit(run, INFINITE_LOOP, 3)
        ok = pool.submit(run, healthy, 120)
        hog, bomb, loop, ok = hog.result(), bomb.result(), loop.result(), ok.result()
    assert hog.status == "killed" and hog.reason.startswith("memory"), hog
    assert bomb.status == "killed" and bomb.reason.startswith("pids"), bomb
    assert loop.status == "timeout" and "wall time" in loop.reason, loop
    assert ok.status == "ok" and ok.stdout.split() == ["0", "1", "2"], ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_everything_started_is_stopped(backend, leftover_containers):
    """Background children outlive the command; the sandbox kills them when the run ends."""
    with open_sandbox(make_cfg(backend, timeout_s=60)) as sb:
        res = sb.run(["sh", "-c", "sleep 300 & sleep 300 & echo started"])
        assert res.status == "ok" and res.stdout.strip() == "started", res
        if backend != "docker" and os.geteuid() == 0:
            from sandbox.local_backend import _pids_of_uid

            assert _pids_of_uid(sb.uid) == []
    if backend == "docker":
        assert leftover_containers() == []


# ---- start, stop, half-failed start ----


def sandbox_objects() -> set[str]:
    """Every sandbox container and volume on this Docker engine (none without one)."""
    try:
        import docker

        client = docker.from_env()
        label = {"label": "loongsage.sandbox"}
        names = {c.name for c in client.containers.list(all=True, filters=label)}
        return names | {v.name for v in client.volumes.list(filters=label)}
    except Exception:  # noqa: BLE001 - no Docker here: the docker cases skip
        return set()


@pytest.fixture
def leftover_containers():
    """The sandbox containers and volumes this test has left so far; those that existed before
    it (a killed earlier run's, another user's) are not its."""
    before = sandbox_objects()
    return lambda: sorted(sandbox_objects() - before)


def empty_image() -> str:
    """A Docker image with one file and no programs (built once, from a tar, offline)."""
    import io
    import tarfile

    import docker

    tag = "loongsage-test-empty:1"
    client = docker.from_env()
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("README")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"empty"))
        subprocess.run(["docker", "import", "-", tag], input=buf.getvalue(), check=True)
    return tag


def local_tmpdirs() -> set[str]:
    import tempfile

    return {p.name for p in Path(tempfile.gettempdir()).glob("loongsage-sandbox-*")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_failed_start_and_errors_clean_up(backend, tmp_path, leftover_containers):
    before = local_tmpdirs()
    not_a_socket = tmp_path / "gw.sock"
    not_a_socket.write_text("")
    for bad in (str(tmp_path / "missing.sock"), str(not_a_socket)):
        with pytest.raises(SandboxError, match="gateway_socket"):
            with open_sandbox(make_cfg(backend, gateway_socket=bad)):
                pass
    with pytest.raises(RuntimeError, match="boom"):
        with open_sandbox(make_cfg(backend)) as sb:
            sb.put_files({"a.txt": "x"})
            raise RuntimeError("boom")
    assert local_tmpdirs() == before
    if backend == "docker":
        assert leftover_containers() == []
        with pytest.raises(SandboxError, match="image"):
            with open_sandbox(make_cfg(backend, image="loongsage-no-such-image:1")):
                pass
        # an image without `sleep`: the volume and the holder exist when the holder's start fails
        with pytest.raises(SandboxError, match="could not start"):
            with open_sandbox(make_cfg(backend, image=empty_image())):
                pass
        assert leftover_containers() == []


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ValueError, match="gateway_path"):
        SandboxConfig(gateway_path="v1")
    with pytest.raises(ValueError, match="kind"):
        with open_sandbox(SandboxConfig(kind="vm")):  # type: ignore[arg-type]
            pass
    cfg = parse_cli(SandboxConfig, ["kind=docker", "pids=64", "gateway_socket=/tmp/gw.sock"])
    assert (cfg.kind, cfg.pids, cfg.gateway_socket) == ("docker", 64, "/tmp/gw.sock")
    with pytest.raises(ValueError, match="did you mean memory_mb"):
        parse_cli(SandboxConfig, ["memory_mib=5"])
    with open_sandbox(SandboxConfig()) as sb:
        with pytest.raises(ValueError, match="cmd"):
            sb.run([])


# ---- the command line ----


def sandbox_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sandbox_run_prints_one_json_result(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', sys.argv[1])\nsys.exit(4)\n")
    proc = sandbox_run("backend=local", f"files=[{script}]", "--", "python3", "hello.py", "x")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {
        "status",
        "exit_code",
        "reason",
        "duration_s",
        "stdout_tail",
        "stderr_tail",
        "isolation",
    }
    assert (out["status"], out["exit_code"], out["stdout_tail"]) == ("error", 4, "hello x\n")
    proc = sandbox_run("backend=local", "timeout_s=1", "--", "sleep", "30")
    assert json.loads(proc.stdout)["status"] == "timeout"
    proc = sandbox_run("backnd=local", "--", "true")
    assert proc.returncode == 2 and "did you mean backend" in proc.stderr
    proc = sandbox_run("backend=local")
    assert proc.returncode == 2 and "no command" in proc.stderr


def test_sandbox_run_relays_a_tcp_gateway(tmp_path):
    """gateway=http://... : the sandbox has no network, so a host relay exposes the URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/sessions/abc/v1"
        probe = (
            "import os, urllib.request\n"
            "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/models')\n"
            "req.add_header('Authorization', 'Bearer ' + os.environ['OPENAI_API_KEY'])\n"
            "print(urllib.request.urlopen(req).read().decode())\n"
        )
        script = tmp_path / "probe.py"
        script.write_text(probe)
        proc = sandbox_run(f"gateway={url}", f"files=[{script}]", "--", "python3", "probe.py")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = json.loads(proc.stdout)
        assert json.loads(out["stdout_tail"]) == {
            "path": "/sessions/abc/v1/models",
            "auth": "Bearer EMPTY",
        }
    finally:
        server.shutdown()
        server.server_close()


def test_rlimits_without_the_prlimit_binary():
    """The preexec fallback sets the same limits when util-linux's prlimit is missing."""
    with open_sandbox(make_cfg("process", timeout_s=60, memory_mb=256)) as sb:
        sb.prlimit = None
        sb.put_files({"agent.py": MEMORY_HOG})
        res = sb.run(["python3", "agent.py"])
        assert res.status == "killed" and res.reason.startswith("memory"), res


AT_EXIT = """
import sys, threading, time
from sandbox import SandboxConfig, open_sandbox
cfg = SandboxConfig(kind=sys.argv[1], local_isolation=sys.argv[2], timeout_s=300)

def hang():
    with open_sandbox(cfg) as sb:
        print("uid", getattr(sb, "uid", None), "root", getattr(sb, "root", None), flush=True)
        sb.run(["sleep", "300"])

threading.Thread(target=hang, daemon=True).start()
time.sleep(3)  # the run is under way; the interpreter exits with the sandbox still open
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_sandboxes_still_open_at_exit_are_stopped(backend, tmp_path, leftover_containers):
    make_cfg(backend)  # skips docker when unavailable
    kind, iso = ("docker", "auto") if backend == "docker" else ("local", backend)
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    proc = subprocess.run(
        [sys.executable, str(script), kind, iso],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    if backend == "docker":
        assert leftover_containers() == []
    else:
        from sandbox.local_backend import _pids_of_uid

        assert not Path(words[3]).exists()  # the work dir is gone
        if os.geteuid() == 0:
            assert _pids_of_uid(int(words[1])) == []


def test_apt_mirror_reads_both_source_formats(tmp_path):
    from sandbox.image import apt_mirror

    assert apt_mirror().startswith("http")  # this machine's own apt configuration
    (tmp_path / "a.sources").write_text(
        "Types: deb\nURIs: http://security.example/debian-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
    )
    (tmp_path / "b.list").write_text("deb [arch=amd64] http://old.example/debian bookworm main\n")
    assert apt_mirror([tmp_path / "a.sources"]) == "http://mirror.example/debian"
    assert apt_mirror([tmp_path / "b.list"]) == "http://old.example/debian"
    assert apt_mirror([tmp_path / "missing.list"]) == "http://deb.debian.org/debian"


@pytest.mark.docker
def test_default_image_has_python_and_the_agent_sdks():
    if why := docker_unavailable():
        pytest.skip(why)
    with open_sandbox(SandboxConfig(kind="docker", timeout_s=120)) as sb:
        res = sb.run(["python3", "-c", "import openai, agents; print('sdk ok')"])
        assert res.status == "ok" and res.stdout.strip() == "sdk ok", res


def test_run_once_is_one_rollout_and_never_raises_for_the_sandbox(tmp_path):
    from sandbox import run_once

    cfg = make_cfg("bwrap" if shutil.which("bwrap") else "process", timeout_s=60)
    script = "open('answer.txt', 'w').write(open('task.txt').read().upper())"
    res, files = run_once(
        cfg,
        ["python3", "agent.py"],
        files={"agent.py": script, "task.txt": "abc"},
        collect=["answer.txt", "nothing.txt"],
    )
    assert res.status == "ok" and files == {"answer.txt": b"ABC"}, res
    broken = SandboxConfig(kind=cfg.kind, gateway_socket=str(tmp_path / "no.sock"))
    res, files = run_once(broken, ["true"])
    assert res.status == "error" and "gateway_socket" in res.reason and files == {}


# ---- bring your own agent: its own venv (local), a derived image (docker) ----

VENV_AGENT = (
    "import json, os, sys\n"
    "import byoa_marker  # installed in the agent's venv only\n"
    "try:\n"
    "    open(os.path.join(sys.prefix, 'written'), 'w')\n"
    "    venv_writable = True\n"
    "except OSError:\n"
    "    venv_writable = False\n"
    "print(json.dumps({'marker': byoa_marker.WHERE, 'prefix': sys.prefix,\n"
    "                  'venv_writable': venv_writable, 'setting': os.environ.get('AGENT_SETTING')}))\n"
) + NET_PROBE


def make_venv(path: Path) -> Path:
    """A venv, with one module in it, of a Python installed in a folder of its own beside it (as
    pyenv or uv install them): the venv's `bin/python` links there, so it runs only if that
    folder comes along (exit 127 otherwise)."""
    base = path.parent / f"{path.name}-python" / "bin"
    base.mkdir(parents=True)
    (base / "python3").symlink_to(
        os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    )
    subprocess.run([str(base / "python3"), "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python*/site-packages"))
    (site / "byoa_marker.py").write_text("WHERE = 'the agent venv'\n")
    return path


LOCAL = [p for p in BACKENDS if p.values[0] != "docker"]


@pytest.mark.parametrize("backend", LOCAL)
def test_agent_in_its_own_venv_runs_unmodified(backend, tmp_path, fake_gateway, canary_port):
    """The agent's venv is a read-only bind; the Python it was made from comes with it, also
    when that Python and the venv sit under folders the sandbox uid may not enter (as root:
    /root/.pyenv, and pytest's 0700 tmp dirs)."""
    venv = make_venv(tmp_path / "agent-venv")
    cfg = make_cfg(
        backend,
        timeout_s=60,
        gateway_socket=fake_gateway,
        api_key="k1",
        ro_binds=[str(venv)],
        env={"AGENT_SETTING": "from cfg.env"},
    )
    with open_sandbox(cfg) as sb:
        sb.put_files({"agent.py": VENV_AGENT})
        res = sb.run([str(venv / "bin" / "python"), "agent.py", str(canary_port)])
    assert res.status == "ok", res
    mine, net = (json.loads(line) for line in res.stdout.strip().splitlines()[-2:])
    assert mine == {
        "marker": "the agent venv",
        "prefix": str(venv),
        "venv_writable": False,
        "setting": "from cfg.env",
    }
    assert net["gateway"] == {"path": "/v1/whoami", "auth": "Bearer k1"}
    if backend == "bwrap":  # process mode shares the host's network (and says so)
        assert [net[k] for k in ("canary", "dns", "outside")].count("reached") == 0, net
    assert not (venv / "written").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox runs under another uid only as root")
def test_process_mode_as_root_opens_closed_folders_without_changing_them(tmp_path):
    """As root a bare process runs under the sandbox's own uid, which may not enter /root
    (0700): a mount namespace shows it only the paths it needs, read-only."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (closed / "secret.txt").write_text("not for agents")
    venv = make_venv(closed / "venv")
    probe = (
        "import json, os, sys, openai\n"  # `python3` is this interpreter, libraries and all
        f"print(json.dumps({{'uid': os.getuid(), 'listing': os.listdir({str(closed)!r}),"
        " 'python3': sys.executable}))\n"
    )
    cfg = make_cfg("process", timeout_s=60, ro_binds=[str(venv)])
    with open_sandbox(cfg) as sb:
        sb.put_files({"probe.py": probe})
        own = sb.run([str(venv / "bin" / "python"), "-c", "import byoa_marker"])
        res = sb.run(["python3", "probe.py"])
        hidden = sb.run(["cat", str(closed / "secret.txt")])
    assert own.status == "ok", own
    assert res.status == "ok", res
    out = json.loads(res.stdout)
    assert out["uid"] not in (0, os.getuid())
    assert sorted(out["listing"]) == ["venv", "venv-python"]
    assert Path(out["python3"]).parent == Path(sys.executable).parent
    assert hidden.status == "error"
    assert closed.stat().st_mode & 0o777 == 0o700  # the host's folder is as it was


def test_missing_or_relative_ro_binds_are_config_errors(tmp_path):
    with pytest.raises(ValueError, match="ro_binds.*absolute"):
        SandboxConfig(ro_binds=["venv"])
    with pytest.raises(SandboxError, match="ro_binds.*does not exist"):
        with open_sandbox(SandboxConfig(ro_binds=[str(tmp_path / "nope")])):
            pass


def test_sandbox_run_takes_the_sandbox_keys_of_a_recipe(tmp_path):
    """`python -m sandbox.run` spells every key as under a recipe's `agent.sandbox`."""
    venv = make_venv(tmp_path / "venv")
    (tmp_path / "task.txt").write_text("the task")
    agent = "import byoa_marker, os\nprint(byoa_marker.WHERE, os.environ['MODE'], open('in/t.txt').read())"
    (tmp_path / "agent.py").write_text(agent)
    proc = sandbox_run(
        "backend=local",
        f"ro_binds=[{venv}]",
        "env={MODE: quiet}",
        f"files={{agent.py: {tmp_path / 'agent.py'}, in/t.txt: {tmp_path / 'task.txt'}}}",
        "--",
        str(venv / "bin" / "python"),
        "agent.py",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["stdout_tail"] == "the agent venv quiet the task\n"
    proc = sandbox_run("backend=local", "env={MODE:quiet}", "--", "true")
    assert proc.returncode == 2 and "env.MODE:quiet: expected str, got None" in proc.stderr


def test_derived_image_key_covers_base_packages_and_requirements(tmp_path):
    from sandbox.image import ImageConfig, packages_key, pip_platforms

    req = tmp_path / "requirements.txt"
    req.write_text("tabulate\n")
    keys = {
        packages_key(ImageConfig(packages=["tabulate"]), "sha256:a"),
        packages_key(ImageConfig(packages=["tabulate"]), "sha256:b"),
        packages_key(ImageConfig(packages=["tabulate==0.9.0"]), "sha256:a"),
        packages_key(ImageConfig(requirements=str(req)), "sha256:a"),
    }
    assert len(keys) == 4
    assert packages_key(ImageConfig(packages=["tabulate"]), "sha256:a") in keys
    glibc = {"libc": "glibc", "libc_version": "2.36", "machine": "x86_64"}
    tags = pip_platforms(glibc)
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_5_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux_2_37_x86_64" not in tags
    assert pip_platforms({**glibc, "libc": ""}) == []


@pytest.mark.docker
def test_derived_image_runs_an_agent_with_its_packages(
    tmp_path, fake_gateway, canary_port, leftover_containers
):
    """`build packages=[...]`: the base image plus an agent's packages, reused while the package
    set is the same; its agent reaches the gateway and nothing else; ro_binds work in docker."""
    import docker

    from sandbox.image import ImageConfig, build_image

    if why := docker_unavailable():
        pytest.skip(why)
    tag = build_image(ImageConfig(packages=["tabulate"]))
    built = docker.from_env().images.get(tag).id
    assert build_image(ImageConfig(packages=["tabulate"])) == tag  # cached by content
    assert docker.from_env().images.get(tag).id == built
    data = tmp_path / "data"
    data.mkdir()
    (data / "table.txt").write_text("x 1\ny 2\n")
    os.chmod(tmp_path, 0o755)
    agent = (
        "import json, tabulate\n"
        f"rows = [line.split() for line in open({str(data / 'table.txt')!r})]\n"
        "try:\n"
        f"    open({str(data / 'new.txt')!r}, 'w')\n"
        "    writable = True\n"
        "except OSError:\n"
        "    writable = False\n"
        "print(json.dumps({'table': tabulate.tabulate(rows), 'writable': writable}))\n"
    ) + NET_PROBE
    cfg = SandboxConfig(
        kind="docker", image=tag, timeout_s=120, gateway_socket=fake_gateway, ro_binds=[str(data)]
    )
    with open_sandbox(cfg) as sb:
        sb.put_files({"agent.py": agent})
        res = sb.run(["python3", "agent.py", str(canary_port)])
    assert res.status == "ok", res
    mine, net = (json.loads(line) for line in res.stdout.strip().splitlines()[-2:])
    assert mine == {"table": "-  -\nx  1\ny  2\n-  -", "writable": False}
    assert net["gateway"]["path"] == "/v1/whoami"
    assert [net[k] for k in ("canary", "dns", "outside")].count("reached") == 0, net
    assert leftover_containers() == []
