"""The sandbox's only way out: a TCP -> Unix-socket forwarder that also launches the agent.

Runs *inside* a sandbox (pure standard library, any Python 3.8+, so it works in any image with
`python3`). It listens on `127.0.0.1:PORT`, forwards every connection byte for byte to the
gateway's Unix socket (bound into the sandbox), and then runs the agent command with
`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`, so an unmodified OpenAI-SDK program reaches the
gateway and nothing else (the sandbox has no network). Streaming (SSE) works because bytes are
passed through as they arrive. It exits with the agent's exit code (128+N when the agent died of
signal N).

    python3 forwarder.py --socket /opt/loongsage/gateway.sock --port 8000 [--path /v1] -- CMD ...

`--port 0` picks a free port (the local backend without a network namespace uses it, since
several sandboxes then share the host's loopback). Without CMD it just forwards until killed.

The host side reuses `pump` and `serve` to relay a Unix socket to a TCP gateway
(`python -m sandbox.run gateway=http://...`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

BUFSIZE = 65536


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy bytes src -> dst until EOF, then half-close dst so the other side sees EOF too."""
    try:
        while True:
            data = src.recv(BUFSIZE)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(client: socket.socket, connect) -> None:
    try:
        upstream = connect()
    except OSError as e:
        sys.stderr.write(f"[loongsage-forwarder] cannot reach the gateway: {e}\n")
        client.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, connect) -> None:
    """Accept forever on `listener`; relay each connection to a fresh `connect()` socket."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return  # listener closed
        threading.Thread(target=_relay, args=(client, connect), daemon=True).start()


def unix_connector(path: str):
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    return connect


def main(argv: list[str]) -> int:
    sock_path, port, path = "", 8000, "/v1"
    cmd: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            cmd = argv[i + 1 :]
            break
        if arg in ("--socket", "--port", "--path") and i + 1 < len(argv):
            value = argv[i + 1]
            if arg == "--socket":
                sock_path = value
            elif arg == "--port":
                port = int(value)
            else:
                path = value
            i += 2
            continue
        sys.stderr.write(f"[loongsage-forwarder] unknown argument {arg!r}\n")
        return 2
    if not sock_path:
        sys.stderr.write("[loongsage-forwarder] --socket PATH is required\n")
        return 2

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    port = listener.getsockname()[1]
    threading.Thread(target=serve, args=(listener, unix_connector(sock_path)), daemon=True).start()
    if not cmd:
        threading.Event().wait()
        return 0

    env = dict(os.environ)
    env.setdefault("OPENAI_BASE_URL", f"http://127.0.0.1:{port}{path}")
    try:
        agent = subprocess.Popen(cmd, env=env)
    except OSError as e:
        sys.stderr.write(f"[loongsage-forwarder] cannot start {cmd[0]!r}: {e}\n")
        return 127

    def forward(signum, _frame):
        agent.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    code = agent.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
