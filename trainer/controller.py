"""The controller: one process, one loop, for synchronous and asynchronous RL alike.

    admission ──────────► rollouts ──────────► batcher ──────────► train step ──► weight push
    (_admit)              (_sample, N per       (GroupBatcher:      (backend,       (TransferMesh,
    waits: the staleness   group, concurrent)   group complete?     in a thread)    every engine)
    window opens           waits: engines       filter, queue)      waits: a full   then version += 1
    (gate.version moves)                                            batch of groups and the window moves
         ▲                                                                              │
         └──────────────────────────────────────────────────────────────────────────────┘

`Controller.train_step` is the algorithm, top to bottom: each group's rewards become
advantages (`trajectory_advantages`, trainer/algorithms.py, beside the loss; replies near
their token cap lose some with `algorithm.overlong_buffer`), the batch's
segments become train samples (with teachers, each sampled token's advantage also gains its
teacher's signal), the backend takes the loss and optimizer step, the weight push delivers the
new weights to every engine, and the version moves. `run` is the loop around it: wait for a
batch, train, evaluate and checkpoint on schedule, log.

On-policy distillation: with `teachers` (a TeacherManager, trainer/teachers), each finished
sample is scored by its teacher before it joins its group, so a group is complete only when
scored, while other rollouts keep generating; scoring is batched per teacher by the manager.

Admission and rollouts run as asyncio tasks next to the train loop, so generation continues
while the trainer trains and syncs; only the staleness window holds them back:
`accepted + running <= (max_staleness + version + 1) * batch_size` (trainer/buffer.py).
`max_staleness=0` admits one batch per version: synchronous RL, same code. A train step also
waits for the groups admitted max_staleness versions ago (they could not wait another step), so
long rollouts are trained on rather than dropped as too stale.

Rollouts come from a `RolloutSource` (AgentFlow over the gateway in `trainer.run`; anything that
returns a Trajectory in tests). A rollout that raises becomes an `error` trajectory: data, not a
crash. Something that cannot go on (a broken teacher) raises `StopRun`: the run then saves a
checkpoint and stops with that error, to be resumed once it is fixed. Evaluation (an
`Evaluator`) runs at step 0, every `eval.every` steps and at the end. The first runs beside
the first rollouts, one in mid-run beside the next train step; neither holds the trainer: each
is awaited before the next weight push (so it sees one version), and its step's metrics line is
written then. No rollout starts that no step would train (the staleness window stops at the
last step's batch), so the last train step has the cores to itself on a shared CPU and the
final evaluation has the engines to itself.

Checkpoints hold the backend state and the controller's: the prompt stream position, the next
group id and the prompts admitted but not yet trained (re-admitted first on resume, under their
old group ids, so their sampling seeds are unchanged). A resumed synchronous run trains on
exactly the same next batch; an asynchronous one on the same prompts, but which of them land in
which batch depends on completion order, as it does without a resume.

Run directory: config.yaml, metrics.jsonl, samples.jsonl, plots/*.png, checkpoints/, final/.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from gateway.config import dump_yaml, to_dict
from gateway.trajectory import Trajectory
from trainer.algorithms import (
    add_distill_advantages,
    distill_metrics,
    subtract_overlong,
    trajectory_advantages,
)
from trainer.backends import TrainBackend, train_samples
from trainer.buffer import Batch, GroupBatcher, PromptStream, StalenessGate
from trainer.config import TrainerConfig
from trainer.metrics import MetricsLogger, PhaseTimer, SamplesLog, Summary, plot_run
from trainer.transfer import TransferMesh

log = logging.getLogger("loongsage.controller")

PHASES = (
    "time/generation_wait_s",
    "time/train_s",
    "time/weight_sync_s",
    "time/eval_s",
    "time/checkpoint_s",
)
BUSY = ("time/train_s", "time/weight_sync_s", "time/checkpoint_s")
"""Phases in which the trainer works; the rest of a step it waits (for rollouts, evaluation)."""


class StopRun(Exception):
    """Raised by a part the run cannot go on without (a teacher that broke): the controller
    checkpoints and stops with it."""


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


class Teachers(Protocol):
    async def score(self, traj: Trajectory) -> None:
        """Attach its teacher's logprobs to the trajectory's segments; StopRun if one broke."""
        ...

    def metrics(self) -> dict[str, float]: ...


def resolve_run_dir(cfg: TrainerConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("step_*/trainer.pt"))
    return found[-1].parent if found else None


class Controller:
    """See the module docstring. `run()` trains for `cfg.run.steps` and returns a Summary."""

    def __init__(
        self,
        cfg: TrainerConfig,
        backend: TrainBackend,
        source: RolloutSource,
        push: TransferMesh,
        *,
        prompts: PromptStream | None = None,
        evaluator: Evaluator | None = None,
        decode: Callable[[list[int]], str] | None = None,
        run_dir: Path | None = None,
        teachers: Teachers | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.source = source
        self.push = push
        self.prompts = prompts or PromptStream(seed=cfg.run.seed)
        self.evaluator = evaluator
        self.decode = decode
        self.teachers = teachers
        self.run_dir = Path(run_dir) if run_dir is not None else resolve_run_dir(cfg)
        r = cfg.rollout
        self.gate = StalenessGate(r.batch_size, r.max_staleness, steps=cfg.run.steps)
        self.batcher = GroupBatcher(
            r.batch_size, r.num_samples_per_prompt, r.max_staleness, r.filter_zero_variance
        )
        self.version = 0
        self.next_group_id = 0
        self.inflight: dict[int, Any] = {}
        """group id -> prompt, for groups admitted and not yet complete."""
        self._running_eval: asyncio.Task | None = None
        """A mid-run evaluation of the current weights (the next push waits for it)."""
        self.resubmit: list[tuple[int, Any]] = []
        """(group id, prompt) restored from a checkpoint, admitted before new prompts."""
        self._cond = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._admission_error: Exception | None = None
        self._stopped: StopRun | None = None
        self._last_step_end = 0.0
        self.log: MetricsLogger | None = None
        self.samples: SamplesLog | None = None

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> Summary:
        summary = Summary(run_dir=self.run_dir, steps=self.cfg.run.steps)
        resumed = await self._open_run()
        bar = self._progress_bar()
        admission = asyncio.create_task(self._admit())
        self._last_step_end = time.monotonic()
        # a line and its evaluation, running until the next push; the first goes beside the
        # first rollouts (same weights: the engines batch them together)
        pending: tuple[int, dict[str, float], asyncio.Task] | None = None
        if not resumed:
            pending = (0, {}, asyncio.create_task(self._timed_evaluate()))
        try:
            while self.version < self.cfg.run.steps:
                timer = PhaseTimer(*PHASES)
                with timer("time/generation_wait_s"):
                    batch = await self._next_batch()
                self._running_eval = pending[2] if pending else None
                metrics = await self.train_step(batch, timer)
                if pending is not None:
                    version, line, task = pending
                    evaluation, seconds = task.result()
                    if version:
                        summary.record(line | evaluation, evaluation)
                    else:
                        summary.eval_first = summary.eval_last = evaluation
                    self.log.log(version, line | evaluation | {"time/eval_s": seconds})
                    pending = None
                if self.version >= self.cfg.run.steps:  # the final evaluation has the engines
                    await self._stop_rollouts(admission)
                evaluation = await self._evaluate_and_checkpoint(timer)
                metrics |= self._loop_metrics(batch, timer)
                if isinstance(evaluation, asyncio.Task):
                    pending = (self.version, metrics, evaluation)
                else:
                    metrics |= evaluation
                    summary.record(metrics, evaluation)
                    self.log.log(self.version, metrics)
                self._show_progress(bar, metrics, summary.eval_last)
        except StopRun as e:
            await self._checkpoint()
            raise type(e)(
                f"{e}\nThe run stopped at step {self.version} with a checkpoint; once fixed, "
                f"resume with run.resume=auto run.dir={self.run_dir}"
            ) from e
        finally:
            bar.close()
            if pending is not None:
                pending[2].cancel()
            await self._stop_rollouts(admission)
            self.log.close()
        return await self._finish(summary)

    async def train_step(self, batch: Batch, timer: PhaseTimer) -> dict[str, float]:
        """One step of the algorithm on `batch`; returns its metrics. An evaluation of the
        current weights still running is awaited before they are replaced."""
        algorithm = self.cfg.algorithm
        rewards = [group.rewards for group in batch.groups]
        advantages = trajectory_advantages(rewards, algorithm.advantage)
        overlong = {}
        if algorithm.overlong_buffer:
            overlong = subtract_overlong(
                batch.groups, advantages, algorithm.overlong_buffer, algorithm.overlong_penalty
            )
        samples = train_samples(batch, advantages)
        distill = {}
        if self.teachers is not None:  # on-policy distillation: each token learns from its teacher
            add_distill_advantages(samples, algorithm.distill.coef)
            distill = distill_metrics(batch) | self.teachers.metrics()
        with timer("time/train_s"):  # the policy loss and the optimizer step, in the backend
            train_metrics = await asyncio.to_thread(self.backend.train_step, samples)
        if self._running_eval is not None:
            await asyncio.wait([self._running_eval])
        with timer("time/weight_sync_s"):
            report = await self.push.push(self.version + 1)
        await self._set_version(self.version + 1)
        self.samples.write(self.version, batch.trajectories)
        return (
            batch.metrics()
            | overlong
            | distill
            | train_metrics
            | report.metrics()
            | self.batcher.metrics()
        )

    async def _set_version(self, version: int) -> None:
        """The policy moved: the staleness window moves with it."""
        async with self._cond:
            self.version = version
            self.gate.set_version(version)
            self._cond.notify_all()

    async def _evaluate_and_checkpoint(
        self, timer: PhaseTimer
    ) -> dict[str, float] | asyncio.Task[tuple[dict[str, float], float]]:
        """Evaluation and a checkpoint when their schedules say so (both after the last step).
        A mid-run evaluation is returned running, as a task giving (metrics, seconds)."""
        evaluation: dict[str, float] | asyncio.Task = {}
        if self._due(self.cfg.eval.every) and self.version < self.cfg.run.steps:
            evaluation = asyncio.create_task(self._timed_evaluate())
        elif self._due(self.cfg.eval.every):
            with timer("time/eval_s"):
                evaluation = await self._evaluate()
        if self._due(self.cfg.run.checkpoint_every):
            with timer("time/checkpoint_s"):
                await self._checkpoint()
        return evaluation

    def _due(self, every: int) -> bool:
        return self.version == self.cfg.run.steps or (every > 0 and self.version % every == 0)

    async def _evaluate(self) -> dict[str, float]:
        return await self.evaluator.evaluate(self.version) if self.evaluator else {}

    async def _timed_evaluate(self) -> tuple[dict[str, float], float]:
        start = time.monotonic()
        return await self._evaluate(), time.monotonic() - start

    def _loop_metrics(self, batch: Batch, timer: PhaseTimer) -> dict[str, float]:
        now = time.monotonic()
        wall, self._last_step_end = now - self._last_step_end, now
        busy = sum(timer.seconds[phase] for phase in BUSY)
        tokens = sum(t.num_output_tokens for t in batch.trajectories)
        return {
            "version": float(self.version),
            **timer.seconds,
            "time/step_s": wall,
            "time/trainer_idle_frac": max(0.0, 1 - busy / wall) if wall > 0 else 0.0,
            "throughput/tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "throughput/samples_per_s": len(batch.trajectories) / wall if wall else 0.0,
            "rollout/inflight_groups": float(len(self.inflight)),
        }

    def _progress_bar(self) -> tqdm:
        return tqdm(
            total=self.cfg.run.steps,
            initial=self.version,
            desc="train",
            disable=not self.cfg.logging.progress,
            file=sys.stderr,
        )

    @staticmethod
    def _show_progress(bar: tqdm, metrics: dict[str, float], evaluation: dict[str, float]) -> None:
        postfix = {"reward": f"{metrics['reward/mean']:.3f}"}
        postfix |= {k.split("/")[-1]: f"{v:.3f}" for k, v in evaluation.items()}
        bar.set_postfix(postfix)
        bar.update(1)

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
        if self.teachers is not None and traj.status == "ok":
            try:
                await self.teachers.score(traj)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # no sample can be scored: the train loop stops
                async with self._cond:
                    self._stopped = e if isinstance(e, StopRun) else StopRun(f"scoring: {e!r}")
                    self._cond.notify_all()
                return
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
                if self._stopped is not None:
                    raise self._stopped
                await self._cond.wait()

    async def _stop_rollouts(self, admission: asyncio.Task) -> None:
        admission.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(admission, *self._tasks, return_exceptions=True)

    # -- the run directory and checkpoints --------------------------------------------------------

    async def _open_run(self) -> bool:
        """Resume when run.resume says so, then config.yaml and the logs; True if resumed."""
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
            await self.push.push(self.version)
        dump_yaml(cfg, self.run_dir / "config.yaml")
        resume_step = self.version if resume is not None else None
        self.samples = SamplesLog(self.run_dir, cfg.run.samples_per_step, self.decode, resume_step)
        self.log = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            config=to_dict(cfg),
            resume_step=resume_step,
        )
        return resume is not None

    async def _finish(self, summary: Summary) -> Summary:
        summary.aborted = dict(self.batcher.abort_reasons)
        summary.final_model = self.run_dir / "final"
        await asyncio.to_thread(self.backend.save_hf, summary.final_model)
        summary.plots = await asyncio.to_thread(plot_run, self.run_dir)
        return summary

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
        gate = self.gate
        self.gate = StalenessGate(gate.batch_size, gate.max_staleness, self.version, gate.steps)

    async def _checkpoint(self) -> None:
        path = self.run_dir / "checkpoints" / f"step_{self.version:06d}"
        extra = {"controller": self._controller_state()}  # snapshot now, save off the loop
        await asyncio.to_thread(self.backend.save_checkpoint, path, extra)
        keep = self.cfg.run.keep_checkpoints
        old = sorted(p.parent for p in (self.run_dir / "checkpoints").glob("step_*/trainer.pt"))
        for stale in old[:-keep] if keep else []:
            await asyncio.to_thread(shutil.rmtree, stale, True)
