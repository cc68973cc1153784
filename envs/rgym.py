"""`loongsage/ReasoningGym-v0`: any `reasoning-gym` task family as a `ToolEnv`.

reasoning-gym (PyPI `reasoning-gym`) ships ~100 procedural task generators (arithmetic, logic,
puzzles, ...) that run offline. This adapter shows a third-party task source plugging in:

    gymnasium.make("loongsage/ReasoningGym-v0", dataset="leg_counting", config={"max_animals": 4})

`dataset` is a reasoning-gym dataset name and `config` its config fields. Item `i` of a
reasoning-gym dataset is a pure function of `(seed, i)`, so the eval split is items
`0..eval_size-1` of the dataset with `seed`, and training tasks are items drawn from
`[eval_size, 2**31)` with the env's RNG (disjoint indexes; equal prompts are re-drawn as in every
ToolEnv). The reward is reasoning-gym's own `score_answer` on the final `Answer:` line (1.0 for
the exact answer; some families give partial credit). `calculator=True` adds the Calc env's
calculator tool. `answer_hint=True` ends every question with the answer format, as Calc's tasks
do: SmolLM2-135M answers `5 * 9 = 45` to a bare question (scored 0) but follows a format asked
for in the user turn.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.base import Task, ToolEnv, extract_answer
from envs.calc import calculator


class ReasoningGymEnv(ToolEnv):
    """A reasoning-gym dataset's questions, scored by its `score_answer`."""

    def __init__(
        self,
        *,
        dataset: str = "chain_sum",
        config: dict[str, Any] | None = None,
        seed: int = 0,
        calculator: bool = False,
        answer_hint: bool = False,
        max_turns: int = 4,
        **kwargs: Any,
    ) -> None:
        try:
            import reasoning_gym
        except ImportError as e:
            raise ImportError(
                "loongsage/ReasoningGym-v0 needs the reasoning-gym package: "
                "pip install reasoning-gym"
            ) from e
        names = sorted(reasoning_gym.factory.DATASETS)
        if dataset not in names:
            raise ValueError(f"dataset={dataset!r} is not a reasoning-gym dataset; one of {names}")
        self.dataset_name = dataset
        self.use_calculator = calculator
        self.answer_hint = answer_hint
        self.dataset = reasoning_gym.create_dataset(
            dataset, **{"seed": seed, "size": 2**31 - 1, **(config or {})}
        )
        super().__init__(max_turns=max_turns, **kwargs)

    def tools(self):
        return [calculator] if self.use_calculator else []

    def _task(self, index: int) -> Task:
        entry = self.dataset[index]
        prompt = entry["question"]
        if self.answer_hint:
            prompt = (
                prompt.rstrip() + "\nPut your final answer on its own line as: Answer: <answer>"
            )
        return Task(prompt=prompt, answer=entry["answer"], data={"entry": entry})

    def sample_task(self, rng: np.random.Generator) -> Task:
        return self._task(int(rng.integers(self.eval_size, 2**31 - 1)))

    def make_eval_tasks(self) -> list[Task]:
        return [self._task(i) for i in range(self.eval_size)]

    def score(self, task: Task, final_answer: str) -> float:
        answer = extract_answer(final_answer)
        if answer is None:
            return 0.0
        try:
            return float(self.dataset.score_answer(answer, task.data["entry"]))
        except Exception:  # a family's scorer choking on odd text is a wrong answer
            return 0.0
