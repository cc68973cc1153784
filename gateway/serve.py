"""`python -m gateway.serve [key=value ...]`: run the gateway over HTTP.

Defaults: the embedded model on the local engine, http://127.0.0.1:8000, auth=open (the API key
is the session id), so any agent works with `OPENAI_BASE_URL=http://127.0.0.1:8000/v1`.
`python -m gateway.serve --help` lists every key (`GatewayConfig` in `gateway.server`).
Examples:

    python -m gateway.serve model=tiny port=8001 uds=/tmp/gateway.sock
    python -m gateway.serve auth=keys admin_token=secret engine.kind=sglang \\
        engine.urls=[http://gpu1:30000,http://gpu2:30000]
"""

from __future__ import annotations

import asyncio
import signal
import sys

from gateway.config import ConfigError, parse_cli
from gateway.models import resolve_model
from gateway.server import Gateway, GatewayConfig

__all__ = ["GatewayConfig", "main", "serve"]


async def serve(cfg: GatewayConfig) -> None:
    """Build the engine and the gateway, listen, and run until SIGINT/SIGTERM."""
    gateway = Gateway.from_config(cfg)
    try:
        server = await gateway.start_http(cfg.host, cfg.port, cfg.uds)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        where = server.base_url + (f" and unix:{cfg.uds}" if cfg.uds else "")
        print(
            f"[loongsage] gateway ready on {where} serving {gateway.model_name!r} "
            f"(engine={cfg.engine.kind}, auth={cfg.auth})",
            flush=True,
        )
        print(f"[loongsage]   OPENAI_BASE_URL={server.base_url}/v1", flush=True)
        if cfg.auth == "keys":
            print(f"[loongsage]   admin token: {gateway.admin_token}", flush=True)
        waiter = asyncio.ensure_future(server.wait())
        await asyncio.wait(
            [waiter, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        await server.stop()
    finally:
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
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
