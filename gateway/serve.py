"""`python -m gateway.serve [key=value ...]`: run the gateway over HTTP.

Defaults: the embedded model on the local engine, http://127.0.0.1:8000, auth=open (each API key
opens a session of its own), so any agent works with `OPENAI_BASE_URL=http://127.0.0.1:8000/v1`.
`python -m gateway.serve --help` lists every key (`GatewayConfig` in `gateway.server`).
Examples:

    python -m gateway.serve model=tiny port=8001 uds=/tmp/gateway.sock log_dir=runs/gw
    python -m gateway.serve auth=keys admin_token=secret engine.kind=sglang \\
        engine.urls=[http://gpu1:30000,http://gpu2:30000]

Admin routes always need the admin token. Without `admin_token=...` a random one is made at
start, printed, and written to `$LOONGSAGE_HOME/gateway/admin-<port>.token` (mode 0600, removed
at exit), as Jupyter does with its token.

Stopping: the first SIGTERM/SIGINT stops admitting requests (503), lets running ones finish for
up to `shutdown_grace_s`, then aborts them, closes every open session as `aborted: shutdown`
(written to `log_dir` when set) and exits 0. A second signal exits at once (status 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from uvicorn.loops.auto import auto_loop_factory

from gateway.config import ConfigError, parse_cli
from gateway.models import loongsage_home, resolve_model
from gateway.server import Gateway, GatewayConfig

__all__ = ["GatewayConfig", "main", "serve"]


def write_token_file(token: str, port: int) -> Path:
    """The admin token in a file only this user can read; its path."""
    folder = loongsage_home() / "gateway"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"admin-{port}.token"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


async def serve(cfg: GatewayConfig) -> None:
    """Build the engine and the gateway, listen, and run until SIGINT/SIGTERM."""
    gateway = Gateway.from_config(cfg)
    token_file: Path | None = None
    try:
        server = await gateway.start_http(cfg.host, cfg.port, cfg.uds)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():  # the second signal: no more waiting
                print("[loongsage] second signal: exiting now", file=sys.stderr, flush=True)
                os._exit(1)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        where = server.base_url + (f" and unix:{cfg.uds}" if cfg.uds else "")
        print(
            f"[loongsage] gateway ready on {where} serving {gateway.model_name!r} "
            f"(engine={cfg.engine.kind}, auth={cfg.auth})",
            flush=True,
        )
        print(f"[loongsage]   OPENAI_BASE_URL={server.base_url}/v1", flush=True)
        if cfg.admin_token is None:
            token_file = write_token_file(gateway.admin_token, server.port)
            print(
                f"[loongsage]   admin token: {gateway.admin_token} (also in {token_file})",
                flush=True,
            )
            print(f"[loongsage]   UI: {server.base_url}/ui#token={gateway.admin_token}", flush=True)
        else:
            print(
                f"[loongsage]   UI: {server.base_url}/ui (sign in with the admin token)", flush=True
            )
        if cfg.log_dir:
            print(f"[loongsage]   trajectories: {Path(cfg.log_dir) / 'trajectories.jsonl'}")
        waiter = asyncio.ensure_future(server.wait())
        await asyncio.wait(
            [waiter, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        print("[loongsage] stopping: draining running requests ...", file=sys.stderr, flush=True)
        await gateway.shutdown(then=server.stop)
    finally:
        if token_file is not None:
            with contextlib.suppress(OSError):
                token_file.unlink()
        await gateway.aclose()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_cli(GatewayConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        resolve_model(cfg.model)  # a bad model name is the user's mistake: say so, no traceback
    except ValueError as e:
        print(f"error: model: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # uvicorn's own choice of loop: uvloop where installed (uvicorn[standard] brings it), as
    # the gateway's per-request cost is largely the event loop's
    with asyncio.Runner(loop_factory=auto_loop_factory()) as runner:
        runner.run(serve(cfg))


if __name__ == "__main__":
    main()
