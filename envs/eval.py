"""`python -m envs.eval env=... n=...`: the older name of `python -m trainer.eval` (same keys).

Evaluation is rollouts through the trainer's AgentFlow (one rollout path for training and
evaluation, with the same forced sampling and metrics for every agent kind), and `envs` imports
nothing of the trainer, so this entry point hands its command line to `python -m trainer.eval`
in a new interpreter instead of importing it.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "trainer.eval", *args])


if __name__ == "__main__":
    main()
