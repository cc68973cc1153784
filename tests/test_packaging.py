"""`pip install loongsage` (no extras) is enough for the main job: every third-party module the
runtime packages import is a declared base dependency (or optional, behind its own extra or a
check that says what to install), and no base dependency goes unused.

The fast test reads the imports of every module (static, all of them, lazy ones included); the
slow one proves it for real: a fresh venv with CPU torch and the base install only imports every
module the main job uses, runs `python -m trainer.run --help`, and builds the tiny model (which
fetches the embedded model's package with pip).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gateway", "envs", "trainer", "sandbox"]
OPTIONAL = {
    "reasoning_gym": ("rgym", "envs/rgym.py: the reasoning-gym env family"),
    "megatron": ("megatron", "trainer/backends/megatron: only train.kind=megatron, which says so"),
    "transformer_engine": (
        None,
        "trainer/backends/megatron/model.py: GPU fused layers when present",
    ),
    "sglang": ("sglang", "trainer/transfer/cuda_ipc.py: the CUDA IPC route, on a GPU node only"),
    "wandb": (None, "trainer/metrics.py: only with logging.wandb=true, which says to install it"),
}
"""Imported by some module but not needed by the main job: its extra (if any), where and why."""
INDIRECT = {
    "gguf": "transformers reads the embedded model's GGUF file with it",
    "accelerate": "transformers needs it to load the GGUF model",
    "tokenizers": "the fast tokenizer behind transformers' AutoTokenizer",
    "ninja": "torch.utils.cpp_extension builds the engine's CPU kernels (gateway/cpu_kernels.cpp)",
}
"""Base dependencies no module imports by name, and why they are needed anyway."""
NOT_IN_MAIN_JOB = {"envs.rgym"}


def _name(requirement: str) -> str:
    name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the files importing it (at any depth, lazily or not)."""
    found: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in PACKAGES and top not in sys.stdlib_module_names:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_declared():
    project = _pyproject()["project"]
    base = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    dists = importlib.metadata.packages_distributions()
    used = set()
    for module, files in sorted(_imports().items()):
        names = {_name(d) for d in dists.get(module, [module])}
        used |= names
        if module in OPTIONAL:
            extra, why = OPTIONAL[module]
            assert extra is None or names & extras, f"{module} ({why}) is in no extra"
            continue
        assert names & base, (
            f"{sorted(files)} import {module!r}, which pyproject.toml does not declare in "
            "[project].dependencies"
        )
    unused = base - used - set(INDIRECT)
    assert not unused, f"declared but never imported (and not in INDIRECT): {sorted(unused)}"


def main_job_modules() -> list[str]:
    modules = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name not in NOT_IN_MAIN_JOB:
                modules.append(name)
    return modules


@pytest.mark.slow
def test_fresh_venv_with_the_base_install_runs_the_main_job(tmp_path):
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)

    def pip(*args: str) -> None:
        done = subprocess.run(
            [str(py), "-m", "pip", "install", "-q", *args], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    pip("torch==2.13.0")  # the CPU wheel on a CPU machine, as the Makefile does; never bare torch
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".*", "runs", "build", "*.egg-info", "__pycache__")
    )
    pip(str(src))  # the base install: no extras, not editable
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["LOONGSAGE_HOME"] = str(tmp_path / "home")
    script = (
        "import importlib, sys\n"
        f"for m in {main_job_modules()!r}:\n"
        "    importlib.import_module(m)\n"
        "import gateway\n"
        f"assert not gateway.__file__.startswith({str(ROOT)!r}), gateway.__file__\n"
        "from gateway.models import resolve_model\n"
        "print(resolve_model('tiny'))\n"
    )
    run = subprocess.run(
        [str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    help_ = subprocess.run(
        [str(py), "-m", "trainer.run", "--help"], cwd=tmp_path, env=env, capture_output=True
    )
    assert help_.returncode == 0 and b"rollout.max_tokens" in help_.stdout, help_.stderr[-2000:]
