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


def test_opd_vs_rl_averages_the_seeds_of_each_arm(tmp_path):
    def run(name: str, calc: list[float], kl: float) -> Path:
        rows = [{"step": 0, "time_s": 1.0, "eval/calc/success_rate": calc[0]},
                {"step": 1, "time_s": 60.0, "distill/reverse_kl": kl},
                {"step": 2, "time_s": 120.0, "eval/calc/success_rate": calc[1]}]  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
        return tmp_path / name

    opd = [run("opd0", [0.25, 0.5], 0.2), run("opd1", [0.25, 0.75], 0.4)]
    rl = [run("rl0", [0.25, 0.0], 0.5)]
    cmd = [sys.executable, str(ROOT / "bench" / "opd_vs_rl.py"), "--opd", *map(str, opd),
           "--rl", *map(str, rl), "--out", str(tmp_path / "fig.png")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    opd_table, rl_table = proc.stdout.split("RL alone")
    assert "mean of 2 run(s)" in opd_table and "wall 2.0, 2.0 min" in opd_table
    lines = {
        line.split()[0]: line.split()[1:]
        for line in opd_table.splitlines()
        if line[:4].strip().isdigit()
    }
    assert lines == {"0": ["0.250", "0.25/0.25"], "1": ["0.300", "0.20/0.40"],
                     "2": ["0.625", "0.50/0.75"]}  # fmt: skip
    assert "   2  " in rl_table and "0.000" in rl_table
    assert (tmp_path / "fig.png").stat().st_size > 0
