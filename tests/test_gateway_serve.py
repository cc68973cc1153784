"""`python -m gateway.serve`: says when it is ready, answers on TCP and the Unix socket, stops
cleanly on SIGTERM, and rejects bad keys with the closest valid one."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import pytest


@pytest.mark.slow
def test_serve_ready_health_uds_and_sigterm(tmp_path, tiny_model_path):
    sock = tmp_path / "gw.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve", "model=tiny", "port=0", f"uds={sock}",
         "auth=keys", "admin_token=secret"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + 180
        lines = []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"gateway ready on (http://[\d.]+:\d+)", line):
                url = m.group(1)
        assert url, "".join(lines)
        assert httpx.get(url + "/health").status_code == 200
        admin = {"Authorization": "Bearer secret"}
        created = httpx.post(url + "/sessions", json={}, headers=admin).json()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as h:
            r = h.post(
                "http://gw/v1/chat/completions",
                headers={"Authorization": f"Bearer {created['api_key']}"},
                json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2},
            )  # fmt: skip
            assert r.status_code == 200
            traj = h.get(f"http://gw/sessions/{created['id']}/trajectory", headers=admin).json()
            assert len(traj["turns"][0]["output_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_bad_keys():
    out = subprocess.run(
        [sys.executable, "-m", "gateway.serve", "prot=1"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "did you mean port?" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "gateway.serve", "engine.kind=sglang"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "engine.urls" in out.stderr
