"""Hand-made mutants the test suite must kill: proof that its fidelity and staleness tests can fail.

Each mutant is one textual edit to one source line, a bug this system must never ship: re-encode
an assistant's text instead of reusing the sampled ids, train on a tool result, let the staleness
window slip by one, skip the stale drop, stop waiting for old groups, divide the logits by the
wrong temperature, let stale tokens into the numerical-gap metric. For each, the script copies
the repository's tracked files to a scratch directory, applies the edit there (the working tree
is never touched), runs the tests named for it, and reports the mutant `killed` when they fail.
An edit whose text is no longer in the file is an error: update the mutant with the code.

    python scripts/mutants.py            # all mutants; exit 1 if any survives
    python scripts/mutants.py --list
    python scripts/mutants.py staleness_off_by_one skip_stale_drop

CI runs it through the slow test `tests/test_mutants.py`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    """pytest node ids (or files) that must fail with the mutant applied."""


ORACLE = "tests/test_token_oracle.py::test_multi_turn_sessions_match_the_engine"
SPLIT_IDS = "tests/test_token_oracle.py::test_ids_no_tokenizer_would_write_go_back_verbatim"
TRAINING = "tests/test_multiturn_training.py::test_multi_turn_and_forked_sessions_train_on_exactly_the_sampled_tokens"  # noqa: E501
LONG_TAIL = (
    "tests/test_staleness_stress.py::test_long_rollouts_are_trained_at_the_edge_of_the_window"  # noqa: E501
)
LAGGING = (
    "tests/test_staleness_stress.py::test_groups_from_a_lagging_receiver_are_dropped_and_counted"  # noqa: E501
)

MUTANTS = [
    Mutant(
        "retokenize_history",
        "gateway/render.py",
        "        if best_ids is not None:\n",
        "        if False:  # re-render (re-encode) the whole history from its text\n",
        (SPLIT_IDS, ORACLE),
    ),
    Mutant(
        "train_on_tool_results",
        "gateway/trajectory.py",
        "self.loss_mask += [0] * len(new_prompt) + [1] * len(turn.output_ids)",
        "self.loss_mask += [int(bool(self.loss_mask))] * len(new_prompt) + [1] * len(turn.output_ids)",  # noqa: E501
        (ORACLE,),
    ),
    Mutant(
        "staleness_off_by_one",
        "trainer/buffer.py",
        "version - self._oldest(g, version) <= self.max_staleness]",
        "version - self._oldest(g, version) <= self.max_staleness + 1]",
        (LAGGING,),
    ),
    Mutant(
        "skip_stale_drop",
        "trainer/controller.py",
        "stale = self.batcher.drop_stale(self.version)",
        "stale = 0",
        (LAGGING,),
    ),
    Mutant(
        "no_wait_for_old_groups",
        "trainer/controller.py",
        "self.batcher.waiting_for_old(self.version)",
        "False",
        (LONG_TAIL,),
    ),
    Mutant(
        "trainer_wrong_temperature",
        "trainer/backends/torch_backend.py",
        "                z.div_(temperature)\n",
        "                z.div_(temperature**0.5)\n",
        (TRAINING,),
    ),
    Mutant(
        "engine_logprobs_ignore_temperature",
        "gateway/engines/local.py",
        "temps = [p.temperature or 1.0 for p in params]",
        "temps = [1.0 for p in params]",
        (TRAINING,),
    ),
    Mutant(
        "stale_tokens_in_the_numerical_gap",
        "trainer/algorithms.py",
        "fresh = m & (lag == 0)",
        "fresh = m",
        ("tests/test_loss.py", "tests/test_trainer_backend.py"),
    ),
]


def copy_tree(dest: Path) -> None:
    """The tracked files and the untracked ones git does not ignore (the working state)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def run_mutant(m: Mutant, tree: Path, timeout_s: int) -> tuple[str, float, str]:
    """Apply `m` in `tree`, run its tests, restore; -> (killed|SURVIVED|timeout, seconds, tail)."""
    path = tree / m.path
    source = path.read_text()
    if source.count(m.original) != 1:
        raise SystemExit(
            f"mutant {m.name}: the text to mutate occurs {source.count(m.original)} times in "
            f"{m.path} (expected once); update scripts/mutants.py with the code"
        )
    path.write_text(source.replace(m.original, m.mutated))
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "",
           *m.tests]  # fmt: skip
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                             timeout=timeout_s)  # fmt: skip
        verdict = "killed" if out.returncode == 1 else "SURVIVED" if out.returncode == 0 else (
            f"error (pytest exit {out.returncode})")  # fmt: skip
        tail = (out.stdout + out.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        verdict, tail = "timeout", ""
    finally:
        path.write_text(source)
    return verdict, time.monotonic() - start, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:36s} {m.path}  ->  {', '.join(m.tests)}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutant(s) {unknown}; --list shows them")
    chosen = [by_name[n] for n in args.names] if args.names else MUTANTS
    results = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for m in chosen:
            verdict, seconds, tail = run_mutant(m, tree, args.timeout)
            print(f"{m.name:36s} {verdict:10s} {seconds:6.1f} s", flush=True)
            if verdict != "killed":
                print(tail, flush=True)
            results.append(verdict)
    killed = results.count("killed")
    print(f"{killed}/{len(results)} mutants killed")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
