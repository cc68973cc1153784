"""The Teacher Manager: on-policy distillation from several teachers within a memory budget.

The student samples; each finished trajectory is routed by its env to a teacher, which scores
the sampled tokens prefill-only (one logprob per token); the negated per-token reverse KL
`-(logp_student - logp_teacher)` becomes those tokens' advantage, alone (`advantage=opd`) or
added to the task advantage with `algorithm.distill.coef` (trainer/algorithms.py).

- `config.py`: `algorithm.distill` (teachers, route, coef, memory budget);
- `make.py`: teacher folders, including teachers made once by an RL recipe and cached;
- `manager.py`: `TeacherManager` (routing, per-teacher batching, the budget, LRU swaps,
  verification, metrics) and `TeacherError`;
- `residency.py`: how each engine kind enters and leaves memory (`RESIDENCY`).

This module imports only the config, which `trainer.config` needs; import the manager from
`trainer.teachers.manager`.
"""

from trainer.teachers.config import DistillConfig, TeacherConfig, parse_bytes

__all__ = ["DistillConfig", "TeacherConfig", "parse_bytes"]
