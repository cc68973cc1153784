"""Three teachers under a memory budget that fits one, against all three resident, in one run.

    python bench/teachers.py [--model smollm2] [--sequences 48] [--tokens 160] [--waves 4]

The teachers are three copies of `--model` in their own folders (own files, so no page cache is
shared between them). The same workload runs through two TeacherManagers, one after the other
in this process: `--sequences` sequences of `--tokens` random token ids, routed round-robin to
the three teachers, arriving in `--waves` waves (rollouts finish in bursts), each sequence
scored from its 8th token on. "budget=1" has `memory_budget` = 1.5 x one teacher's weights, so
only one is resident at a time and the others are swapped in from disk; "all resident" has no
budget. Reported per side: scoring tokens/s (scored tokens over the wall time, swaps included),
swaps, the manager's resident bytes (max) and the peak RSS sampled every 5 ms minus the RSS
before (`bench.engine.peak_rss_during`: measured, not assumed). Both sides also report whether
their scores agree (they must: the same models).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
from pathlib import Path

from bench.engine import peak_rss_during, rss_bytes
from gateway.models import model_name, resolve_model
from trainer.teachers.config import DistillConfig, TeacherConfig
from trainer.teachers.manager import TeacherManager
from trainer.teachers.residency import release_freed_memory, weight_bytes

TEACHERS = ("t0", "t1", "t2")


def workload(n: int, tokens: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    return [
        (TEACHERS[i % 3], [1] + [rng.randrange(20, 40000) for _ in range(tokens - 1)])
        for i in range(n)
    ]


async def run(cfg: DistillConfig, paths: dict, jobs, waves: int) -> tuple[list, dict]:
    async with TeacherManager(cfg, paths) as manager:
        size = -(-len(jobs) // waves)
        scores = []
        for w in range(waves):
            wave = jobs[w * size : (w + 1) * size]
            scores += await asyncio.gather(
                *(manager.score_tokens(name, [ids], [8]) for name, ids in wave)
            )
        return scores, manager.metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--waves", type=int, default=4)
    args = parser.parse_args()
    source = resolve_model(args.model)
    size = weight_bytes(source, "float32")
    jobs = workload(args.sequences, args.tokens)
    scored = sum(len(ids) - 8 for _, ids in jobs)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {n: shutil.copytree(source, Path(tmp) / n) for n in TEACHERS}
        teachers = {n: TeacherConfig(model=str(p)) for n, p in paths.items()}
        route = {n: n for n in TEACHERS}
        sides = {
            "budget=1": DistillConfig(
                teachers=teachers, route=route, memory_budget=str(int(1.5 * size)), linger_s=0.2
            ),
            "all resident": DistillConfig(teachers=teachers, route=route),
        }
        print(
            f"{model_name(args.model)}: 3 teachers of {size / 1e6:.0f} MB (fp32), "
            f"{args.sequences} sequences x {args.tokens} tokens in {args.waves} waves"
        )
        print(f"{'':14}{'tokens/s':>10}{'swaps':>7}{'resident max MB':>17}{'peak RSS MB':>13}")
        results = {}
        for side, cfg in sides.items():
            release_freed_memory()
            before = rss_bytes()
            (scores, metrics), seconds, peak = peak_rss_during(
                lambda cfg=cfg: asyncio.run(run(cfg, paths, jobs, args.waves))
            )
            results[side] = scores
            print(
                f"{side:14}{scored / seconds:>10.0f}{metrics['teachers/swaps']:>7.0f}"
                f"{metrics['teachers/resident_bytes_max'] / 1e6:>17.0f}"
                f"{(peak - before) / 1e6:>13.0f}"
            )
        a, b = results.values()
        same = max(
            abs(x - y)
            for ra, rb in zip(a, b, strict=True)
            for x, y in zip(ra[0], rb[0], strict=True)
        )
        print(f"largest score difference between the sides: {same:.2e}")


if __name__ == "__main__":
    main()
