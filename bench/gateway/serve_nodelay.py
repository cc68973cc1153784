"""`python -m gateway.serve`, except that uvicorn opens the listening socket itself.

`gateway.server.HttpServer` binds `socket.socket(AF_INET)`, whose `proto` is 0; asyncio's
accepted-connection transports set TCP_NODELAY only when `proto == IPPROTO_TCP`, so every
keep-alive response waits for the client's delayed ACK (about 40 ms on Linux). This launcher
serves the same app, on the same (stock asyncio) loop, from uvicorn's own socket, so the
benchmark can show the gateway with and without that one-line difference.

Run: `python bench/gateway/serve_nodelay.py [gateway.serve keys ...]`.
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from gateway.config import parse_cli
from gateway.server import Gateway, GatewayConfig


async def serve(cfg: GatewayConfig) -> None:
    gateway = Gateway.from_config(cfg)
    config = uvicorn.Config(
        gateway.app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    try:
        await server.serve()
    finally:
        await gateway.aclose()


if __name__ == "__main__":
    asyncio.run(serve(parse_cli(GatewayConfig, sys.argv[1:])))
