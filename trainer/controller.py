"""The controller: one process, one loop, for synchronous and asynchronous RL alike.

    admission ──────────► rollouts ──────────► batcher ──────────► train step ──► weight push
    (_admit)              (_sample, N per       (GroupBatcher:      (backend,       (WeightPush,
    waits: the staleness   group, concurrent)   group complete?     in a thread)    every engine)
    window opens           waits: engines       filter, queue)      waits: a full   then version += 1
    (gate.version moves)                                            batch of groups and the window moves
         ▲                                                                              │
         └──────────────────────────────────────────────────────────────────────────────┘

Admission and rollouts run as asyncio tasks next to the train loop, so generation continues
while the trainer trains and syncs; only the staleness window holds them back:
`accepted + running <= (max_staleness + version + 1) * batch_size` (trainer/buffer.py).
`max_staleness=0` admits one batch per version: synchronous RL, same code. A train step also
waits for the groups admitted max_staleness versions ago (they could not wait another step), so
long rollouts are trained on rather than dropped as too stale.

Rollouts come from a `RolloutSource` (AgentFlow over the gateway in `trainer.run`; anything that
returns a Trajectory in tests). A rollout that raises becomes an `error` trajectory: data, not a
crash. Evaluation (an `Evaluator`) runs at step 0, every `eval.every` steps and at the end. One
in mid-run does not hold the trainer: it runs beside the next train step and is awaited before
that step's weight push (so it sees one version); its step's metrics line is written then.

Checkpoints hold the backend state and the controller's: the prompt stream position, the next
group id and the prompts admitted but not yet trained (re-admitted first on resume, under their
old group ids, so their sampling seeds are unchanged). A resumed synchronous run trains on
exactly the same next batch; an asynchronous one on the same prompts, but which of them land in
which batch depends on completion order, as it does without a resume.

Run directory: config.yaml, metrics.jsonl, samples.jsonl, plots/*.png, checkpoints/, final/.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from gateway.config import dump_yaml, to_dict
from gateway.trajectory import Trajectory
from trainer.backends import TrainBackend, samples_from_batch
from trainer.buffer import Batch, GroupBatcher, PromptStream, StalenessGate
from trainer.config import TrainerConfig
from trainer.metrics import MetricsLogger, plot_run
from trainer.weights import WeightPush

log = logging.getLogger("loongsage.controller")


class RolloutSource(Protocol):
    async def rollout(
        self, prompt: Any, *, group_id: int, sample_index: int, seed: int
    ) -> Trajectory:
        """Play one episode for `prompt` with sampling seed `seed`; return its trajectory."""
        ...


class Evaluator(Protocol):
    async def evaluate(self, step: int) -> dict[str, float]:
        """Held-out evaluation with the engines' current weights, e.g. {"eval/success_rate": x}."""
        ...


def resolve_run_dir(cfg: TrainerConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("step_*/trainer.pt"))
    return found[-1].parent if found else None


@dataclass
class StepTimes:
    wait: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    eval: float = 0.0
    checkpoint: float = 0.0


@dataclass
class Summary:
    run_dir: Path
    steps: int
    reward_first: float | None = None
    reward_last: float | None = None
    eval_first: dict[str, float] = field(default_factory=dict)
    eval_last: dict[str, float] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    final_model: Path | None = None
    aborted: dict[str, int] = field(default_factory=dict)
    """Rollouts that ended `aborted` or `error` (never trained on), by reason."""

    def text(self) -> str:
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        lines = [
            f"LoongSage run finished: {self.steps} steps in {self.run_dir}",
            f"  train reward (mean): {fmt(self.reward_first)} -> {fmt(self.reward_last)}",
        ]
        for key in sorted(self.eval_last):
            lines.append(f"  {key}: {fmt(self.eval_first.get(key))} -> {fmt(self.eval_last[key])}")
        if self.aborted:
            top = sorted(self.aborted.items(), key=lambda kv: -kv[1])[:3]
            reasons = "; ".join(f"{n}x {reason[:120]}" for reason, n in top)
            lines.append(f"  aborted rollouts: {sum(self.aborted.values())} ({reasons})")
        lines.append(f"  plots: {', '.join(str(p) for p in self.plots)}")
        lines.append(f"  model: {self.final_model} (Hugging Face folder)")
        return "\n".join(lines)


