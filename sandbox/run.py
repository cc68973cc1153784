"""`python -m sandbox.run [key=value ...] -- CMD ...`: run one command in a sandbox, print JSON.

    python -m sandbox.run backend=docker gateway=/tmp/gateway.sock timeout_s=60 \\
        files=[examples/agents/openai_tool_agent.py] -- python3 openai_tool_agent.py "2+3*4"

    # an agent in its own venv, under bubblewrap, with its settings in env vars
    python -m sandbox.run backend=local gateway=/tmp/gateway.sock ro_binds=[/opt/agents/mini] \\
        env={MSWEA_CONFIGURED: "true"} -- /opt/agents/mini/bin/mini ...

prints one line `{"status", "exit_code", "reason", "duration_s", "stdout_tail", "stderr_tail",
"isolation"}` and exits 0 when the status is `ok`, 1 otherwise (2 for a bad command line).
Every `SandboxConfig` key (`sandbox/base.py`) is a key here, spelled as under a recipe's
`agent.sandbox` (`ro_binds`, `env`, `image`, `memory_mb`, ...), for both backends; `backend`
is `kind`. `gateway` is the gateway's Unix socket, or its URL (`http://127.0.0.1:8000/v1`, also
with a `/sessions/ID/v1` path): a URL is reached through a relay on the host (`tcp_relay`),
since the sandbox itself has no network. `files` are copied into the work dir: a list of host
paths (by name), or `{work path: host path}` like a recipe's `agent.files`. `--help` lists every
key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from gateway.config import ConfigError, parse_cli
from sandbox.base import SandboxConfig, SandboxError, open_sandbox
from sandbox.forwarder import serve


@dataclasses.dataclass
class RunConfig(SandboxConfig):
    """The sandbox's own keys, plus what only the command line needs."""

    backend: Literal["docker", "local"] | None = None
    """Sandbox backend; the same as `kind`, which it overrides when set."""
    gateway: str | None = None
    """Gateway Unix socket path or http:// URL; None = no way out at all."""
    files: list[str] | dict[str, str] = dataclasses.field(default_factory=list)
    """Copied into the work dir before the run: host files/folders by name, or {work path: host file}."""
    tail_chars: int = 2000
    """Characters of stdout/stderr kept in the printed JSON."""

    def sandbox_config(self, gateway_socket: str | None, gateway_path: str) -> SandboxConfig:
        """The `SandboxConfig` part, with the backend and the gateway's socket filled in."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(SandboxConfig)}
        own.update(gateway_socket=gateway_socket, gateway_path=gateway_path)
        if self.backend is not None:
            own["kind"] = self.backend
        return SandboxConfig(**own)


@contextlib.contextmanager
def tcp_relay(url: str) -> Iterator[tuple[str, str]]:
    """A Unix socket on the host relaying to the TCP gateway at `url` -> (socket path, API path).

    For gateways that listen on TCP only: the sandbox binds the socket in as usual.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"gateway {url!r}: use a Unix socket path or an http://HOST:PORT URL")
    host, port = parts.hostname, parts.port or 80
    path = parts.path.rstrip("/") or "/v1"
    tmp = tempfile.mkdtemp(prefix="loongsage-relay-")
    os.chmod(tmp, 0o755)
    sock_path = os.path.join(tmp, "gateway.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(sock_path)
        os.chmod(sock_path, 0o666)  # the sandbox may run under another uid
        listener.listen(128)
        thread = threading.Thread(
            target=serve,
            args=(listener, lambda: socket.create_connection((host, port))),
            daemon=True,
        )
        thread.start()
        yield sock_path, path
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        shutil.rmtree(tmp, ignore_errors=True)


def read_files(paths: list[str] | dict[str, str]) -> dict[str, bytes]:
    """Host files/folders (or {work path: host file}) -> {relative name in the work dir: bytes}."""
    if isinstance(paths, dict):
        out = {}
        for inside, host in paths.items():
            if not Path(host).is_file():
                raise ValueError(f"files: {host!r} (for {inside!r}) is not a file")
            out[inside] = Path(host).read_bytes()
        return out
    out: dict[str, bytes] = {}
    for p in map(Path, paths):
        if p.is_dir():
            for child in sorted(p.rglob("*")):
                if child.is_file():
                    out[str(Path(p.name) / child.relative_to(p))] = child.read_bytes()
        elif p.is_file():
            out[p.name] = p.read_bytes()
        else:
            raise ValueError(f"files: {str(p)!r} does not exist")
    return out


def run_command(cfg: RunConfig, cmd: list[str]) -> dict:
    """Run `cmd` as `cfg` says; the JSON-able summary (with `isolation`)."""
    files = read_files(cfg.files)
    with contextlib.ExitStack() as stack:
        socket_path, api_path = cfg.gateway_socket, cfg.gateway_path
        if cfg.gateway and "://" in cfg.gateway:
            socket_path, api_path = stack.enter_context(tcp_relay(cfg.gateway))
        elif cfg.gateway:
            socket_path = cfg.gateway
        sb = stack.enter_context(open_sandbox(cfg.sandbox_config(socket_path, api_path)))
        if files:
            sb.put_files(files)
        result = sb.run(cmd)
        return {**result.summary(cfg.tail_chars), "isolation": sb.isolation}


def main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        keys, cmd = argv[:i], argv[i + 1 :]
    else:
        keys, cmd = argv, []
    try:
        cfg = parse_cli(RunConfig, keys)
        if not cmd:
            raise ConfigError("no command: write it after `--`, e.g. -- python3 agent.py")
        summary = run_command(cfg, cmd)
    except (ValueError, SandboxError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
