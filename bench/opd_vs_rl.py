"""On-policy distillation against RL alone, per optimizer step, from the two runs' directories.

    python bench/opd_vs_rl.py OPD_RUN RL_RUN [--out opd_vs_rl.png]

The two runs are `recipes/opd_multi_teacher.yaml` and its RL-alone line (the recipe header
gives both commands). Plots, in one figure, the held-out success rate of every eval split
(`eval/<tag>/success_rate`) and the reverse KL to the routed teachers (`distill/reverse_kl`,
logged by both arms: the RL arm keeps the teachers as measures) against the step, one line per
arm; prints the same as a table, and each run's wall time. Steps compare across machines and
loads; wall times do not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def curves(run_dir: Path) -> tuple[dict[str, dict[int, float]], float]:
    """Metric -> {step: value} for every eval success rate and the reverse KL; the wall time."""
    from trainer.metrics import METRICS_FILE, read_metrics

    rows = read_metrics(run_dir / METRICS_FILE)
    if not rows:
        sys.exit(f"{run_dir}: no {METRICS_FILE}; give the run directory of a finished run")
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            wanted = key.startswith("eval/") and key.endswith("/success_rate")
            if (wanted or key == "distill/reverse_kl") and value is not None:
                out.setdefault(key, {})[row["step"]] = value
    return out, max(r["time_s"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("opd", type=Path, help="run directory of the distillation run")
    parser.add_argument("rl", type=Path, help="run directory of the RL-alone run")
    parser.add_argument("--out", type=Path, default=Path("opd_vs_rl.png"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {"OPD (teachers)": curves(args.opd), "RL alone (GRPO)": curves(args.rl)}
    keys = sorted({k for c, _ in arms.values() for k in c if k.startswith("eval/")})
    keys.append("distill/reverse_kl")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for label, (series, _) in arms.items():
            points = sorted(series.get(key, {}).items())
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, label=label)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"figure: {args.out}")

    for label, (series, wall) in arms.items():
        print(f"\n{label}: wall {wall / 60:.1f} min")
        steps = sorted({s for k in keys for s in series.get(k, {})})
        print("step  " + "  ".join(f"{k:>24}" for k in keys))
        for step in steps:
            cells = (series.get(k, {}).get(step) for k in keys)
            print(
                f"{step:>4}  " + "  ".join(f"{'' if v is None else f'{v:.3f}':>24}" for v in cells)
            )


if __name__ == "__main__":
    main()
