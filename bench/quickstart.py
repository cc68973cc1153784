"""The quickstart, this build against the build before issue 12 with `train.dtype=fp32`.

    python bench/quickstart.py [--steps 10] [--seed 0] [--only baseline|this] [--baseline REF]
                               [--out DIR] [key=value ...]

Runs `python -m trainer.run recipe=quickstart run.steps=N` twice on this machine, one after
the other: first the `--baseline` commit (extracted with `git archive`; default: the build the
issue measured, whose recipe asked for bf16) with `train.dtype=fp32`, its fastest setting on
CPUs without native bf16; then this working tree with the recipe's own defaults (`dtype:
auto`) and the `key=value` overrides given, if any. Prints the CPU, each run's wall time and
held-out `eval/success_rate` first -> last, and the wall-time ratio. Each run takes 15-40
minutes on 2 cores; run it on a quiet machine.
One run per build says little about learning (GRPO on 32 samples a step varies a lot from seed
to seed): compare several `--seed`s, one build at a time with `--only`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "ece30939edd9194d87f9e903fe0e41dd258196c8"
"""main when issue 12 was filed."""


def run(tree: Path, run_dir: Path, steps: int, overrides: list[str]) -> tuple[float, list[dict]]:
    """Wall seconds of one quickstart run in source tree `tree`, and its metrics.jsonl."""
    argv = [sys.executable, "-m", "trainer.run", "recipe=quickstart", f"run.steps={steps}"]
    argv += [f"run.dir={run_dir}", "logging.progress=false", *overrides]
    env = os.environ | {"PYTHONPATH": str(tree)}
    start = time.perf_counter()
    subprocess.run(argv, cwd=tree, env=env, check=True)
    seconds = time.perf_counter() - start
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return seconds, [json.loads(line) for line in lines if line.strip()]


def success(metrics: list[dict]) -> str:
    rates = [m["eval/success_rate"] for m in metrics if m.get("eval/success_rate") is not None]
    return f"{rates[0]:.2f} -> {rates[-1]:.2f}" if rates else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="run.seed of both runs")
    parser.add_argument("--only", choices=("baseline", "this"), help="run one build only")
    parser.add_argument("--baseline", default=BASELINE, help="git ref of the build to beat")
    parser.add_argument("--out", default="", help="keep both run directories here")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for this build's run")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from gateway import machine

    print(machine.describe(), flush=True)
    with tempfile.TemporaryDirectory(prefix="loongsage-quickstart-") as tmp:
        out = Path(args.out or tmp)
        old_tree = Path(tmp) / "baseline"
        if args.only != "this":  # the baseline's source tree, only when it runs
            old_tree.mkdir()
            archive = subprocess.run(
                ["git", "archive", args.baseline], cwd=ROOT, check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        results = {}
        builds = {
            "baseline": (f"baseline {args.baseline[:10]}, train.dtype=fp32", old_tree,
                         ["train.dtype=fp32"]),
            "this": (f"this build, {' '.join(args.overrides) or 'recipe defaults'}", ROOT,
                     args.overrides),
        }  # fmt: skip
        for key, (name, tree, overrides) in builds.items():
            if args.only not in (None, key):
                continue
            folder = name.split(",")[0].replace(" ", "_")
            folder += f"_seed{args.seed}" if args.seed else ""
            seconds, metrics = run(
                tree, out / folder, args.steps, [*overrides, f"run.seed={args.seed}"]
            )
            results[name] = seconds
            print(
                f"{name}: {seconds / 60:.1f} min, eval/success_rate {success(metrics)}", flush=True
            )
    if len(results) < 2:
        return
    old, new = results.values()
    print(f"wall time, this build / baseline: {new / old:.2f} ({old / new:.2f}x faster)")


if __name__ == "__main__":
    main()
