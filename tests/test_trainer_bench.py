"""The benchmarks run end to end and report every setting (slow: short real runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_async_bench_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "async.py"), "steps=3", "batch_size=2",
           "num_samples_per_prompt=2", "max_tokens=32", "tool_s=0.05", f"out={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["max_staleness"] for r in results] == [0, 1, 2]
    assert results[0]["staleness_max"] == 0
    assert all(
        r["trained_tokens_per_s"] > 0 and r["staleness_max"] <= r["max_staleness"] for r in results
    )
    assert "vs sync" in proc.stdout


@pytest.mark.slow
def test_transfer_mesh_bench_smoke():
    cmd = [sys.executable, str(ROOT / "bench" / "transfer_mesh.py"), "sizes_mb=[20]",
           "receivers=[1,2]", "repeats=1", "stall_pushes=1", "pipeline_bucket_mb=4"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "memcpy (one core, 1 GB):" in out
    for route in ("in_process", "shm", "broadcast", "disk"):
        assert f"| {route} | 20 MB | 1 |" in out and f"| {route} | 20 MB | 2 |" in out
    assert "to gather each bucket" in out and "| Ray actor | abort_resubmit | shm |" in out
