"""On-policy distillation against RL alone, per optimizer step, from the runs' directories.

    python bench/opd_vs_rl.py --opd OPD_RUN [...] --rl RL_RUN [...] [--out opd_vs_rl.png]

The runs are `recipes/opd_multi_teacher.yaml` and its RL-alone line (the recipe header gives
both commands), one directory per seed. Plots, in one figure, the held-out success rate of
every eval split (`eval/<tag>/success_rate`) and the reverse KL to the routed teachers
(`distill/reverse_kl`, logged by both arms: the RL arm keeps the teachers as measures) against
the step: each arm's mean over its seeds, each seed as a thin line; prints the means as a table
(the seeds' values after each), and each run's wall time. Steps compare across machines and
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
    parser.add_argument("--opd", type=Path, nargs="+", required=True, help="distillation runs")
    parser.add_argument("--rl", type=Path, nargs="+", required=True, help="RL-alone runs")
    parser.add_argument("--out", type=Path, default=Path("opd_vs_rl.png"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {
        "OPD (teachers)": [curves(d) for d in args.opd],
        "RL alone (GRPO)": [curves(d) for d in args.rl],
    }
    keys = sorted(
        {k for runs in arms.values() for c, _ in runs for k in c if k.startswith("eval/")}
    )
    keys.append("distill/reverse_kl")
    means = {label: {k: mean(runs, k) for k in keys} for label, runs in arms.items()}
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for color, (label, runs) in zip(("C0", "C1"), arms.items(), strict=True):
            if len(runs) > 1:  # each seed, thin, under the mean
                for series, _ in runs:
                    points = sorted(series.get(key, {}).items())
                    ax.plot([p[0] for p in points], [p[1] for p in points], "-", c=color,
                            lw=0.6, alpha=0.4)  # fmt: skip
            points = means[label][key].items()
            ax.plot([p[0] for p in points], [p[1][0] for p in points], "o-", c=color, ms=3,
                    label=f"{label}, {len(runs)} seed(s)")  # fmt: skip
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"figure: {args.out}")

    for label, runs in arms.items():
        walls = ", ".join(f"{wall / 60:.1f}" for _, wall in runs)
        print(
            f"\n{label}: mean of {len(runs)} run(s) (the runs' values after it); wall {walls} min"
        )
        steps = sorted({s for m in means[label].values() for s in m})
        print("step  " + "  ".join(f"{k:>30}" for k in keys))
        for step in steps:
            cells = []
            for k in keys:
                m, values = means[label][k].get(step, (None, []))
                seeds = "/".join(f"{v:.2f}" for v in values) if len(values) > 1 else ""
                cells.append("" if m is None else f"{m:.3f} {seeds}".rstrip())
            print(f"{step:>4}  " + "  ".join(f"{c:>30}" for c in cells))


def mean(
    runs: list[tuple[dict[str, dict[int, float]], float]], key: str
) -> dict[int, tuple[float, list[float]]]:
    """Step -> (mean over the runs that logged `key` at that step, their values)."""
    by_step: dict[int, list[float]] = {}
    for series, _ in runs:
        for step, value in series.get(key, {}).items():
            by_step.setdefault(step, []).append(value)
    return {step: (sum(v) / len(v), v) for step, v in sorted(by_step.items())}


if __name__ == "__main__":
    main()
