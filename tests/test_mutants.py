"""The suite kills every hand-made mutant of scripts/mutants.py (slow: each mutant reruns the
tests named for it in a scratch copy of the repository)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_mutant_is_killed():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=3500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "mutants killed" in proc.stdout and "SURVIVED" not in proc.stdout
