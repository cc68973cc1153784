"""`python -m sandbox.run [key=value ...] -- CMD ...`: run one command in a sandbox, print JSON.

    python -m sandbox.run backend=docker gateway=/tmp/gateway.sock timeout_s=60 \\
        files=[examples/agents/openai_tool_agent.py] -- python3 openai_tool_agent.py "2+3*4"

prints one line `{"status", "exit_code", "reason", "duration_s", "stdout_tail", "stderr_tail",
"isolation"}` and exits 0 when the status is `ok`, 1 otherwise (2 for a bad command line).
`gateway` is the gateway's Unix socket, or its URL (`http://127.0.0.1:8000/v1`, also with a
`/sessions/ID/v1` path): a URL is reached through a relay on the host (`tcp_relay`), since the
sandbox itself has no network. `--help` lists every key.
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
from sandbox.base import DEFAULT_IMAGE, SandboxConfig, SandboxError, open_sandbox
from sandbox.forwarder import serve


@dataclasses.dataclass
class RunConfig:
    backend: Literal["docker", "local"] = "local"
    """Sandbox backend."""
    gateway: str | None = None
    """Gateway Unix socket path or http:// URL; None = no way out at all."""
    api_key: str = "EMPTY"
    """OPENAI_API_KEY inside (a session's key)."""
    timeout_s: float = 300.0
    """Wall-time limit, seconds."""
    image: str = DEFAULT_IMAGE
    """Docker image (backend=docker)."""
    memory_mb: int = 1024
    """Memory limit, MiB."""
    cpus: float = 1.0
    """CPU limit."""
    pids: int = 128
    """Process limit."""
    local_isolation: Literal["auto", "bwrap", "process"] = "auto"
    """backend=local: bwrap namespaces, or a bare process group (less isolation)."""
    files: list[str] = dataclasses.field(default_factory=list)
    """Host files (or folders) copied into the work dir, by name, before the run."""
    tail_chars: int = 2000
    """Characters of stdout/stderr kept in the printed JSON."""


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


def read_files(paths: list[str]) -> dict[str, bytes]:
    """Host files/folders -> {relative name in the work dir: bytes}."""
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
        socket_path, api_path = cfg.gateway, "/v1"
        if cfg.gateway and "://" in cfg.gateway:
            socket_path, api_path = stack.enter_context(tcp_relay(cfg.gateway))
        sb_cfg = SandboxConfig(
            kind=cfg.backend,
            image=cfg.image,
            memory_mb=cfg.memory_mb,
            cpus=cfg.cpus,
            pids=cfg.pids,
            timeout_s=cfg.timeout_s,
            gateway_socket=socket_path,
            gateway_path=api_path,
            api_key=cfg.api_key,
            local_isolation=cfg.local_isolation,
        )
        sb = stack.enter_context(open_sandbox(sb_cfg))
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
