"""Teacher model folders: embedded names resolved, and teachers made by RL recipes (once).

A teacher with `recipe` (instead of `model`) is the final model of that `trainer.run` command.
It is run in a child process before anything of the distillation run is loaded (its own Ray,
engines and trainer come and go with it), and its `final/` folder is cached as
`$LOONGSAGE_HOME/models/teacher-<name>-<hash>`, where the hash covers the teacher run's whole
resolved config (recipe contents and overrides, minus where the run writes and how it is shown:
`run.dir`, `logging`): change the recipe and the teacher is made again; rerun the distillation
and it is reused. The teacher run's own
directory (metrics, plots) is kept next to it as `...-run`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from gateway.config import ConfigError, to_dict
from gateway.engines import ENGINES
from gateway.models import cached_build, loongsage_home, resolve_model
from trainer.teachers.config import DistillConfig


def teacher_models(cfg: DistillConfig) -> dict[str, Path | None]:
    """Teacher name -> its model folder (None: a remote teacher whose servers hold a model this
    machine cannot read), making recipe teachers that are not cached yet."""
    out: dict[str, Path | None] = {}
    for name, teacher in cfg.teachers.items():
        if teacher.recipe:
            out[name] = made_teacher(name, teacher.recipe)
            continue
        try:
            out[name] = resolve_model(teacher.model)
        except ValueError as e:
            if not ENGINES.attrs(teacher.engine.kind)["remote"]:
                raise ConfigError(f"algorithm.distill.teachers.{name}.model: {e}") from None
            out[name] = None
    return out


def made_teacher(name: str, argv: list[str]) -> Path:
    """The final model of `python -m trainer.run *argv`, made once and cached."""
    from trainer.config import load  # the trainer's config holds this package's: import late

    try:
        resolved = to_dict(load(list(argv)))
    except ConfigError as e:
        raise ConfigError(f"algorithm.distill.teachers.{name}.recipe: {e}") from None
    resolved["run"].pop("dir")
    resolved.pop("logging")  # a progress bar or W&B does not change what the teacher learns
    digest = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:12]
    key = f"teacher-{name}-{digest}"
    run_dir = loongsage_home() / "models" / f"{key}-run"

    def build(folder: Path) -> None:
        print(f"[loongsage] making teacher {name!r}: python -m trainer.run {' '.join(argv)} "
              f"(once; cached as {key})", file=sys.stderr, flush=True)  # fmt: skip
        (run_dir / "teacher.yaml").parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "teacher.yaml").write_text(yaml.safe_dump({"argv": list(argv)}))
        command = [sys.executable, "-m", "trainer.run", *argv, f"run.dir={run_dir}",
                   "run.resume=auto"]  # fmt: skip
        done = subprocess.run(command, env=os.environ.copy())
        if done.returncode != 0:
            raise ConfigError(
                f"teacher {name!r}: its run failed (exit {done.returncode}); its directory is "
                f"{run_dir} (it resumes from its last checkpoint when run again)"
            )
        shutil.copytree(run_dir / "final", folder, dirs_exist_ok=True)

    return cached_build(key, build)