class Controller:
    """See the module docstring. `run()` trains for `cfg.run.steps` and returns a Summary."""

    def __init__(
        self,
        cfg: TrainerConfig,
        backend: TrainBackend,
        source: RolloutSource,
        push: WeightPush,
        *,
        prompts: PromptStream | None = None,
        evaluator: Evaluator | None = None,
        decode: Callable[[list[int]], str] | None = None,
        run_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.source = source
        self.push = push
        self.prompts = prompts or PromptStream(seed=cfg.run.seed)
        self.evaluator = evaluator
        self.decode = decode
        self.run_dir = Path(run_dir) if run_dir is not None else resolve_run_dir(cfg)
        r = cfg.rollout
        self.gate = StalenessGate(r.batch_size, r.max_staleness)
        self.batcher = GroupBatcher(
            r.batch_size, r.num_samples_per_prompt, r.max_staleness, r.filter_zero_variance
        )
        self.version = 0
        self.next_group_id = 0
        self.inflight: dict[int, Any] = {}
        """group id -> prompt, for groups admitted and not yet complete."""
        self.resubmit: list[tuple[int, Any]] = []
        """(group id, prompt) restored from a checkpoint, admitted before new prompts."""
        self.batches: list[Batch] = []
        """The last batch trained (kept for inspection and tests)."""
        self._cond = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._admission_error: Exception | None = None
        self.log: MetricsLogger | None = None

    # -- admission and rollouts -----------------------------------------------------------------

    async def _admit(self) -> None:
        try:
            await self._admit_forever()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # e.g. the prompt stream failed: the train loop must not hang
            self._admission_error = e
            async with self._cond:
                self._cond.notify_all()
            raise

    async def _admit_forever(self) -> None:
        while True:
            async with self._cond:
                await self._cond.wait_for(self.gate.can_admit)
                self.gate.admit()
                if self.resubmit:
                    gid, prompt = self.resubmit.pop(0)
                else:
                    gid, prompt = self.next_group_id, self.prompts.next()
                    self.next_group_id += 1
                self.batcher.open(gid, prompt, self.gate.version)
                self.inflight[gid] = prompt
            for i in range(self.cfg.rollout.num_samples_per_prompt):
                task = asyncio.create_task(self._sample(gid, prompt, i))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _seed(self, group_id: int, sample_index: int) -> int:
        n = self.cfg.rollout.num_samples_per_prompt
        return (self.cfg.run.seed * 1_000_003 + group_id * n + sample_index) % 2**31

    async def _sample(self, group_id: int, prompt: Any, sample_index: int) -> None:
        seed = self._seed(group_id, sample_index)
        try:
            traj = await self.source.rollout(
                prompt, group_id=group_id, sample_index=sample_index, seed=seed
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken rollout is data, never a crash of the loop
            traj = Trajectory(
                session_id=f"g{group_id}s{sample_index}",
                status="error",
                reason=f"{type(e).__name__}: {e}",
            )
        traj.metadata.setdefault("sample_index", sample_index)
        if traj.status != "ok":
            log.warning(
                "rollout %s %s, not trained on: %s", traj.session_id, traj.status, traj.reason
            )
        async with self._cond:
            done = self.batcher.add(group_id, traj)
            if done is not None:
                _, accepted = done
                self.gate.finish(accepted)
                del self.inflight[group_id]
                self._cond.notify_all()

    async def _next_batch(self) -> Batch:
        async with self._cond:
            while True:
                stale = self.batcher.drop_stale(self.version)
                if stale:
                    self.gate.unaccept(stale)
                    self._cond.notify_all()
                if self.batcher.num_ready() >= self.cfg.rollout.batch_size and not (
                    self.batcher.waiting_for_old(self.version)
                ):
                    return self.batcher.pop_batch(self.version)
                if self._admission_error is not None:
                    raise RuntimeError("admitting rollouts failed") from self._admission_error
                await self._cond.wait()

    # -- checkpoints ------------------------------------------------------------------------------

    def _controller_state(self) -> dict[str, Any]:
        pending = dict(self.inflight)
        pending.update({g.group_id: g.prompt for g in self.batcher.ready})
        return {
            "version": self.version,
            "next_group_id": self.next_group_id,
            "prompts": self.prompts.state_dict(),
            "pending": sorted(pending.items()),
        }

    def _restore(self, path: Path) -> None:
        extra = self.backend.load_checkpoint(path)
        state = extra["controller"]
        self.version = state["version"]
        self.next_group_id = state["next_group_id"]
        self.prompts.load_state_dict(state["prompts"])
        self.resubmit = [(int(g), p) for g, p in state["pending"]]
        self.gate = StalenessGate(self.gate.batch_size, self.gate.max_staleness, self.version)

    async def _checkpoint(self) -> None:
        path = self.run_dir / "checkpoints" / f"step_{self.version:06d}"
        extra = {"controller": self._controller_state()}  # snapshot now, save off the loop
        await asyncio.to_thread(self.backend.save_checkpoint, path, extra)
        keep = self.cfg.run.keep_checkpoints
        old = sorted(p.parent for p in (self.run_dir / "checkpoints").glob("step_*/trainer.pt"))
        for stale in old[:-keep] if keep else []:
            await asyncio.to_thread(shutil.rmtree, stale, True)

    # -- the loop ---------------------------------------------------------------------------------

    async def _evaluate(self) -> dict[str, float]:
        return await self.evaluator.evaluate(self.version) if self.evaluator else {}

    async def _timed_eval(self) -> tuple[dict[str, float], float]:
        start = time.monotonic()
        return await self._evaluate(), time.monotonic() - start

    async def _log_with_eval(
        self, version: int, metrics: dict[str, float], task: asyncio.Task
    ) -> dict[str, float]:
        """Log a step's metrics once its overlapped eval is done; returns the eval's."""
        result, seconds = await task
        self.log.log(version, metrics | result | {"time/eval_s": seconds})
        return result

    def _trim_samples(self, resume_step: int | None) -> None:
        """A fresh run starts samples.jsonl empty; a resumed one drops the steps it redoes."""
        path = self.run_dir / "samples.jsonl"
        if not path.exists():
            return
        keep = []
        if resume_step is not None:
            keep = [
                x for x in path.read_text().splitlines() if json.loads(x)["step"] <= resume_step
            ]
        path.write_text("".join(x + "\n" for x in keep))

    def _write_samples(self, batch: Batch) -> None:
        k = self.cfg.run.samples_per_step
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for traj in batch.trajectories[:k]:
                tokens = [t for s in traj.segments for t in s.token_ids]
                rec = {
                    "step": self.version + 1,  # the metrics.jsonl step this batch trains
                    "reward": traj.reward,
                    "status": traj.status,
                    "versions": sorted({v for s in traj.segments for v in s.versions if v >= 0}),
                    "text": self.decode(tokens) if self.decode else None,
                    "token_ids": None if self.decode else tokens,
                }
                f.write(json.dumps(rec) + "\n")

    async def run(self) -> Summary:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resume = None
        if cfg.run.resume == "auto":
            resume = latest_checkpoint(self.run_dir)
        elif cfg.run.resume:
            resume = Path(cfg.run.resume)
        if resume is not None:
            self._restore(resume)
            # engines start from the initial weights: give them the resumed ones
            await self.push.push(self.backend.state_dict(), self.version)
        dump_yaml(cfg, self.run_dir / "config.yaml")
        self._trim_samples(self.version if resume is not None else None)
        self.log = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            config=to_dict(cfg),
            resume_step=self.version if resume is not None else None,
        )
        summary = Summary(run_dir=self.run_dir, steps=cfg.run.steps)
        if resume is None:
            summary.eval_first = await self._evaluate()
            self.log.log(0, summary.eval_first)
        bar = tqdm(
            total=cfg.run.steps,
            initial=self.version,
            desc="train",
            disable=not cfg.logging.progress,
            file=sys.stderr,
        )
        admission = asyncio.create_task(self._admit())
        last_end = time.monotonic()
        last_eval: dict[str, float] = dict(summary.eval_first)
        pending: tuple[int, dict[str, float], asyncio.Task] | None = None
        try:
            while self.version < cfg.run.steps:
                t = StepTimes()
                t0 = time.monotonic()
                batch = await self._next_batch()
                t1 = time.monotonic()
                samples = samples_from_batch(batch, cfg.algorithm.advantage)
                train_metrics = await asyncio.to_thread(self.backend.train_step, samples)
                t2 = time.monotonic()
                if pending is not None:  # the last version's eval ran beside this train step
                    last_eval = await self._log_with_eval(*pending)
                    pending = None
                t2b = time.monotonic()  # waiting for that eval is neither training nor sync
                report = await self.push.push(self.backend.state_dict(), self.version + 1)
                t3 = time.monotonic()
                t.wait, t.train, t.sync = t1 - t0, t2 - t1, t3 - t2b
                self._write_samples(batch)
                async with self._cond:
                    self.version += 1
                    self.gate.set_version(self.version)
                    self._cond.notify_all()
                metrics = batch.metrics() | train_metrics | report.metrics()
                metrics |= self.batcher.metrics()
                last = self.version == cfg.run.steps
                every = cfg.eval.every
                if last:
                    te = time.monotonic()
                    last_eval = await self._evaluate()
                    metrics |= last_eval
                    t.eval = time.monotonic() - te
                elif every and self.version % every == 0:
                    # Evaluate the engines' weights of this version while the next step
                    # trains; they are not replaced (pushed) until it is done.
                    pending = (self.version, metrics, asyncio.create_task(self._timed_eval()))
                ce = cfg.run.checkpoint_every
                if last or (ce and self.version % ce == 0):
                    tc = time.monotonic()
                    await self._checkpoint()
                    t.checkpoint = time.monotonic() - tc
                now = time.monotonic()
                wall = now - last_end
                busy = t.train + t.sync + t.checkpoint
                last_end = now
                tokens = sum(tr.num_output_tokens for tr in batch.trajectories)
                metrics |= {
                    "version": float(self.version),
                    "time/generation_wait_s": t.wait,
                    "time/train_s": t.train,
                    "time/weight_sync_s": t.sync,
                    "time/eval_s": t.eval,
                    "time/checkpoint_s": t.checkpoint,
                    "time/step_s": wall,
                    # idle = neither training, syncing nor checkpointing: waiting for rollouts
                    # (and for evaluation, which the train loop awaits)
                    "time/trainer_idle_frac": max(0.0, 1 - busy / wall) if wall > 0 else 0.0,
                    "throughput/tokens_per_s": tokens / wall if wall > 0 else 0.0,
                    "throughput/samples_per_s": len(batch.trajectories) / wall if wall else 0.0,
                    "rollout/inflight_groups": float(len(self.inflight)),
                }
                if summary.reward_first is None:
                    summary.reward_first = metrics["reward/mean"]
                summary.reward_last = metrics["reward/mean"]
                self.batches = [batch]
                if pending is None:
                    self.log.log(self.version, metrics)  # else with its eval, once done
                postfix = {"reward": f"{metrics['reward/mean']:.3f}"}
                postfix |= {k.split("/")[-1]: f"{v:.3f}" for k, v in last_eval.items()}
                bar.set_postfix(postfix)
                bar.update(1)
        finally:
            bar.close()
            admission.cancel()
            if pending is not None:
                pending[2].cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(admission, *self._tasks, return_exceptions=True)
            self.log.close()
        summary.eval_last = last_eval
        summary.aborted = dict(self.batcher.abort_reasons)
        summary.final_model = self.run_dir / "final"
        await asyncio.to_thread(self.backend.save_hf, summary.final_model)
        summary.plots = await asyncio.to_thread(plot_run, self.run_dir)
        return summary
